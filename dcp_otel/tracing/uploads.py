"""An async save's upload and staging: calls that end on another thread, when their future does.

``async_save`` returns once the state dict is staged (or staging has started)
and handed to the background executor. The upload, and an asynchronous
stager's staging, are recorded as calls of the operation that end in their
future's done-callback; each is a part of the operation, so the operation is
complete (and built) only when its checkpoint is durable.

Usage (what :class:`~dcp_otel.attach.async_thread.AsyncContextCarrier` does)::

    carried, finish = recorder.begin_async_upload(staging_future)
    future = executor.execute_save(...)       # runs the background save in ``carried``
    future.add_done_callback(finish)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext

from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import raised_by_signal_handler, reraise_if_signalled
from dcp_otel.tracing.failures import Failure, GlobalRank, global_rank_of
from dcp_otel.tracing.operations import OPERATION_KEY
from dcp_otel.tracing.records import KIND_STAGING, KIND_UPLOAD, Call, Operation, new_span_id

if TYPE_CHECKING:
    from dcp_otel.tracing.tracker import SpanRecorder

Finish = Callable[["Future[Any] | BaseException"], None]


def begin_async_upload(
    recorder: SpanRecorder, staging: Future[Any] | None
) -> tuple[context_api.Context, Finish] | None:
    """Open the upload (and async staging) calls of the current async save; see the module.

    An exception out of it (a signal handler's, wherever it lands) ends what it opened, with that exception:
    the caller never gets the callback that would.
    """
    opened: list[Call] = []
    handed: list[Finish] = []
    try:
        op = context_api.get_value(OPERATION_KEY)
        if not isinstance(op, Operation):
            return None
        ctx = context_api.get_current()
        parent = trace.get_current_span(ctx).get_span_context()
        parent_or_none = parent if parent.is_valid else None
        now = time.time_ns()
        record = recorder.record
        if isinstance(staging, Future):
            staged = Call("", "async_staging", now, new_span_id(), parent_or_none, op, op.step_attributes, KIND_STAGING)
            opened.append(staged)  # (before it opens: ending one that never opened does nothing)
            recorder.uploads.started(staged, op)
            if record is not None:
                record.background(op, True, staged.span_id, now)
            staging.add_done_callback(lambda fut: _end(recorder, staged, fut))
        upload = Call("", "async_upload", now, new_span_id(), parent_or_none, op, op.step_attributes, KIND_UPLOAD)
        opened.append(upload)
        recorder.uploads.started(upload, op)
        if record is not None:
            record.background(op, False, upload.span_id, now)
        metrics = recorder.metrics

        def measured() -> None:
            if metrics is not None:
                try:  # the upload's own thread (the future's done-callback), not the training thread
                    metrics.async_upload_done(op.rank_label, (time.time_ns() - now) / 1e9, op.exemplar)
                except Exception as exc:  # noqa: BLE001
                    reraise_if_signalled(exc)
                    report("metrics_error", "dcp_otel failed to record an async upload", exc_info=True)

        once = threading.Lock()

        def finish(outcome: Future[Any] | BaseException) -> None:  # (called twice, it counts and ends it once)
            if once.acquire(blocking=False):
                measured()
            _end(recorder, upload, outcome)

        if metrics is not None:
            try:  # this runs inside torch's async_save: nothing may escape
                metrics.async_handed_off(op.rank_label)
                handed.append(finish)
            except Exception as exc:  # noqa: BLE001
                reraise_if_signalled(exc)
                report("metrics_error", "dcp_otel failed to count an async save in flight", exc_info=True)
        light = NonRecordingSpan(SpanContext(op.trace_id, upload.span_id, False, op.flags))
        return trace.set_span_in_context(light, ctx), finish
    except BaseException as exc:
        for call in opened:  # each ends once (claimed), whoever else ends it
            if handed and call is opened[-1]:
                handed[0](exc)  # (the upload, and its count in flight)
            else:
                _end(recorder, call, exc)
        if isinstance(exc, Exception) and not raised_by_signal_handler(exc):
            report("recorder_error", "dcp_otel failed to trace an async upload", exc_info=True)
            return None
        raise


def _end(recorder: SpanRecorder, call: Call, outcome: Future[Any] | BaseException) -> None:
    """An upload or staging call ended (on whatever thread completed its future). Once: a call ended already
    (the process was ending, or a callback added twice) is left alone."""
    if not recorder.uploads.claim(call):
        return
    try:
        op = call.op
        call.failure = outcome_failure(outcome, op.rank if op is not None else None,
                                       global_rank_of(op.group) if op is not None else None)  # fmt: skip
        call.end_ns = end_ns = time.time_ns()
        if op is not None:
            if recorder.record is not None:
                recorder.record.background(op, call.kind == KIND_STAGING, call.span_id, call.start_ns, end_ns)
            op.calls.append(call)
            if op.part_done(end_ns, call.failure.description if call.failure is not None else None):
                recorder.builder.submit(op)
    except Exception as exc:  # noqa: BLE001 - a future's done-callback: nothing may escape
        reraise_if_signalled(exc)
        report("recorder_error", "dcp_otel failed to end an async upload span", exc_info=True)
    finally:
        recorder.uploads.done()


class InFlight:
    """The uploads (and stagings) still open, to wait for and to show as in progress.

    Their future's done-callback ends them *after* waiters on the future wake
    up, so anyone who needs the telemetry complete waits on this, not on the
    future.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # held by ``with`` itself, not the condition's (see SpanBuilder)
        self._cond = threading.Condition(self._lock)
        self._open: dict[Call, Call] = {}  # (a call hashes as itself)
        self._ending = 0  # claimed, not yet handed to the builder

    # No call inside these locks: a signal handler's exception (raised at a call) never leaves a part
    # counted in its operation and not open here, nor one claimed and not counted as ending.
    def started(self, call: Call, op: Operation) -> None:
        """``call``, a part of ``op``, is open: counted in its operation and here, together."""
        with self._lock, op.lock:
            op.pending += 1
            self._open[call] = call

    def claim(self, call: Call) -> bool:
        """``call`` is ending: ``True`` the first time (its future, or the process ending, ends it), and then
        :meth:`done` must follow once it is handed to the builder."""
        with self._lock:
            if call not in self._open:
                return False
            del self._open[call]
            self._ending += 1
            return True

    def done(self) -> None:
        with self._lock:
            self._ending -= 1
            self._cond.notify_all()

    def ending(self) -> bool:
        """Whether a call has been claimed (it ended) and is not handed to the builder yet."""
        return self._ending > 0

    def open_calls(self) -> list[Call]:
        with self._lock:
            return list(self._open.values())

    def wait(self, timeout: float | None) -> bool:
        with self._lock:
            return self._cond.wait_for(lambda: not self._open and not self._ending, timeout)


def outcome_failure(outcome: Future[Any] | BaseException, rank: int | None = None,
                    to_global: GlobalRank | None = None) -> Failure | None:  # fmt: skip
    """The failure of a future's outcome (or an exception) on ``rank``, if any."""
    if isinstance(outcome, BaseException):
        return Failure(outcome, None, rank, to_global)
    if outcome.cancelled():
        return Failure(None, "cancelled")
    exc = outcome.exception()
    return Failure(exc, None, rank, to_global) if exc is not None else None
