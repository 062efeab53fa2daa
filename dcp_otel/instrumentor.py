"""``DCPInstrumentor``: the OpenTelemetry instrumentor for PyTorch DCP.

Registered under the ``opentelemetry_instrumentor`` entry point, so
``opentelemetry-instrument python train.py`` turns it on with no code change.
``opentelemetry-instrument`` instruments every Python process it starts, most
of which never checkpoint (a tokenizer, a ``pip`` run, the Collector's helper
scripts): where torch is not imported yet, ``instrument()`` only checks its
options and attaches once torch is imported. A process that never imports
torch loads neither torch nor anything of dcp-otel's beyond this module and
its options.

dcp-otel installs no signal handler and never takes the signal wakeup fd: a
process ends exactly as it would without it, whatever ends it. What a death
must not lose is written ahead instead, into the process's record in the spool
(:mod:`dcp_otel.spool`), and a process that outlives it reports it.

Usage::

    from dcp_otel import DCPInstrumentor

    DCPInstrumentor().instrument(tracer_provider=provider, run_id="job-42")
    ...
    DCPInstrumentor().uninstrument()
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.attach import releases
from dcp_otel.config import InstrumentOptions, differing_options, is_launcher
from dcp_otel.live.signal_exceptions import reraise_if_signalled

if TYPE_CHECKING:
    from dcp_otel.attach.patches import Installed
    from dcp_otel.live.watchdog import Watchdog
    from dcp_otel.metrics.exposition import MetricsEndpoint
    from dcp_otel.metrics.otel import OTelCheckpointMetrics
    from dcp_otel.metrics.prometheus import CheckpointMetrics, MetricsSink
    from dcp_otel.metrics.relay import MetricsRelay
    from dcp_otel.spool.process import AgentWatch, ProcessSpool
    from dcp_otel.tracing.drain import DrainOnCollect
    from dcp_otel.tracing.export_queue import QueueFullWatch
    from dcp_otel.tracing.flushing import ExitFlush
    from dcp_otel.tracing.tracker import SpanRecorder

logger = logging.getLogger("dcp_otel")
#: The instrumented dependency, as opentelemetry-instrumentation expects it (not a dependency of the package).
_instruments = (releases.INSTRUMENTS,)
#: BaseInstrumentor's own keywords, not dcp-otel options.
_BASE_KWARGS = frozenset({"skip_dep_check", "raise_exception_on_conflict"})


class DCPInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Spans for every ``torch.distributed.checkpoint`` step, one trace per checkpoint.

    A singleton, like every ``BaseInstrumentor``: instrumenting twice only
    warns (naming the options that stay in force when the second call asked
    for others), and :meth:`uninstrument` restores torch's original objects and
    removes our metrics from their registry.
    Keyword options are those of :class:`dcp_otel.config.InstrumentOptions`.
    """

    _recorder: SpanRecorder | None = None
    _options: InstrumentOptions | None = None
    _pending: object | None = None  # the attachment waiting for torch's import (a token, compared by identity)
    _installed: Installed | None = None
    _metrics: CheckpointMetrics | None = None
    _otel_metrics: OTelCheckpointMetrics | None = None
    _endpoint: MetricsEndpoint | None = None
    _exit_flush: ExitFlush | None = None
    _queue_watch: QueueFullWatch | None = None
    _drain: DrainOnCollect | None = None
    _watchdog: Watchdog | None = None
    _spool: ProcessSpool | None = None
    _agent: AgentWatch | None = None  # in a launcher: the survivor of its workers, and nothing else
    _undo: list[Callable[[], None]] | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def instrument(self, **kwargs: Any) -> None:
        """Instrument DCP (see :class:`~dcp_otel.config.InstrumentOptions`); a bad option raises ``ValueError``.

        Already instrumented: nothing changes, and a warning names every option
        asked for that differs from the one in force.
        """
        options = self._options
        if self._is_instrumented_by_opentelemetry and options is not None:
            asked = {k: v for k, v in kwargs.items() if k not in _BASE_KWARGS and not k.startswith("_")}
            differing = differing_options(options, InstrumentOptions.from_kwargs(asked))
            if differing:
                logger.warning(
                    "dcp_otel is already instrumented; this call changes nothing. In force: %s (asked: %s). "
                    "Call dcp_otel.uninstrument() first to change them.",
                    ", ".join(f"{name}={now!r}" for name, (now, _) in differing.items()),
                    ", ".join(f"{name}={asked!r}" for name, (_, asked) in differing.items()),
                )
        super().instrument(**kwargs)

    def _instrument(self, **kwargs: Any) -> None:
        # Internal: the async save daemon relays its metrics to its rank instead, and says what it is.
        relay: MetricsRelay | None = kwargs.pop("_metrics_sink", None)
        process_name: str | None = kwargs.pop("_process_name", None)
        options = InstrumentOptions.from_kwargs(kwargs)  # raises on bad options
        self._options = options
        if is_launcher():  # torchrun itself (under opentelemetry-instrument): it checkpoints nothing; it survives
            from dcp_otel.spool.process import AgentWatch

            self._agent = AgentWatch.start(options.flush_timeout_s)
            return
        if "torch" in sys.modules:
            self._attach(options, relay, process_name)  # a bad metrics address raises here, leaving nothing behind
            return
        pending = self._pending = object()

        def attach_when_torch_is_imported(_: object) -> None:
            if self._pending is not pending:
                return  # uninstrumented (or instrumented again) since
            self._pending = None
            try:
                self._attach(options, relay, process_name)
            except Exception as exc:  # noqa: BLE001 - inside the application's `import torch`: never raise there
                reraise_if_signalled(exc)
                report("setup_error", "dcp_otel could not instrument DCP once torch was imported", exc_info=True)

        wrapt.register_post_import_hook(attach_when_torch_is_imported, "torch")

    def _attach(self, options: InstrumentOptions, relay: MetricsRelay | None, process_name: str | None) -> None:
        """Everything that touches torch: the recorder, its sinks, the patches, the watchdog and the spool."""
        import torch
        from prometheus_client import REGISTRY

        from dcp_otel.attach.patches import install
        from dcp_otel.metrics.exposition import start_metrics_server
        from dcp_otel.metrics.otel import OTelCheckpointMetrics
        from dcp_otel.metrics.prometheus import CheckpointMetrics, FanOut
        from dcp_otel.tracing.drain import DrainOnCollect
        from dcp_otel.tracing.export_queue import QueueFullWatch
        from dcp_otel.tracing.steps import CLOCK
        from dcp_otel.tracing.tracker import SpanRecorder

        untested = releases.untested_release_warning(torch.__version__)
        if untested is not None:
            logger.warning(untested)
        registry = options.registry if options.registry is not None else REGISTRY
        metrics = otel = drain = None
        if relay is None and semconv.SINK_PROMETHEUS in options.metrics:
            # Registered before our metrics, so collected first: a scrape (or get_sample_value)
            # lets the builder record what is queued before our metrics are read.
            drain = DrainOnCollect()
            registry.register(drain)
            try:
                metrics = CheckpointMetrics(options.registry)  # raises if already registered
            except BaseException:
                registry.unregister(drain)
                raise
        if options.metrics_port is not None:
            try:  # before anything is attached: a bad address fails here, leaving nothing behind
                self._endpoint = start_metrics_server(options.metrics_port, registry=options.registry,
                                                      run_id=options.run_id)
            except BaseException:
                if metrics is not None and drain is not None:
                    metrics.unregister()
                    registry.unregister(drain)
                raise
        if relay is None and semconv.SINK_OPENTELEMETRY in options.metrics:
            otel = OTelCheckpointMetrics(options.meter_provider)
        sinks: list[MetricsSink] = [s for s in (metrics, otel) if s is not None]
        sink = relay if relay is not None else (FanOut(sinks) if len(sinks) > 1 else (sinks[0] if sinks else None))
        self._metrics, self._otel_metrics, self._drain = metrics, otel, drain
        self._recorder = SpanRecorder(options, sink)
        if drain is not None:
            drain.builder = self._recorder.builder
        if otel is not None:
            otel.builder = self._recorder.builder
        self._undo = []
        self._open_spool(options, relay, process_name)
        # The async save daemon's metrics go to this rank's sinks (never back into a relay).
        self._installed = install(self._recorder, options, sink if relay is None else None)
        if relay is None and CLOCK.install():  # training steps' ends (a checkpoint helper takes none)
            self._undo.append(CLOCK.remove)
        self._queue_watch = QueueFullWatch()
        self._watch(options, sink, metrics, otel, relay, process_name)

    def _open_spool(self, options: InstrumentOptions, relay: MetricsRelay | None, process_name: str | None) -> None:
        """The process's record, and (in a process that is no checkpoint helper) its survivor (:mod:`dcp_otel.spool`)."""
        from dcp_otel.attach import worker_exits
        from dcp_otel.spool.process import ProcessSpool, is_multiprocessing_child, watch_when_imported

        assert self._recorder is not None and self._undo is not None
        spool = self._spool = ProcessSpool.open(self._recorder, options.flush_timeout_s, process_name,
                                                node=options.span_export == semconv.SPAN_EXPORT_NODE and relay is None)
        if spool is None or relay is not None:
            return  # a checkpoint helper keeps its record; its rank and the rank's agent survive it
        survivor = spool.survivor
        if not is_multiprocessing_child():  # else (a rank of torch.multiprocessing.spawn) at its first operation
            survivor.start()
        undo = self._undo
        for module, watch in ((worker_exits.ELASTIC_MODULE, worker_exits.watch_worker_exits),
                              (worker_exits.SPAWN_MODULE, worker_exits.watch_spawned_ranks)):  # fmt: skip
            watch_when_imported(module, watch, survivor, lambda: undo if self._undo is undo else None)

    def _watch(self, options: InstrumentOptions, sink: MetricsSink | None, metrics: CheckpointMetrics | None,
               otel: OTelCheckpointMetrics | None, relay: MetricsRelay | None, process_name: str | None) -> None:  # fmt: skip
        """What is open now (the live progress metrics, the stall watchdog), and the process's end."""
        from dcp_otel.live.ending import Ending
        from dcp_otel.live.life import ProcessLife
        from dcp_otel.live.progress import LiveState, StallPolicy
        from dcp_otel.live.stalls import StallReporter
        from dcp_otel.live.watchdog import Watchdog
        from dcp_otel.metrics.prometheus import LiveEntry
        from dcp_otel.tracing.flushing import ExitFlush

        recorder, bridge = self._recorder, self._installed.bridge if self._installed is not None else None
        assert recorder is not None
        live = LiveState(recorder, StallPolicy(options.stall_after_s, recorder.builder.history),
                         bridge.remote_progress if bridge is not None and relay is None else None)  # fmt: skip
        for side in (metrics, otel):
            if side is not None:
                side.live = live.entries
        timeout = float(options.flush_timeout_s)
        ending = Ending(recorder, live, otel, relay.send if relay is not None else None,
                        ProcessLife(recorder) if relay is None else None)  # fmt: skip
        publish: list[Callable[[list[LiveEntry]], None]] = []
        if metrics is not None and metrics.multiprocess:
            publish.append(metrics.publish_progress)
        if relay is not None:  # a checkpoint process: its rank shows (and alerts on) where it is
            where = process_name or "checkpoint process"

            def relay_progress(entries: list[LiveEntry]) -> None:
                relay.progress(where, entries)
                relay.send()

            publish.append(relay_progress)
        reporter = StallReporter(recorder, sink, process_name, relay.send if relay is not None else None, timeout)
        spool = self._spool
        watchdog = self._watchdog = Watchdog(live, reporter, record=spool.record if spool is not None else None,
                                             publish=publish,
                                             before=bridge.drain if bridge is not None and relay is None else None)  # fmt: skip
        survivor = spool.survivor if spool is not None and relay is None else None

        builder, keep = recorder.builder, spool.keep if spool is not None else None

        def on_operation() -> None:  # (the tracker calls it as an operation starts: cheap once running)
            # Every thread of dcp-otel's starts here, with the first checkpoint, and none ends before uninstrument():
            # a thread started or ended later could crash a faulthandler dump that lands meanwhile (cpython#116008).
            watchdog.ensure_running()
            builder.ensure_thread()
            if keep is not None:
                keep.start()
            if survivor is not None and not survivor.started:
                survivor.start()

        serve_later = self._endpoint_at_first_operation(options, relay)
        if serve_later is not None:
            first = on_operation

            def on_operation() -> None:  # a rank that torch.multiprocessing.spawn started: its endpoint, once
                nonlocal serve_later
                if serve_later is not None:
                    serve, serve_later = serve_later, None
                    serve()
                first()

        recorder.watch = on_operation
        self._exit_flush = ExitFlush(recorder, timeout, otel,
                                     end_open=lambda: ending.end_open_calls(semconv.INTERRUPTED_AT_EXIT),
                                     end_life=lambda deadline: ending.end_life(semconv.INTERRUPTED_AT_EXIT, deadline),
                                     survivor=survivor, spool=spool)  # fmt: skip
        atexit.register(self._exit_flush)

    def _endpoint_at_first_operation(self, options: InstrumentOptions,
                                     relay: MetricsRelay | None) -> Callable[[], None] | None:  # fmt: skip
        """A process ``multiprocessing`` started (a DataLoader worker, torch's checkpoint helpers, or a rank of
        ``torch.multiprocessing.spawn``) inherits its parent's ``DCP_OTEL_METRICS_PORT``: only a rank serves it,
        and it is a rank once it makes a DCP call of its own. What serves it then (``None``: nothing to serve)."""
        from dcp_otel.config import env_int
        from dcp_otel.metrics.exposition import start_metrics_server
        from dcp_otel.spool.process import is_multiprocessing_child

        if relay is not None or options.metrics_port is not None or not is_multiprocessing_child():
            return None
        port = env_int(semconv.ENV_METRICS_PORT, 0, 65535)
        if port is None:
            return None

        def serve() -> None:
            try:
                self._endpoint = start_metrics_server(port, registry=options.registry, run_id=options.run_id)
            except Exception as exc:  # noqa: BLE001 - inside the rank's first DCP call: never raised there
                reraise_if_signalled(exc)
                report("setup_error", "dcp_otel could not serve this rank's metrics on port %d", port, exc_info=True)

        return serve

    def _uninstrument(self, **kwargs: Any) -> None:
        self._pending = None  # an attachment still waiting for torch's import never happens
        if self._agent is not None:
            self._agent.close()
            self._agent = None
        if self._recorder is not None:
            # What finished before uninstrument() is built first, while everything that
            # watches and counts it (the queue-full filter, the metrics) is still in place.
            self._recorder.drain(float(self._recorder.options.flush_timeout_s))
        if self._exit_flush is not None:
            self._exit_flush.cancel()
        if self._watchdog is not None:
            self._watchdog.stop()
        for undo in reversed(self._undo or []):
            undo()
        for side in (self._metrics, self._otel_metrics):
            if side is not None:
                side.live = None
        if self._installed is not None:
            self._installed.remove()
        if self._queue_watch is not None:
            self._queue_watch.remove()
        if self._recorder is not None:
            self._recorder.close()
        if self._spool is not None:
            recorder = self._recorder
            timeout = float(recorder.options.flush_timeout_s) if recorder is not None else 0.0
            # (The recorder keeps its record: a call still open, an upload, ends into it, or into the buffer that
            # stands in for a record removed.)
            self._spool.close(clean=(recorder is None or not recorder.open_calls()) and self._spool.settled(timeout))
        if self._endpoint is not None:
            self._endpoint.close()
        if self._metrics is not None:
            if self._drain is not None:
                self._metrics.registry.unregister(self._drain)
            self._metrics.unregister()
        if self._otel_metrics is not None:
            self._otel_metrics.close()
        self._installed = None
        self._recorder = None
        self._options = None
        self._metrics = None
        self._otel_metrics = None
        self._endpoint = None
        self._exit_flush = None
        self._queue_watch = None
        self._drain = None
        self._watchdog = None
        self._spool = None
        self._undo = None

    @property
    def recorder(self) -> SpanRecorder | None:
        """The active recorder (``None`` when not instrumented, or before torch is imported)."""
        return self._recorder

    @property
    def installed(self) -> Installed | None:
        """What is attached to torch (``None`` when not instrumented)."""
        return self._installed

    @property
    def otel_metrics(self) -> OTelCheckpointMetrics | None:
        """The OpenTelemetry side of the checkpoint metrics (``None`` when it is off or not instrumented)."""
        return self._otel_metrics

    @property
    def watchdog(self) -> Watchdog | None:
        """The stall watchdog (``None`` when not instrumented); its thread starts with the first operation."""
        return self._watchdog

    @property
    def spool(self) -> ProcessSpool | None:
        """The process's record and survivor (``None`` when the spool is off, or not instrumented)."""
        return self._spool

    @property
    def metrics_endpoint(self) -> MetricsEndpoint | None:
        """The endpoint started because ``metrics_port`` was set, if any (``None`` also
        on the ranks whose metrics local rank 0 serves in multiprocess mode)."""
        return self._endpoint
