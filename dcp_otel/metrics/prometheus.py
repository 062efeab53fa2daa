"""Prometheus metrics for every checkpoint, from the same DCP events as the spans.

:class:`CheckpointMetrics` defines the metrics (names, labels and buckets come
from :mod:`dcp_otel.semconv`) in one ``CollectorRegistry`` and offers one
method per fact the span recorder learns. Histogram observations made inside a
sampled span carry its ``trace_id`` (32 lowercase hex digits) and ``rank`` as an
exemplar, so a slow bucket in Grafana jumps to the checkpoint's trace
(exemplars are exposed in the OpenMetrics format only, which Prometheus asks
for when it scrapes).

Usage::

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    dcp_otel.instrument(registry=registry)       # default: the global registry
    registry.get_sample_value("dcp_operations_total",
                              {"operation": "save", "status": "success", "rank": "0"})
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from typing import Any, Final, Protocol

from opentelemetry import trace
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.core import GaugeMetricFamily

from dcp_otel import _selftelemetry, semconv
from dcp_otel.live.signal_exceptions import reraise_if_signalled

Exemplar = dict[str, str]
#: One open operation as the in-progress metrics show it: (operation, step, rank, Unix seconds it last
#: made progress, its stall threshold in seconds or ``None`` when stall reports are off).
LiveEntry = tuple[str, str, str, float, float | None]
#: Step and operation label values are DCP function names (bounded by torch's
#: code); anything else is folded into "other" so no label takes free text.
_NAME = re.compile(r"^_?[a-z][a-z_]{0,47}$")
OTHER: Final = "other"


def exemplar_for(span: trace.Span | None, rank: str | None = None) -> Exemplar | None:
    """The exemplar linking an observation to ``span``'s trace, if that trace is recorded.

    Unsampled spans, and every span when no SDK is configured, are
    ``NonRecordingSpan`` (which may still carry a valid, sampled parent
    context): no exemplar may point at a trace nobody records. Not
    ``is_recording()``: an SDK span says False once it has ended.
    """
    if span is None or isinstance(span, trace.NonRecordingSpan):
        return None
    return exemplar_for_context(span.get_span_context(), rank)


def exemplar_for_context(ctx: trace.SpanContext, rank: str | None = None) -> Exemplar | None:
    """The exemplar for a span known only by its context (say, a parent in another
    process, whose sampled flag says whether its trace is recorded)."""
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    exemplar = {semconv.EXEMPLAR_TRACE_ID: format(ctx.trace_id, "032x"), semconv.EXEMPLAR_SPAN_ID: format(ctx.span_id, "016x")}
    if rank is not None:
        exemplar[semconv.EXEMPLAR_RANK] = rank
    return exemplar


def prometheus_collector(spec: semconv.MetricSpec, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    """The prometheus-client metric for ``spec``, registered in ``registry``.

    Raises:
        ValueError: a metric of that name is already registered there.
    """
    name, doc, labels = spec.prometheus, spec.description, list(spec.labels)
    if spec.kind == semconv.KIND_HISTOGRAM:
        return Histogram(name, doc, labels, buckets=spec.buckets or Histogram.DEFAULT_BUCKETS, registry=registry)
    if spec.kind == semconv.KIND_COUNTER:
        return Counter(name, doc, labels, registry=registry)
    mode: Any = spec.multiprocess_mode or "all"  # one of prometheus-client's modes, checked by Gauge
    return Gauge(name, doc, labels, registry=registry, multiprocess_mode=mode)


def process_rank() -> str:
    """This process's rank, as torchrun and dcp-otel-run set it (``"0"`` elsewhere): telemetry problems belong to a process."""
    rank_env = os.environ.get("RANK", "").strip()
    return rank_env if rank_env.isdigit() else "0"


def bounded_name(name: str) -> str:
    """``name`` if it looks like a DCP function name, else ``"other"``."""
    return name if _NAME.match(name) else OTHER


class BoundedLabel:
    """Label values from a set that is small in practice but not closed (exception class names): each value must
    look like an identifier, and past ``limit`` distinct ones every new one is ``"other"``."""

    _SHAPE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if not self._SHAPE.match(value) or len(self._seen) >= self._limit:
            return OTHER
        self._seen.add(value)
        return value


#: The ``error_type`` label: exception class names, at most 32 per process.
ERROR_TYPES = BoundedLabel(32)


class MetricsSink(Protocol):
    """What the span recorder tells metrics: :class:`CheckpointMetrics`, or the
    :class:`~dcp_otel.metrics.relay.MetricsRelay` standing in for it in the async save process."""

    def operation_done(
        self,
        operation: str,
        rank: str,
        ok: bool,
        duration_s: float,
        wait_s: float,
        end_unix_s: float,
        exemplar: Exemplar | None,
    ) -> None: ...

    def step_done(self, operation: str, step: str, rank: str, duration_s: float, exemplar: Exemplar | None) -> None: ...

    def bytes_written(self, rank: str, amount: int) -> None: ...

    def bytes_read(self, rank: str, amount: int) -> None: ...

    def bytes_staged(self, device: str, rank: str, amount: int) -> None: ...

    def async_handed_off(self, rank: str) -> None: ...

    def async_phase_done(self, phase: str, rank: str, duration_s: float, exemplar: Exemplar | None) -> None: ...

    def async_upload_done(self, rank: str, duration_s: float, exemplar: Exemplar | None) -> None: ...

    def stalled(self, operation: str, step: str, rank: str) -> None: ...

    def failure_started(self, operation: str, rank: str, error_type: str) -> None: ...

    def training_blocked(self, operation: str, rank: str, seconds: float) -> None: ...

    def training_step(self, overlaps: str, rank: str, seconds: float, exemplar: Exemplar | None) -> None: ...

    def training_interference(self, operation: str, rank: str, seconds: float) -> None: ...


def multiprocess_mode() -> bool:
    """Whether prometheus_client records into ``$PROMETHEUS_MULTIPROC_DIR``'s files (decided when it was imported)."""
    return bool(getattr(values.ValueClass, "_multiprocess", False))


class CheckpointMetrics:
    """The checkpoint metrics of one instrumentation, registered in ``registry``.

    Raises:
        ValueError: the metrics are already registered there (instrumenting
            twice into one registry without uninstrumenting).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else REGISTRY
        self._collectors: list[Counter | Gauge | Histogram] = []
        # (histogram, its labels) -> its series, for the histograms observed many times a checkpoint: DCP's steps
        # (bounded by their names) and the training steps (ten or more a checkpoint).
        self._series: dict[tuple[object, tuple[str, ...]], Any] = {}
        try:
            new = self._add
            self.operation_duration: Histogram = new(semconv.OPERATION_DURATION)
            self.step_duration: Histogram = new(semconv.STEP_DURATION)
            self.operations: Counter = new(semconv.OPERATION_COUNT)
            self.written_bytes: Counter = new(semconv.WRITTEN_BYTES)
            self.read_bytes: Counter = new(semconv.READ_BYTES)
            self.staged_bytes: Counter = new(semconv.STAGED_BYTES)
            self.async_in_flight: Gauge = new(semconv.ASYNC_IN_FLIGHT)
            self.async_phase: Histogram = new(semconv.ASYNC_PHASE_DURATION)
            self.collective_wait: Histogram = new(semconv.COLLECTIVE_WAIT)
            self.last_success: Gauge = new(semconv.LAST_SUCCESS)
            self.last_duration: Gauge = new(semconv.LAST_DURATION)
            self.telemetry_problems: Counter = new(semconv.TELEMETRY_PROBLEMS)
            self.stalls: Counter = new(semconv.STALLS)
            self.failures: Counter = new(semconv.FAILURES)
            self.training_blocked_seconds: Counter = new(semconv.TRAINING_BLOCKED)
            self.training_steps: Histogram = new(semconv.TRAINING_STEP)
            self.training_interference_seconds: Counter = new(semconv.TRAINING_INTERFERENCE)
            #: What is open now; set by the instrumentor (read at every collection).
            self.live: Callable[[], list[LiveEntry]] | None = None
            # In multiprocess mode only the files are served: the watchdog publishes into gauges
            # (publish_progress); otherwise a collection reads the open calls itself.
            self.multiprocess = multiprocess_mode()
            self._published: dict[tuple[Gauge, tuple[str, ...]], float] = {}
            if self.multiprocess:
                self.in_progress: Gauge = new(semconv.IN_PROGRESS)
                self.stall_threshold: Gauge = new(semconv.STALL_THRESHOLD)
            else:
                collector = LiveCollector(self)
                self.registry.register(collector)
                self._collectors.append(collector)  # type: ignore[arg-type]
        except ValueError:
            self.unregister()
            raise
        self._rank = process_rank()
        _selftelemetry.add_listener(self._problem)

    def _problem(self, reason: str) -> None:
        self.telemetry_problems.labels(bounded_name(reason), self._rank).inc()

    def _add(self, spec: semconv.MetricSpec) -> Any:
        collector = prometheus_collector(spec, self.registry)
        self._collectors.append(collector)
        return collector

    def unregister(self) -> None:
        """Remove our metrics from the registry (on uninstrument)."""
        _selftelemetry.remove_listener(self._problem)
        for collector in self._collectors:
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass
        self._collectors.clear()

    # --- facts from the span recorder --------------------------------------
    def operation_done(
        self,
        operation: str,
        rank: str,
        ok: bool,
        duration_s: float,
        wait_s: float,
        end_unix_s: float,
        exemplar: Exemplar | None,
    ) -> None:
        operation = bounded_name(operation)
        status = semconv.STATUS_SUCCESS if ok else semconv.STATUS_FAILURE
        self.operation_duration.labels(operation, status, rank).observe(duration_s, exemplar)
        # Both outcomes exist from the first operation on: a failure counter that is
        # born at 1 is invisible to increase(), so alerts and dashboards would miss it.
        for outcome in (semconv.STATUS_SUCCESS, semconv.STATUS_FAILURE):
            child = self.operations.labels(operation, outcome, rank)
            if outcome == status:
                child.inc()
        self.collective_wait.labels(operation, rank).observe(max(0.0, wait_s), exemplar)
        self.last_duration.labels(operation, status, rank).set(duration_s)
        if ok:
            self.last_success.labels(operation, rank).set(end_unix_s)

    def _series_of(self, histogram: Histogram, key: tuple[str, ...],
                   labels: Callable[[], tuple[str, ...]] | None = None) -> Any:  # fmt: skip
        """``histogram``'s series for ``key`` (its label values as ``labels()`` makes them, else ``key`` itself),
        looked up once: labels() validates and locks at every call."""
        child = self._series.get((histogram, key))
        if child is None:
            child = self._series[(histogram, key)] = histogram.labels(*(labels() if labels else key))
        return child

    def step_done(self, operation: str, step: str, rank: str, duration_s: float, exemplar: Exemplar | None) -> None:
        series = self._series_of(self.step_duration, (operation, step, rank),
                                 lambda: (bounded_name(operation), bounded_name(step), rank))  # fmt: skip
        series.observe(duration_s, exemplar)

    def bytes_written(self, rank: str, amount: int) -> None:
        if amount > 0:
            self.written_bytes.labels(rank).inc(amount)

    def bytes_read(self, rank: str, amount: int) -> None:
        if amount > 0:
            self.read_bytes.labels(rank).inc(amount)

    def bytes_staged(self, device: str, rank: str, amount: int) -> None:
        if amount > 0:
            self.staged_bytes.labels(device, rank).inc(amount)

    def async_handed_off(self, rank: str) -> None:
        self.async_in_flight.labels(rank).inc()

    def async_phase_done(self, phase: str, rank: str, duration_s: float, exemplar: Exemplar | None) -> None:
        self.async_phase.labels(phase, rank).observe(duration_s, exemplar)

    def async_upload_done(self, rank: str, duration_s: float, exemplar: Exemplar | None) -> None:
        self.async_in_flight.labels(rank).dec()
        self.async_phase_done(semconv.PHASE_UPLOAD, rank, duration_s, exemplar)

    def stalled(self, operation: str, step: str, rank: str) -> None:
        self.stalls.labels(bounded_name(operation), bounded_step(step), rank).inc()

    def failure_started(self, operation: str, rank: str, error_type: str) -> None:
        self.failures.labels(bounded_name(operation), rank, ERROR_TYPES(error_type)).inc()

    def training_blocked(self, operation: str, rank: str, seconds: float) -> None:
        if seconds > 0:
            self.training_blocked_seconds.labels(bounded_name(operation), rank).inc(seconds)

    def training_step(self, overlaps: str, rank: str, seconds: float, exemplar: Exemplar | None) -> None:
        self._series_of(self.training_steps, (overlaps, rank)).observe(seconds, exemplar)

    def training_interference(self, operation: str, rank: str, seconds: float) -> None:
        # (0 too: the series exists, so a rate over it reads 0 rather than nothing, once a checkpoint was measured)
        self.training_interference_seconds.labels(bounded_name(operation), rank).inc(seconds)

    def publish_progress(self, entries: list[LiveEntry]) -> None:
        """Multiprocess mode: set the in-progress gauges to ``entries``; those no longer open go to 0.

        prometheus_client cannot remove a series from the shared files, so a
        finished one reads 0 there, and the node's endpoint leaves it out
        (:func:`dcp_otel.metrics.exposition.start_metrics_server`); rules select ``> 0``.
        """
        if not self.multiprocess:
            return
        wanted: dict[tuple[Gauge, tuple[str, ...]], float] = {}
        for operation, step, rank, since_s, threshold_s in entries:
            operation = bounded_name(operation)
            wanted[(self.in_progress, (operation, bounded_step(step), rank))] = since_s
            if threshold_s is not None:
                wanted[(self.stall_threshold, (operation, rank))] = threshold_s
        for (gauge, labels), value in wanted.items():
            if self._published.get((gauge, labels)) != value:
                gauge.labels(*labels).set(value)
        for gauge, labels in set(self._published) - set(wanted):
            gauge.labels(*labels).set(0)
        self._published = wanted


def bounded_step(step: str) -> str:
    """A step label: a DCP function name, or ``"-"`` between steps."""
    return step if step == semconv.STEP_NONE else bounded_name(step)


class LiveCollector:
    """The in-progress gauges of one :class:`CheckpointMetrics`, read from the open calls at each collection."""

    def __init__(self, metrics: CheckpointMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[object]:
        return []  # nothing to check for duplicates: our names are registered by no one else

    def collect(self) -> Iterator[GaugeMetricFamily]:
        live = self._metrics.live
        entries = live() if live is not None else []
        progress = GaugeMetricFamily(semconv.IN_PROGRESS.prometheus, semconv.IN_PROGRESS.description,
                                     labels=list(semconv.IN_PROGRESS.labels))  # fmt: skip
        threshold = GaugeMetricFamily(semconv.STALL_THRESHOLD.prometheus, semconv.STALL_THRESHOLD.description,
                                      labels=list(semconv.STALL_THRESHOLD.labels))  # fmt: skip
        thresholds: dict[tuple[str, str], float] = {}
        for operation, step, rank, since_s, threshold_s in entries:
            progress.add_metric([bounded_name(operation), bounded_step(step), rank], since_s)
            if threshold_s is not None:
                thresholds[(bounded_name(operation), rank)] = threshold_s
        for labels, value in thresholds.items():
            threshold.add_metric(list(labels), value)
        yield progress
        yield threshold


class ForwardingSink:
    """A ``MetricsSink`` that hands every fact, by method name, to :meth:`_forward`.

    The sinks that stand in for others subclass it: :class:`FanOut` (several
    sinks) and :class:`~dcp_otel.metrics.relay.MetricsRelay` (the async save
    daemon's pipe to its rank).
    """

    def _forward(self, name: str, *args: Any) -> None:
        raise NotImplementedError

    def operation_done(
        self,
        operation: str,
        rank: str,
        ok: bool,
        duration_s: float,
        wait_s: float,
        end_unix_s: float,
        exemplar: Exemplar | None,
    ) -> None:
        self._forward("operation_done", operation, rank, ok, duration_s, wait_s, end_unix_s, exemplar)

    def step_done(self, operation: str, step: str, rank: str, duration_s: float, exemplar: Exemplar | None) -> None:
        self._forward("step_done", operation, step, rank, duration_s, exemplar)

    def bytes_written(self, rank: str, amount: int) -> None:
        self._forward("bytes_written", rank, amount)

    def bytes_read(self, rank: str, amount: int) -> None:
        self._forward("bytes_read", rank, amount)

    def bytes_staged(self, device: str, rank: str, amount: int) -> None:
        self._forward("bytes_staged", device, rank, amount)

    def async_handed_off(self, rank: str) -> None:
        self._forward("async_handed_off", rank)

    def async_phase_done(self, phase: str, rank: str, duration_s: float, exemplar: Exemplar | None) -> None:
        self._forward("async_phase_done", phase, rank, duration_s, exemplar)

    def async_upload_done(self, rank: str, duration_s: float, exemplar: Exemplar | None) -> None:
        self._forward("async_upload_done", rank, duration_s, exemplar)

    def stalled(self, operation: str, step: str, rank: str) -> None:
        self._forward("stalled", operation, step, rank)

    def failure_started(self, operation: str, rank: str, error_type: str) -> None:
        self._forward("failure_started", operation, rank, error_type)

    def training_blocked(self, operation: str, rank: str, seconds: float) -> None:
        self._forward("training_blocked", operation, rank, seconds)

    def training_step(self, overlaps: str, rank: str, seconds: float, exemplar: Exemplar | None) -> None:
        self._forward("training_step", overlaps, rank, seconds, exemplar)

    def training_interference(self, operation: str, rank: str, seconds: float) -> None:
        self._forward("training_interference", operation, rank, seconds)


class FanOut(ForwardingSink):
    """Several sinks fed the same facts (Prometheus and OpenTelemetry): one failing never starves the other.

    Usage::

        sink = FanOut([CheckpointMetrics(), OTelCheckpointMetrics()])
    """

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = tuple(sinks)

    def _forward(self, name: str, *args: Any) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, name)(*args)
            except Exception as exc:  # noqa: BLE001 - the next sink still gets the fact
                reraise_if_signalled(exc)
                _selftelemetry.report("metrics_error", "dcp_otel failed to record a checkpoint metric (%s in %s)",
                                      name, type(sink).__name__, exc_info=True)  # fmt: skip
