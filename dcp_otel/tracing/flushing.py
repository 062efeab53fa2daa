"""Flushing spans and metrics without ever hanging the caller.

The SDK's ``force_flush`` exports in the calling thread and does not honour its
timeout against a hung exporter, so a stuck collector would hang whoever
flushes. :func:`flush_spans` and :func:`flush_all` run each provider's flush in
a helper thread and wait at most ``timeout_s`` for it; :class:`ExitFlush` does
that once at interpreter exit, after the in-flight async uploads' spans have
ended, so a training script that never calls :func:`dcp_otel.flush` still
exports its last checkpoint's spans and pushes its last metrics, the builder's
queue recorded first; and if an exporter is stuck, the process still exits
within ``timeout_s`` (the SDK's own exit hooks would wait for it again, up to
30 s per processor or metric reader, plus the exporter's retries).

Usage::

    flush_spans(recorder, timeout_s=10)      # True: everything exported in time
    flush_all(recorder, otel_metrics, 10)    # spans and OpenTelemetry metrics, side by side
    atexit.register(ExitFlush(recorder, 10, otel_metrics))
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from opentelemetry import trace

from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.tracing.steps import HURRY

if TYPE_CHECKING:  # (a survivor flushes with no recorder: an agent imports no torch for it)
    from dcp_otel.metrics.otel import OTelCheckpointMetrics
    from dcp_otel.spool.process import ProcessSpool
    from dcp_otel.spool.survivor import Survivor
    from dcp_otel.tracing.tracker import SpanRecorder


def force_flush_said(force_flush: Callable[[int], object], what: str, millis: int) -> bool:
    """``force_flush(millis)`` on this thread, its answer as a bool; an exception from it is said in one line and
    is ``False`` (the metrics SDK raises when its readers time out, which is the deadline doing its job)."""
    try:
        return bool(force_flush(millis))
    except Exception as exc:  # noqa: BLE001 - a broken exporter must not break the caller
        reraise_if_signalled(exc)
        text = str(exc).strip().splitlines()
        report("flush_error", "dcp_otel: the %s provider failed to flush: %s: %s", what, type(exc).__name__,
               " ".join(line.strip() for line in text)[:300])  # fmt: skip
        return False


class BoundedFlush:
    """``provider.force_flush`` on a daemon thread, waited for until a deadline.

    A daemon thread: if the exporter hangs past the deadline it must not keep
    the interpreter alive either.
    """

    def __init__(self, provider: object, what: str, deadline: float, quiet: bool = False, hurry: bool = True) -> None:
        self.provider = provider
        self._what = what
        self._deadline = deadline
        self._quiet = quiet  # a flush that only learns whether spans went out: its timeout is no problem to report
        self._outcome: list[bool] = []
        self._force_flush = getattr(provider, "force_flush", None)
        self._thread: threading.Thread | None = None
        if self._force_flush is not None:
            self._thread = threading.Thread(target=self._run, name="dcp-otel-flush", daemon=True)
            # (hurry False: the builder, drained by the provider's flush, is not cut short; see SpanBuilder.drain)
            setattr(self._thread, HURRY, hurry)
            self._thread.start()

    def _run(self) -> None:
        assert self._force_flush is not None
        millis = max(0, int((self._deadline - time.monotonic()) * 1000))
        self._outcome.append(force_flush_said(self._force_flush, self._what, millis))

    def running(self) -> bool:
        """Whether the flush is still under way."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> bool | None:
        """True/False: the flush's answer; ``None``: still running at the deadline (the exporter is stuck)."""
        said = self.finish()
        if said is None and not self._quiet:
            report("flush_timeout", "dcp_otel: the %s exporter did not finish flushing in time", self._what)
        return said

    def finish(self) -> bool | None:
        """:meth:`wait`'s answer, saying nothing of a timeout (waited for again, it is no new problem)."""
        if self._thread is None:
            return True
        self._thread.join(max(0.0, self._deadline - time.monotonic()))
        if self._thread.is_alive():
            return None
        return self._outcome[0] if self._outcome else False  # (none: an exporter's SystemExit ended the flush)


def flush_spans(
    recorder: SpanRecorder | None, timeout_s: float, provider: trace.TracerProvider | None = None
) -> bool:
    """Wait for async uploads' spans to end, then flush ``provider``; ``False`` past ``timeout_s``.

    ``provider`` defaults to the one the recorder's spans go to (else the
    global one). Never raises and never waits longer than ``timeout_s``.
    """
    return flush_all(recorder, None, timeout_s, provider)


def flush_all(
    recorder: SpanRecorder | None,
    otel_metrics: OTelCheckpointMetrics | None,
    timeout_s: float,
    provider: trace.TracerProvider | None = None,
    *,
    wait_for_uploads: bool = True,
) -> bool:
    """:func:`flush_spans`, and the meter provider of ``otel_metrics`` flushed alongside, within one deadline.

    ``wait_for_uploads=False``: only what has finished (built first), without
    waiting for async uploads still running.
    """
    return _flush(recorder, otel_metrics, timeout_s, provider, wait_for_uploads)[0]


def _flush(
    recorder: SpanRecorder | None,
    otel_metrics: OTelCheckpointMetrics | None,
    timeout_s: float,
    provider: trace.TracerProvider | None = None,
    wait_for_uploads: bool = True,
    spans: bool = True,
) -> tuple[bool, list[object]]:
    """The outcome, and the providers that did not flush everything (stuck, failed, or left no time).
    ``spans=False``: the span provider is not flushed, and counts among them."""
    deadline = time.monotonic() + timeout_s
    if recorder is not None and not wait_for_uploads:
        recorder.drain(timeout_s)
        uploads_done = True
    else:
        uploads_done = recorder.wait_for_uploads(timeout_s) if recorder is not None else True
    if provider is None:
        provider = recorder.provider() if recorder is not None else trace.get_tracer_provider()
    flushes = [BoundedFlush(provider if spans else None, "span", deadline)]
    if otel_metrics is not None:  # side by side: a stuck span exporter leaves the metrics their time
        flushes.append(BoundedFlush(otel_metrics.provider(), "metric", deadline))
    failed = [flush.provider for flush in flushes if not flush.wait()]
    if not spans:
        failed.insert(0, provider)
    if not uploads_done and provider not in failed:
        failed.insert(0, provider)  # an upload still running: its span is not there to export
    return not failed, failed


class ExitFlush:
    """The ``atexit`` hook of one instrumentation.

    Calls still open at exit (after waiting, within half the timeout, for the
    async uploads to end) are ended by ``end_open`` ("interrupted at exit")
    before the flush. Where this process is a survivor (``survivor``: an agent
    whose workers just died), what it took to report is sent first. A Ctrl-C
    (``KeyboardInterrupt``) during it ends the wait at once, quietly, where
    Python would print it as an exception ignored in an ``atexit`` callback.
    Once flushed, the process's record in the spool (``spool``) is removed, or,
    if something could not be sent, left for a survivor.

    A forked child inherits the hook, but what was open or queued at the fork is
    its parent's: in a child it does nothing, unless the child checkpointed
    itself (it has a record of its own). Then it ends as the process it is: its
    open calls ended, its spans flushed (no metrics: those it inherited are the
    parent's too), its record removed, so that its parent, outliving it, never
    takes a normal end for a death. A ``multiprocessing`` child ends by
    ``os._exit``, past ``atexit``: it runs as that child's finalizer.
    """

    def __init__(self, recorder: SpanRecorder, timeout_s: float, otel_metrics: OTelCheckpointMetrics | None = None,
                 end_open: Callable[[], object] | None = None, end_life: Callable[[float], object] | None = None,
                 survivor: Survivor | None = None, spool: ProcessSpool | None = None) -> None:  # fmt: skip
        self._recorder = recorder
        self._end_life = end_life  # (deadline): the process's dcp.process span
        self._timeout_s = timeout_s
        self._otel_metrics = otel_metrics
        self._end_open = end_open
        self._survivor = survivor
        self._spool = spool
        self._pid = os.getpid()
        self._ended_in: int | None = None  # the forked child that has run this already
        multiprocessing.util.register_after_fork(self, ExitFlush._as_finalizer)

    def cancel(self) -> None:
        """Nothing more to do at exit, here or in children forked from now on (``uninstrument()``)."""
        atexit.unregister(self)
        self._timeout_s = 0

    def _as_finalizer(self) -> None:  # (in a multiprocessing child, just forked)
        multiprocessing.util.Finalize(None, self, exitpriority=0)

    def __call__(self) -> None:
        if self._timeout_s <= 0:
            return
        if os.getpid() != self._pid:
            self._end_child()
            return
        deadline = time.monotonic() + self._timeout_s
        failed: list[object]
        try:
            final = self._spool is not None and self._spool.record.made_here()  # (it checkpointed)
            if self._survivor is not None:
                self._survivor.wait_idle(max(0.0, deadline - time.monotonic()) / 2, final)
            # A process with no checkpoint of its own, whose survivor is still sending a dead peer's spans
            # through its exporters (stuck, or it would be done): its exit waits for none of them. The peer's
            # record stays claimed by this process, and once it is gone, another survivor takes it over.
            own_spans = final or self._survivor is None or not self._survivor.delivering
            if self._end_open is not None and self._recorder.open_calls():
                self._recorder.uploads.wait(max(0.0, min(self._timeout_s / 2, deadline - time.monotonic())))
                if self._recorder.open_calls():
                    self._end_open()
            if self._end_life is not None:
                self._end_life(deadline)
            _, failed = _flush(self._recorder, self._otel_metrics, max(0.0, deadline - time.monotonic()),
                               spans=own_spans)  # fmt: skip
        except KeyboardInterrupt:  # Ctrl-C again: the wait ends now
            failed = [self._recorder.provider()]
            if self._otel_metrics is not None:
                failed.append(self._otel_metrics.provider())
        if self._spool is not None:
            self._spool.close(clean=not failed, exiting=True)
        for provider in failed:
            shut_down_in_background(provider)


    def _end_child(self) -> None:
        spool = self._spool
        if spool is None or not spool.record.made_here() or self._ended_in == os.getpid():
            return  # no checkpoint of its own
        self._ended_in = os.getpid()
        deadline = time.monotonic() + self._timeout_s
        failed: list[object] = [self._recorder.provider()]
        try:
            if self._end_open is not None and self._recorder.open_calls():
                self._recorder.uploads.wait(max(0.0, self._timeout_s / 2))
                if self._recorder.open_calls():
                    self._end_open()
            _, failed = _flush(self._recorder, None, max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            pass
        except Exception as exc:  # noqa: BLE001 - a child's end: nothing of it may reach its caller
            reraise_if_signalled(exc)
            report("flush_error", "dcp_otel could not end this forked process's checkpoint spans", exc_info=True)
        spool.close(clean=not failed, exiting=True)


def shut_down_in_background(provider: object) -> None:
    """At exit, for a provider whose exporter is stuck or failing: its shutdown on a daemon thread, in place of the
    SDK's exit hook. That hook would shut the provider down and wait for that exporter again (30 s per batch
    processor or metric reader, plus the exporter's retries), and the exit would not be bounded by our timeout;
    the daemon exports what it still can while the interpreter exits."""
    shutdown = getattr(provider, "shutdown", None)
    if callable(shutdown):
        atexit.unregister(shutdown)  # the SDK registers the provider's bound shutdown
        threading.Thread(target=_shutdown_quietly, args=(shutdown,), name="dcp-otel-shutdown", daemon=True).start()


def _shutdown_quietly(shutdown: Callable[[], object]) -> None:
    try:
        shutdown()
    except Exception as exc:  # noqa: BLE001 - at exit, with a broken exporter: nothing to tell anyone
        reraise_if_signalled(exc)
