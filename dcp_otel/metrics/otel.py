"""Checkpoint metrics through the OpenTelemetry metrics API, for OTLP push.

The same catalogue as the Prometheus metrics (:data:`dcp_otel.semconv.CHECKPOINT_METRICS`),
recorded as OpenTelemetry instruments of a ``MeterProvider``: the one given to
``instrument(meter_provider=...)``, else the global one, which
``opentelemetry-instrument`` configures from ``OTEL_METRICS_EXPORTER`` and
which forwards to a provider set later. Each instrument has the OTel name and
the unit in ``unit``, the same attributes as the Prometheus labels, and the
histogram bounds as the explicit bucket advisory; exported to Prometheus
(through the Collector, Prometheus's OTLP receiver or
``opentelemetry-exporter-prometheus``) the names come back as today's.

Observations are made on the builder thread, after the operation ended, so each
carries the context of the operation's span: the SDK's default trace-based
exemplar filter then attaches that span's trace and span ids as an exemplar.

Usage::

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    provider = MeterProvider([PeriodicExportingMetricReader(OTLPMetricExporter())])
    dcp_otel.instrument(meter_provider=provider)                    # Prometheus and OTLP
    dcp_otel.instrument(meter_provider=provider, metrics="opentelemetry")  # OTLP only
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from dcp_otel import _selftelemetry, semconv
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.metrics.prometheus import ERROR_TYPES, Exemplar, LiveEntry, bounded_name, bounded_step, process_rank
from dcp_otel.version import __version__

if TYPE_CHECKING:
    from dcp_otel.tracing.builder import SpanBuilder

def meter(provider: MeterProvider | None) -> Meter:
    """dcp-otel's meter in ``provider`` (``None``: the global provider)."""
    return otel_metrics.get_meter(semconv.SCOPE_NAME, __version__, provider)


def create_instrument(m: Meter, spec: semconv.MetricSpec) -> Any:
    """The OpenTelemetry instrument for ``spec``."""
    if spec.kind == semconv.KIND_HISTOGRAM:
        return m.create_histogram(spec.otel, spec.unit, spec.description,
                                  explicit_bucket_boundaries_advisory=list(spec.buckets or ()) or None)  # fmt: skip
    if spec.kind == semconv.KIND_COUNTER:
        return m.create_counter(spec.otel, spec.unit, spec.description)
    if spec.kind == semconv.KIND_UPDOWN:
        return m.create_up_down_counter(spec.otel, spec.unit, spec.description)
    if spec.kind == semconv.KIND_OBSERVED:
        return m.create_observable_gauge(spec.otel, [_OBSERVERS[spec.otel]], spec.unit, spec.description)
    return m.create_gauge(spec.otel, spec.unit, spec.description)


class ExemplarContexts:
    """The context carrying an exemplar's span, as the trace-based exemplar filter reads it.

    The builder passes the same exemplar for every observation of one
    operation, so the last one is kept.
    """

    def __init__(self) -> None:
        self._last: tuple[Exemplar | None, Context | None] = (None, None)

    def __call__(self, exemplar: Exemplar | None) -> Context | None:
        if exemplar is None:
            return None
        last, ctx = self._last
        if exemplar is last:
            return ctx
        try:
            span_context = SpanContext(int(exemplar[semconv.EXEMPLAR_TRACE_ID], 16),
                                       int(exemplar.get(semconv.EXEMPLAR_SPAN_ID, "0"), 16), False,
                                       TraceFlags(TraceFlags.SAMPLED))  # fmt: skip
        except (KeyError, ValueError, TypeError):
            return None
        ctx = trace.set_span_in_context(NonRecordingSpan(span_context)) if span_context.is_valid else None
        self._last = (exemplar, ctx)
        return ctx


class OTelCheckpointMetrics:
    """The checkpoint metrics of one instrumentation as OpenTelemetry instruments (a ``MetricsSink``).

    ``meter_provider`` ``None`` records through the global provider, so a
    provider set after ``instrument()`` still gets them.
    """

    def __init__(self, meter_provider: MeterProvider | None = None) -> None:
        self.meter_provider = meter_provider
        m = meter(meter_provider)
        self.operation_duration = create_instrument(m, semconv.OPERATION_DURATION)
        self.step_duration = create_instrument(m, semconv.STEP_DURATION)
        self.operations = create_instrument(m, semconv.OPERATION_COUNT)
        self.written_bytes = create_instrument(m, semconv.WRITTEN_BYTES)
        self.read_bytes = create_instrument(m, semconv.READ_BYTES)
        self.staged_bytes = create_instrument(m, semconv.STAGED_BYTES)
        self.async_in_flight = create_instrument(m, semconv.ASYNC_IN_FLIGHT)
        self.async_phase = create_instrument(m, semconv.ASYNC_PHASE_DURATION)
        self.collective_wait = create_instrument(m, semconv.COLLECTIVE_WAIT)
        self.last_success = create_instrument(m, semconv.LAST_SUCCESS)
        self.last_duration = create_instrument(m, semconv.LAST_DURATION)
        self.telemetry_problems = create_instrument(m, semconv.TELEMETRY_PROBLEMS)
        self.stalls = create_instrument(m, semconv.STALLS)
        self.failures = create_instrument(m, semconv.FAILURES)
        self.training_blocked_seconds = create_instrument(m, semconv.TRAINING_BLOCKED)
        self.training_steps = create_instrument(m, semconv.TRAINING_STEP)
        self.training_interference_seconds = create_instrument(m, semconv.TRAINING_INTERFERENCE)
        for spec in semconv.LIVE_METRICS:  # observed at each collection, through _ACTIVE (see below)
            create_instrument(m, spec)
        #: Set by the instrumentor: collections wait (bounded) for what it has queued.
        self.builder: SpanBuilder | None = None
        #: Set by the instrumentor: what is open now (observed at each collection).
        self.live: Callable[[], list[LiveEntry]] | None = None
        # The SDK keeps the first registration of a name in a meter and ignores the callbacks of
        # later ones (a second instrument() with the same provider), and the API cannot
        # unregister: so one module-level callback serves every active sink.
        m.create_observable_gauge(semconv.OTEL_COLLECTION_BARRIER, [_collection_barrier], "1",
                                  "Never reports a value: lets dcp-otel record queued metrics before each "
                                  "collection.")  # fmt: skip
        self._context = ExemplarContexts()
        # (operation, step, rank) -> its attributes, built once per series.
        self._step_attributes: dict[tuple[str, str, str], dict[str, str]] = {}
        self._rank = process_rank()
        _ACTIVE.add(self)
        _selftelemetry.add_listener(self._problem)

    def provider(self) -> MeterProvider:
        """The provider observations go to now."""
        return self.meter_provider if self.meter_provider is not None else otel_metrics.get_meter_provider()

    def close(self) -> None:
        """Stop recording problems and draining (on uninstrument); the instruments stay with the provider."""
        _selftelemetry.remove_listener(self._problem)
        _ACTIVE.discard(self)
        self.builder = None

    def collecting(self) -> None:
        """Called at the start of every collection: record what the builder has queued first."""
        builder = self.builder
        if builder is not None:
            builder.drain_for_reader(metrics_only=True)  # (see DrainOnCollect)

    def _problem(self, reason: str) -> None:
        self.telemetry_problems.add(1, {semconv.LABEL_REASON: bounded_name(reason), semconv.LABEL_RANK: self._rank})

    # --- facts from the span recorder (the MetricsSink protocol) -------------------
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
        ctx = self._context(exemplar)
        status = semconv.STATUS_SUCCESS if ok else semconv.STATUS_FAILURE
        op, st, rk = semconv.LABEL_OPERATION, semconv.LABEL_STATUS, semconv.LABEL_RANK
        self.operation_duration.record(duration_s, {op: operation, st: status, rk: rank}, context=ctx)
        # Both outcomes exist from the first operation on, as on the Prometheus side.
        for outcome in (semconv.STATUS_SUCCESS, semconv.STATUS_FAILURE):
            self.operations.add(1 if outcome == status else 0, {op: operation, st: outcome, rk: rank})
        self.collective_wait.record(max(0.0, wait_s), {op: operation, rk: rank}, context=ctx)
        self.last_duration.set(duration_s, {op: operation, st: status, rk: rank})
        if ok:
            self.last_success.set(end_unix_s, {op: operation, rk: rank})

    def step_done(self, operation: str, step: str, rank: str, duration_s: float, exemplar: Exemplar | None) -> None:
        key = (operation, step, rank)
        attributes = self._step_attributes.get(key)
        if attributes is None:
            attributes = self._step_attributes[key] = {semconv.LABEL_OPERATION: bounded_name(operation),
                                                       semconv.LABEL_STEP: bounded_name(step),
                                                       semconv.LABEL_RANK: rank}  # fmt: skip
        self.step_duration.record(duration_s, attributes, context=self._context(exemplar))

    def bytes_written(self, rank: str, amount: int) -> None:
        if amount > 0:
            self.written_bytes.add(amount, {semconv.LABEL_RANK: rank})

    def bytes_read(self, rank: str, amount: int) -> None:
        if amount > 0:
            self.read_bytes.add(amount, {semconv.LABEL_RANK: rank})

    def bytes_staged(self, device: str, rank: str, amount: int) -> None:
        if amount > 0:
            self.staged_bytes.add(amount, {semconv.LABEL_DEVICE: device, semconv.LABEL_RANK: rank})

    def async_handed_off(self, rank: str) -> None:
        self.async_in_flight.add(1, {semconv.LABEL_RANK: rank})

    def async_phase_done(self, phase: str, rank: str, duration_s: float, exemplar: Exemplar | None) -> None:
        self.async_phase.record(duration_s, {semconv.LABEL_PHASE: phase, semconv.LABEL_RANK: rank},
                                context=self._context(exemplar))  # fmt: skip

    def async_upload_done(self, rank: str, duration_s: float, exemplar: Exemplar | None) -> None:
        self.async_in_flight.add(-1, {semconv.LABEL_RANK: rank})
        self.async_phase_done(semconv.PHASE_UPLOAD, rank, duration_s, exemplar)

    def stalled(self, operation: str, step: str, rank: str) -> None:
        self.stalls.add(1, {semconv.LABEL_OPERATION: bounded_name(operation), semconv.LABEL_STEP: bounded_step(step),
                            semconv.LABEL_RANK: rank})  # fmt: skip

    def failure_started(self, operation: str, rank: str, error_type: str) -> None:
        self.failures.add(1, {semconv.LABEL_OPERATION: bounded_name(operation), semconv.LABEL_RANK: rank,
                              semconv.LABEL_ERROR_TYPE: ERROR_TYPES(error_type)})  # fmt: skip

    def training_blocked(self, operation: str, rank: str, seconds: float) -> None:
        if seconds > 0:
            self.training_blocked_seconds.add(seconds, {semconv.LABEL_OPERATION: bounded_name(operation),
                                                        semconv.LABEL_RANK: rank})  # fmt: skip

    def training_step(self, overlaps: str, rank: str, seconds: float, exemplar: Exemplar | None) -> None:
        self.training_steps.record(seconds, {semconv.LABEL_OVERLAPS: overlaps, semconv.LABEL_RANK: rank},
                                   context=self._context(exemplar))

    def training_interference(self, operation: str, rank: str, seconds: float) -> None:
        self.training_interference_seconds.add(seconds, {semconv.LABEL_OPERATION: bounded_name(operation),
                                                         semconv.LABEL_RANK: rank})  # fmt: skip


#: The sinks of the instrumentations in force (one, unless several providers were used in turn).
_ACTIVE: weakref.WeakSet[OTelCheckpointMetrics] = weakref.WeakSet()


def _live_entries() -> Iterator[LiveEntry]:
    for sink in list(_ACTIVE):
        live = sink.live
        if live is None:
            continue
        try:
            yield from live()
        except Exception as exc:  # noqa: BLE001 - a collection must go on
            reraise_if_signalled(exc)
            _selftelemetry.report("metrics_error", "dcp_otel failed to observe the open DCP calls", exc_info=True)


def _observe_in_progress(options: CallbackOptions) -> Iterable[Observation]:
    """dcp.in_progress_since_timestamp: one point per open operation, gone once it ends."""
    return [Observation(since_s, {semconv.LABEL_OPERATION: bounded_name(operation),
                                  semconv.LABEL_STEP: bounded_step(step), semconv.LABEL_RANK: rank})
            for operation, step, rank, since_s, _ in _live_entries()]  # fmt: skip


def _observe_threshold(options: CallbackOptions) -> Iterable[Observation]:
    """dcp.stall_threshold of each open operation (stall reports on)."""
    found = {(bounded_name(operation), rank): threshold_s
             for operation, _, rank, _, threshold_s in _live_entries() if threshold_s is not None}  # fmt: skip
    return [Observation(value, {semconv.LABEL_OPERATION: operation, semconv.LABEL_RANK: rank})
            for (operation, rank), value in found.items()]  # fmt: skip


#: The callbacks of the observable instruments, by OTel name: module-level, as the collection barrier
#: (the SDK keeps the callbacks of an instrument's first registration in a meter only).
_OBSERVERS = {semconv.IN_PROGRESS.otel: _observe_in_progress, semconv.STALL_THRESHOLD.otel: _observe_threshold}


def _collection_barrier(options: CallbackOptions) -> Iterable[Observation]:
    """Called by the SDK at the start of every collection: record what the builders have queued."""
    for sink in list(_ACTIVE):
        try:
            sink.collecting()
        except Exception as exc:  # noqa: BLE001 - a collection must go on
            reraise_if_signalled(exc)
            _selftelemetry.report("metrics_error", "dcp_otel failed to record queued metrics before a collection",
                                  exc_info=True)  # fmt: skip
    return ()


class OTelElasticInstruments:
    """torchelastic's metrics (:data:`dcp_otel.semconv.ELASTIC_METRICS`) in one provider, shared by its handlers."""

    # Weakly keyed: a provider the job dropped is not kept alive by the handlers it once served
    # (its instruments do not refer back to it). ``None`` (the global provider) has a slot of its own.
    _by_provider: weakref.WeakKeyDictionary[MeterProvider, OTelElasticInstruments] = weakref.WeakKeyDictionary()
    _global: OTelElasticInstruments | None = None
    _lock = threading.Lock()

    @classmethod
    def for_provider(cls, provider: MeterProvider | None) -> OTelElasticInstruments:
        """The instruments of ``provider`` (``None``: the global one), made once per provider."""
        with cls._lock:
            if provider is None:
                if cls._global is None:
                    cls._global = cls(None)
                return cls._global
            held = cls._by_provider.get(provider)
            if held is None:
                held = cls._by_provider[provider] = cls(provider)
            return held

    def __init__(self, provider: MeterProvider | None) -> None:
        m = meter(provider)
        self.duration = create_instrument(m, semconv.ELASTIC_DURATION)
        self.calls = create_instrument(m, semconv.ELASTIC_CALLS)
        self.events = create_instrument(m, semconv.ELASTIC_EVENTS)
        self.last_value = create_instrument(m, semconv.ELASTIC_LAST_VALUE)
        self.dropped = create_instrument(m, semconv.ELASTIC_DROPPED)
