"""Flushing spans without ever hanging the caller.

The SDK's ``BatchSpanProcessor.force_flush`` exports in the calling thread and
does not honour its timeout, so a stuck collector would hang whoever flushes.
:func:`flush_spans` runs the flush in a helper thread and waits at most
``timeout_s`` for it; :class:`ExitFlush` does that once at interpreter exit,
after the in-flight async uploads' spans have ended, so a training script that
never calls :func:`dcp_otel.flush` still exports its last checkpoint's spans;
and if the exporter is stuck, the process still exits within ``timeout_s``.

Usage::

    flush_spans(recorder, timeout_s=10)      # True: everything exported in time
    atexit.register(ExitFlush(recorder, 10))
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable

from opentelemetry import trace

from dcp_otel._selftelemetry import report
from dcp_otel.tracing.tracker import SpanRecorder


def flush_spans(
    recorder: SpanRecorder | None, timeout_s: float, provider: trace.TracerProvider | None = None
) -> bool:
    """Wait for async uploads' spans to end, then flush ``provider``; ``False`` past ``timeout_s``.

    ``provider`` defaults to the one the recorder's spans go to (else the
    global one). Never raises and never waits longer than ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    done = recorder.wait_for_uploads(timeout_s) if recorder is not None else True
    if provider is None:
        provider = recorder.provider() if recorder is not None else trace.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)
    if force_flush is None:
        return done
    remaining = max(0.0, deadline - time.monotonic())
    outcome: list[bool] = []

    def run() -> None:
        try:
            outcome.append(bool(force_flush(int(remaining * 1000))))
        except Exception:  # noqa: BLE001 - a broken exporter must not break the caller
            report("flush_error", "dcp_otel: the tracer provider failed to flush", exc_info=True)
            outcome.append(False)

    # A daemon thread: if the exporter hangs past the deadline it must not keep
    # the interpreter alive either.
    worker = threading.Thread(target=run, name="dcp-otel-flush", daemon=True)
    worker.start()
    worker.join(remaining)
    if worker.is_alive():
        report("flush_timeout", "dcp_otel: the span exporter did not finish flushing within %.1f s", timeout_s)
        return False
    return done and outcome[0]


class ExitFlush:
    """The ``atexit`` hook of one instrumentation; a no-op in forked children."""

    def __init__(self, recorder: SpanRecorder, timeout_s: float) -> None:
        self._recorder = recorder
        self._timeout_s = timeout_s
        self._pid = os.getpid()

    def __call__(self) -> None:
        # A forked child inherits atexit hooks, but the spans are the parent's.
        if os.getpid() != self._pid or self._timeout_s <= 0:
            return
        if flush_spans(self._recorder, self._timeout_s):
            return
        # The exporter is stuck. The SDK's own exit hook would now shut the provider down and
        # wait for that exporter again (30 s per batch processor, plus the exporter's retries):
        # exit would not be bounded by our timeout. So the shutdown runs in a daemon thread,
        # which exports what it still can while the interpreter exits, and the SDK's hook goes.
        shutdown = getattr(self._recorder.provider(), "shutdown", None)
        if callable(shutdown):
            atexit.unregister(shutdown)  # the SDK registers the provider's bound shutdown
            threading.Thread(target=_shutdown_quietly, args=(shutdown,), name="dcp-otel-shutdown", daemon=True).start()


def _shutdown_quietly(shutdown: Callable[[], object]) -> None:
    try:
        shutdown()
    except Exception:  # noqa: BLE001 - at exit, with a broken exporter: nothing to tell anyone
        pass
