"""Tracing inside torch's async checkpoint daemon (``AsyncCheckpointerType.PROCESS``).

:func:`daemon_main` replaces the daemon's entry point (see
:mod:`dcp_otel.attach.async_process`). Before running torch's own, it:

1. picks the tracer provider the daemon's spans go to, first that applies:
   the rank's ``process_setup`` hook (``"module:function"``, returning a
   ``TracerProvider`` or ``None`` after setting the global one); an SDK already
   configured in the daemon (``opentelemetry-instrument`` runs there too, since
   the daemon inherits ``PYTHONPATH`` and every ``OTEL_*`` variable); else an SDK
   built from the inherited ``OTEL_*`` variables (``OTEL_TRACES_EXPORTER``, or
   OTLP when an ``OTEL_EXPORTER_OTLP_*ENDPOINT`` is set) with the rank's
   resource attributes, so the daemon's spans say which rank and job they
   belong to;
2. instruments DCP there with the rank's options, its metrics going to a
   :class:`~dcp_otel.metrics.relay.MetricsRelay` back to the rank;
3. runs every save request in the context the rank sent with it, so the
   daemon's ``dcp.save`` and its steps are children of the rank's
   ``dcp.async_upload`` span, in the checkpoint's one trace;
4. after every save, sends the metrics (recorded within a millisecond, waited
   for at most 1 s) before torch answers the rank, and asks a background thread
   to flush the spans. A save's completion never waits for a span exporter: a
   hung collector used to make every upload end ~10 s late. The spans of the
   last save are flushed when the daemon ends (bounded by ``flush_timeout_s``).

Nothing here raises into torch: a failure to set up tracing leaves the daemon
checkpointing exactly as before, counted in ``dcp_otel.diagnostics()``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import wrapt
from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.instrumentation.utils import unwrap
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider as SDKTracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from dcp_otel._selftelemetry import report
from dcp_otel.attach.async_process import BOOTSTRAP_ATTR, CARRIER_ATTR, DAEMON_ENTRY, DaemonBootstrap, daemon_class
from dcp_otel.config import resolve_callable
from dcp_otel.instrumentor import DCPInstrumentor
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.metrics.relay import MetricsRelay
from dcp_otel.spool.delivery import environment_exporters, exporter_names
from dcp_otel.tracing.flushing import flush_spans

#: torch's own daemon entry point, set when it is replaced in this process.
TORCH_ENTRY: Callable[..., None] | None = None
#: What the processes are called in stall reports and the progress their ranks show.
ASYNC_SAVE_PROCESS = "async save process"
CHECKPOINT_PROCESS = "checkpoint process"


def daemon_main(pg_init_info: Any, parent_conn: Any) -> None:
    """The daemon's entry point: set up tracing, then run torch's."""
    entry = _torch_entry()
    bootstrap = getattr(pg_init_info, BOOTSTRAP_ATTR, None)
    session = DaemonSession.start(bootstrap, ASYNC_SAVE_PROCESS) if isinstance(bootstrap, DaemonBootstrap) else None
    if session is not None:
        session.wrap_saves()
    try:
        entry(pg_init_info, parent_conn)
    finally:
        if session is not None:
            session.close()


def _torch_entry() -> Callable[..., None]:
    if TORCH_ENTRY is not None:
        return TORCH_ENTRY
    entry: Callable[..., None] = vars(daemon_class())[DAEMON_ENTRY].__func__
    return entry


#: The longest a save in this process waits for its metrics to be recorded before they are
#: relayed (the builder records them in about a millisecond, before it emits any span).
_METRICS_DRAIN_S = 1.0


class DaemonSession:
    """Tracing set up in one checkpoint process, undone when torch's entry point returns.

    Serves torch's async save daemon (above) and the ``_experimental``
    checkpointer's checkpoint process (:mod:`dcp_otel.processes.checkpoint_process`):
    each request from the rank runs between :meth:`begin` and :meth:`end`.
    """

    def __init__(self, bootstrap: DaemonBootstrap, provider: trace.TracerProvider, owned: bool,
                 name: str = ASYNC_SAVE_PROCESS) -> None:  # fmt: skip
        self._bootstrap = bootstrap
        self._name = name
        self._provider = provider
        self._owned = owned
        self._relay = MetricsRelay(bootstrap.relay)
        self._instrumentor = DCPInstrumentor()
        self._owner: Any = None
        self._flusher = BackgroundFlush(self._flush)

    @classmethod
    def start(cls, bootstrap: DaemonBootstrap, name: str = ASYNC_SAVE_PROCESS) -> DaemonSession | None:
        """Set up tracing in this process (``name``: what it is, in stall reports); ``None`` (counted) if that fails."""
        try:
            provider, owned = _daemon_provider(bootstrap)
            session = cls(bootstrap, provider, owned, name)
            session._install()
            return session
        except Exception as exc:  # noqa: BLE001 - the checkpoint goes on untraced
            reraise_if_signalled(exc)
            report("daemon_setup_error", "dcp_otel could not trace a checkpoint process", exc_info=True)
            return None

    def _install(self) -> None:
        if self._instrumentor.is_instrumented_by_opentelemetry:  # opentelemetry-instrument got here first
            self._instrumentor.uninstrument()
        b = self._bootstrap
        self._instrumentor.instrument(
            tracer_provider=self._provider,
            metrics_port=None,  # the rank serves this daemon's metrics
            run_id=b.run_id,
            slowest_keys=b.slowest_keys,
            max_open_spans=b.max_open_spans,
            flush_timeout_s=b.flush_timeout_s,
            detail=b.detail,
            span_budget=b.span_budget,
            stall_after_s=b.stall_after_s,
            _metrics_sink=self._relay,
            _process_name=self._name,
        )

    def wrap_saves(self) -> None:
        """Run each of torch's daemon's save requests in its rank's context (:meth:`execute_save`)."""
        try:
            self._owner = daemon_class()
            wrapt.wrap_function_wrapper(self._owner, "_execute_save", self.execute_save)
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("daemon_setup_error", "dcp_otel could not trace the async save process's saves", exc_info=True)

    def execute_save(self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Around ``_AsyncCheckpointProcess._execute_save``: one save request, in the rank's context."""
        token = self.begin(getattr(kwargs.get("checkpoint_request_id"), CARRIER_ATTR, None))
        try:
            return wrapped(*args, **kwargs)
        finally:
            self.end(token)

    def begin(self, carried: object) -> object | None:
        """A request from the rank starts: continue the operation it carries (``None``: none); a token for :meth:`end`."""
        recorder = self._instrumentor.recorder
        ctx = recorder.starter.adopt(carried) if recorder is not None and carried is not None else None
        return context_api.attach(ctx) if ctx is not None else None

    def end(self, token: object | None) -> None:
        """The request is done, before the rank is answered: its metrics go to the rank, its spans to a flush.

        Never raises (it runs on the way to answering the rank).
        """
        try:
            if token is not None:
                context_api.detach(token)  # type: ignore[arg-type]
            recorder = self._instrumentor.recorder
            if recorder is not None:  # the builder records the request's metrics into the relay: before any span
                recorder.drain(_METRICS_DRAIN_S, metrics_only=True)
            self._relay.send()
            if self._bootstrap.flush_timeout_s > 0:
                self._flusher.request()  # torch answers the rank now, whatever the exporter does
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("daemon_setup_error", "dcp_otel failed to end a request in a checkpoint process", exc_info=True)

    def _flush(self) -> None:
        if self._bootstrap.flush_timeout_s > 0:  # 0: dcp-otel starts no flush
            flush_spans(self._instrumentor.recorder, self._bootstrap.flush_timeout_s, self._provider)

    def close(self) -> None:
        try:
            if self._owner is not None:
                unwrap(self._owner, "_execute_save")
            recorder = self._instrumentor.recorder
            if recorder is not None:
                recorder.drain(_METRICS_DRAIN_S, metrics_only=True)
            self._relay.send()
            self._flush()
            self._instrumentor.uninstrument()
            if self._owned and isinstance(self._provider, SDKTracerProvider):
                self._provider.shutdown()
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("daemon_setup_error", "dcp_otel failed to shut down tracing in a checkpoint process", exc_info=True)


class BackgroundFlush:
    """Runs ``flush`` on its own thread whenever asked; requests made while it runs coalesce into one more run."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush
        self._wanted = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        """Ask for a flush; returns at once."""
        self._wanted.set()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dcp-otel-daemon-flush", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            try:
                self._flush()
            except Exception as exc:  # noqa: BLE001
                reraise_if_signalled(exc)
                report("daemon_setup_error", "dcp_otel failed to flush a checkpoint process's spans", exc_info=True)


def _daemon_provider(bootstrap: DaemonBootstrap) -> tuple[trace.TracerProvider, bool]:
    """The provider for the daemon's spans, and whether this session built it (and shuts it down)."""
    if bootstrap.process_setup:
        try:
            provider = resolve_callable(bootstrap.process_setup)()
            if provider is None:
                return trace.get_tracer_provider(), False
            if isinstance(provider, trace.TracerProvider):
                return provider, False
            report("daemon_setup_error", "%s returned %s, not a TracerProvider", bootstrap.process_setup, type(provider))
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("daemon_setup_error", "dcp_otel: %s failed in a checkpoint process", bootstrap.process_setup,
                   exc_info=True)  # fmt: skip
    current = trace.get_tracer_provider()
    if isinstance(current, SDKTracerProvider):
        return current, False
    return _provider_from_environment(bootstrap), True


def _provider_from_environment(bootstrap: DaemonBootstrap) -> SDKTracerProvider:
    """An SDK provider from the ``OTEL_*`` variables, with the rank's resource."""
    attributes = dict(bootstrap.resource) or dict(Resource.create().attributes)
    attributes["process.pid"] = os.getpid()
    provider = SDKTracerProvider(resource=Resource(attributes))
    names = exporter_names()
    if not names:
        report(
            "daemon_no_exporter",
            "this checkpoint process (async save) has no span exporter: set OTEL_TRACES_EXPORTER / OTEL_EXPORTER_OTLP_ENDPOINT, "
            "or DCP_OTEL_PROCESS_SETUP=module:function when the exporter is configured in code",
        )
        return provider
    try:
        exporters = environment_exporters(names)
    except Exception as exc:  # noqa: BLE001 - e.g. an exporter package that is not installed
        reraise_if_signalled(exc)
        report("daemon_no_exporter", "this checkpoint process cannot load span exporter(s) %s", names, exc_info=True)
        return provider
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
