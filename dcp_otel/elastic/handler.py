"""``OTelMetricHandler``: torchelastic's metrics as Prometheus and OpenTelemetry metrics, and spans.

torchelastic publishes metrics through ``torch.distributed.elastic.metrics``
(``put_metric``, ``@prof``) to a ``MetricHandler``; torch ships only a console
and a null handler. This one maps them, as a contract:

* ``<name>.duration.ms`` -> an observation of
  ``torchelastic_duration_seconds{group, name}``, and a span
  ``torchelastic.<name>`` reconstructed from the duration (it ends at the
  metric's timestamp) under the current context, so agent phases such as
  rendezvous and worker restarts appear in traces;
* ``<name>.success`` / ``<name>.failure`` ->
  ``torchelastic_calls_total{group, name, status}``;
* anything else -> ``torchelastic_events_total{group, name}`` incremented by
  its value, and ``torchelastic_last_value{group, name}`` set to it.

Each metric is recorded in prometheus-client and, when OpenTelemetry metrics
are asked for (a ``meter_provider``, ``$OTEL_METRICS_EXPORTER``, or
``metrics``/``$DCP_OTEL_METRICS``), as an OpenTelemetry instrument of the same
catalogue (``torchelastic.duration`` in seconds, and so on; see
:data:`dcp_otel.semconv.ELASTIC_METRICS`).

Custom rules run first: callables given ``(group, name, value, timestamp)``
that return ``True`` when they handled the metric.

``emit`` never raises and is thread-safe. Names are made label-safe; values
that are None, NaN, infinite, bool, not numbers, or beyond 2**53 are dropped,
and negative ones are not counted (only ``last_value`` takes them), each with a
counted, rate-limited warning (``torchelastic_dropped_metrics_total{reason}``
and :func:`dcp_otel.diagnostics`). Past ``max_series`` distinct
(group, name) pairs, new ones are folded into ``_overflow``.

Usage::

    from torch.distributed.elastic import metrics
    from dcp_otel import OTelMetricHandler

    metrics.configure(OTelMetricHandler())                 # every group
    metrics.configure(OTelMetricHandler(), group="agent")  # or one group
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final

from opentelemetry import trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from torch.distributed.elastic.metrics.api import MetricData, MetricHandler

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.config import metric_sinks_from_env
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.metrics.otel import OTelElasticInstruments
from dcp_otel.metrics.prometheus import exemplar_for, prometheus_collector
from dcp_otel.version import __version__

#: ``rule(group, name, value, timestamp) -> handled``
MetricRule = Callable[[str, str, float, float], bool]

_DURATION_SUFFIX: Final = ".duration.ms"
_SUCCESS_SUFFIX: Final = ".success"
_FAILURE_SUFFIX: Final = ".failure"
_MAX_LABEL: Final = 128
_MAX_EXACT: Final = 2**53  # beyond this a float no longer counts by ones


class OTelMetricHandler(MetricHandler):
    """A torchelastic ``MetricHandler`` recording into Prometheus and OpenTelemetry.

    Args:
        registry: where the metrics go (default: the global registry).
            Several handlers may share one registry: the metrics are
            registered once per registry.
        tracer_provider: where duration spans go (default: the global one).
        rules: custom mappings tried before the default ones.
        max_series: distinct (group, name) pairs kept before folding new ones
            into ``_overflow``.
        meter_provider: where the OpenTelemetry side of the metrics goes
            (default: the global one, which ``opentelemetry-instrument`` sets).
        metrics: ``"prometheus"``, ``"opentelemetry"``, both or ``"none"``,
            with the same default as :func:`dcp_otel.instrument`
            (``$DCP_OTEL_METRICS``, else Prometheus, plus OpenTelemetry when
            ``meter_provider`` is given or ``$OTEL_METRICS_EXPORTER`` is set).

    Raises:
        ValueError: ``max_series`` is not a positive integer, a rule is not
            callable, a bad ``metrics`` value, or ``meter_provider`` is not a
            ``MeterProvider``.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        tracer_provider: TracerProvider | None = None,
        *,
        rules: Sequence[MetricRule] = (),
        max_series: int = 500,
        meter_provider: MeterProvider | None = None,
        metrics: str | Sequence[str] | None = None,
    ) -> None:
        if isinstance(max_series, bool) or not isinstance(max_series, int) or max_series < 1:
            raise ValueError(f"max_series must be a positive integer, got {max_series!r}")
        if not all(callable(rule) for rule in rules):
            raise ValueError("every rule must be callable(group, name, value, timestamp) -> bool")
        if meter_provider is not None and not isinstance(meter_provider, MeterProvider):
            raise ValueError(f"meter_provider must be an opentelemetry MeterProvider, got {type(meter_provider).__name__}")
        sinks = metric_sinks_from_env(metrics, meter_provider)
        self._metrics = (_ElasticMetrics.for_registry(registry if registry is not None else REGISTRY)
                         if semconv.SINK_PROMETHEUS in sinks else None)  # fmt: skip
        self._otel = OTelElasticInstruments.for_provider(meter_provider) if semconv.SINK_OPENTELEMETRY in sinks else None
        self._tracer = trace.get_tracer(semconv.SCOPE_NAME, __version__, tracer_provider)
        self._rules = tuple(rules)
        self._max_series = max_series
        self._series: set[tuple[str, str]] = set()
        # (raw group, raw name) -> its resolved _Route; bounded at 2 * max_series.
        self._routes: dict[tuple[object, object], _Route] = {}
        self._lock = threading.Lock()

    def emit(self, metric_data: MetricData) -> None:
        """Record one metric; never raises (see the module docstring)."""
        try:
            raw_group, raw_name = getattr(metric_data, "group_name", None), getattr(metric_data, "name", None)
            raw_value = getattr(metric_data, "value", None)
            # Ints (put_metric's usual 1) take the fast path; anything else is checked fully.
            value = raw_value if type(raw_value) is int and -_MAX_EXACT <= raw_value <= _MAX_EXACT else _number(raw_value)
            if value is None:  # checked first: a dropped value must not create a series
                self._drop("bad_value", "dropped torchelastic metric %r: value %r is not a finite number", raw_name,
                           raw_value)  # fmt: skip
                return
            try:
                route = self._routes.get((raw_group, raw_name))
            except TypeError:  # an unhashable name: resolve it every time
                route = None
            if route is None:
                route = self._route(raw_group, raw_name)
                if route is None:
                    self._drop("bad_name", "dropped a torchelastic metric with no usable name")
                    return
            if self._rules and self._apply_rules(route, value, metric_data):
                return
            kind, prom, otel = route.kind, self._metrics, self._otel
            if kind is _EVENT:
                if prom is not None:
                    (route.gauge or route.create("gauge", prom.last_value)).set(value)
                if otel is not None:
                    otel.last_value.set(value, route.attributes)
            if value < 0:
                self._drop("negative_value", "did not count torchelastic metric %r: negative value", route.name)
            elif kind is _CALLS or kind is _EVENT:
                if prom is not None:
                    (route.counter or route.create("counter", prom.calls if kind is _CALLS else prom.events)).inc(value)
                if otel is not None:
                    (otel.calls if kind is _CALLS else otel.events).add(value, route.attributes)
            else:
                self._duration(route, value, _number(getattr(metric_data, "timestamp", None)))
        except Exception as exc:  # noqa: BLE001 - a metrics sink must never break the agent
            reraise_if_signalled(exc)
            self._drop("handler_error", "OTelMetricHandler failed to record a metric", exc_info=True)

    def _apply_rules(self, route: _Route, value: float, data: MetricData) -> bool:
        timestamp = _number(getattr(data, "timestamp", None))
        return any(rule(route.group, route.name, value, timestamp if timestamp is not None else 0.0)
                   for rule in self._rules)  # fmt: skip

    def _route(self, raw_group: object, raw_name: object) -> _Route | None:
        """Resolve what a (group, name) pair maps to, once; cache it (bounded)."""
        name = _label(raw_name)
        if not name:
            return None
        group = _label(raw_group) or "default"
        if name.endswith(_DURATION_SUFFIX):
            bounded_group, base = self._bounded(group, name[: -len(_DURATION_SUFFIX)])
            route = _Route(group, name, _DURATION, (bounded_group, base))
        elif name.endswith(_SUCCESS_SUFFIX) or name.endswith(_FAILURE_SUFFIX):
            ok = name.endswith(_SUCCESS_SUFFIX)
            bounded_group, base = self._bounded(group, name[: -len(_SUCCESS_SUFFIX if ok else _FAILURE_SUFFIX)])
            status = semconv.STATUS_SUCCESS if ok else semconv.STATUS_FAILURE
            route = _Route(group, name, _CALLS, (bounded_group, base, status))
        else:
            bounded_group, base = self._bounded(group, name)
            route = _Route(group, name, _EVENT, (bounded_group, base))
        with self._lock:
            if len(self._routes) < 2 * self._max_series:
                try:
                    self._routes[(raw_group, raw_name)] = route
                except TypeError:
                    pass
        return route

    def _duration(self, route: _Route, value_ms: float, timestamp: float | None) -> None:
        seconds = value_ms / 1000.0
        span = None
        if timestamp is not None:
            end_ns = int(timestamp * 1e9)
            group, base = route.labels
            span = self._tracer.start_span(
                semconv.SPAN_ELASTIC_PREFIX + base,
                start_time=end_ns - int(seconds * 1e9),
                attributes={semconv.ATTR_ELASTIC_GROUP: group, semconv.ATTR_ELASTIC_NAME: base},
            )
            span.end(end_time=end_ns)
        if self._metrics is not None:
            (route.histogram or route.create("histogram", self._metrics.duration)).observe(seconds, exemplar_for(span))
        if self._otel is not None:
            # The span's own context: the trace-based exemplar filter links the observation to it.
            ctx = trace.set_span_in_context(span) if span is not None else None
            self._otel.duration.record(seconds, route.attributes, context=ctx)

    def _bounded(self, group: str, name: str) -> tuple[str, str]:
        """(group, name) itself, or the overflow pair once ``max_series`` pairs exist."""
        key = (group, name)
        with self._lock:
            if key in self._series:
                return key
            if len(self._series) < self._max_series:
                self._series.add(key)
                return key
        self._drop("series_limit", "torchelastic metric %s/%s folded into %s: more than %d series", group, name,
                   semconv.OVERFLOW, self._max_series)  # fmt: skip
        return semconv.OVERFLOW, semconv.OVERFLOW

    def _drop(self, reason: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        report(f"torchelastic_{reason}", msg, *args, exc_info=exc_info)
        try:
            if self._metrics is not None:
                self._metrics.dropped.labels(reason).inc()
            if self._otel is not None:
                self._otel.dropped.add(1, {semconv.LABEL_REASON: reason})
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)


_DURATION, _CALLS, _EVENT = "duration", "calls", "event"


class _Route:
    """What one (group, name) pair maps to: resolved once, then reused for every value.

    Labelled series are created on first use (:meth:`create`), so a value that
    is dropped, or handled by a custom rule, never leaves an empty series.
    """

    __slots__ = ("group", "name", "kind", "labels", "attributes", "counter", "gauge", "histogram")

    def __init__(self, group: str, name: str, kind: str, labels: tuple[str, ...]) -> None:
        self.group, self.name, self.kind, self.labels = group, name, kind, labels
        keys = (semconv.LABEL_GROUP, semconv.LABEL_NAME, semconv.LABEL_STATUS)
        #: The same labels as OpenTelemetry attributes.
        self.attributes = dict(zip(keys, labels, strict=False))  # events have no status
        self.counter: Any = None
        self.gauge: Any = None
        self.histogram: Any = None

    def create(self, slot: str, family: Counter | Gauge | Histogram) -> Any:
        """The series of ``family`` for this route's labels, kept in ``slot``."""
        child = family.labels(*self.labels)
        setattr(self, slot, child)
        return child


class _ElasticMetrics:
    """The handler's metrics, registered once per registry (handlers share them)."""

    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _ElasticMetrics] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> _ElasticMetrics:
        with cls._lock:
            metrics = cls._by_registry.get(registry)
            if metrics is None:
                metrics = cls._by_registry[registry] = cls(registry)
            return metrics

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration: Histogram = prometheus_collector(semconv.ELASTIC_DURATION, registry)  # type: ignore[assignment]
        self.calls: Counter = prometheus_collector(semconv.ELASTIC_CALLS, registry)  # type: ignore[assignment]
        self.events: Counter = prometheus_collector(semconv.ELASTIC_EVENTS, registry)  # type: ignore[assignment]
        self.last_value: Gauge = prometheus_collector(semconv.ELASTIC_LAST_VALUE, registry)  # type: ignore[assignment]
        self.dropped: Counter = prometheus_collector(semconv.ELASTIC_DROPPED, registry)  # type: ignore[assignment]


def _label(value: object) -> str:
    """A label-safe string: str, or a number's text; control characters removed, length capped."""
    if isinstance(value, bool) or value is None:
        return ""
    if isinstance(value, (int, float)):
        value = str(value)
    if not isinstance(value, str):
        return ""
    cleaned = "".join(ch for ch in value if ch.isprintable()).strip()
    return cleaned[:_MAX_LABEL]


def _number(value: object) -> float | None:
    """A finite, not absurd number as float; ``None`` for anything else (bools included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    if math.isnan(number) or math.isinf(number) or abs(number) > _MAX_EXACT:
        return None
    return number

