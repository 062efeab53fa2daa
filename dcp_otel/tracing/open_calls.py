"""The calls open now, read from any thread, and ended as failed when the process ends.

A mixin of :class:`~dcp_otel.tracing.tracker.SpanRecorder`. On the caller's thread,
:meth:`OpenCalls.close_unfinished` ends the calls a thread left open when the code that ran
them returned or raised without torch saying so. From outside the caller's thread: the stall watchdog and metrics collections read
:meth:`OpenCalls.open_calls`; a signal handler, the watchdog or ``atexit`` call
:meth:`OpenCalls.interrupt_open` while the calls' own threads may be blocked
for good (see :mod:`dcp_otel.live.ending`).

Usage::

    for call, thread_id in recorder.open_calls(): ...
    ended = recorder.interrupt_open("SIGTERM", describe, stacks)   # then drain the builder
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.tracing.failures import Failure
from dcp_otel.tracing.records import KIND_OPERATION, KIND_STAGING, KIND_UPLOAD, Call, Operation, failure_of

if TYPE_CHECKING:
    from dcp_otel.tracing.builder import SpanBuilder
    from dcp_otel.tracing.uploads import InFlight

#: Interrupted calls whose late end events are still recognized (and dropped).
MAX_INTERRUPTED = 4096
#: The longest the ending waits for a lock that the code it interrupted may hold.
LOCK_WAIT_S = 0.5


class OpenCalls:
    """What is open, for readers on other threads; ending it all when the process ends."""

    if TYPE_CHECKING:  # what the recorder (SpanRecorder, in dcp_otel.tracing.tracker) holds
        _open: dict[str, Call]
        _stacks: dict[int, list[Call]]
        _interrupted: dict[str, None]
        _stale_tokens: dict[int, object]
        _interrupt_lock: threading.RLock
        uploads: InFlight
        builder: SpanBuilder
        closed: bool
        call_ended: list[Callable[[], None]]

        def _stack(self) -> list[Call]: ...

        def release_lane(self, call: Call) -> None: ...

        def _close(self, call: Call, end_ns: int, parent: Call | None, again: bool = False) -> None: ...

    def close_unfinished(self, depth: int, exc: BaseException | None) -> None:
        """End, as failed, the calls this thread left open above ``depth``.

        For a DCP call that raised without torch logging an end or an exception
        (``create_checkpoint_daemon_process`` when the checkpoint daemon cannot
        start): called when the code that ran it returns or raises. After
        ``uninstrument()`` (an async upload still running then), torch's ends no
        longer reach the recorder: a call that returned normally ends with its
        end unknown (``dcp.end_unknown``), never as a failure.
        """
        try:
            stack = self._stack()
            if len(stack) <= depth:
                return
            now = time.time_ns()
            while len(stack) > depth:
                call = stack.pop()
                if call.span_id:
                    if exc is None and self.closed:
                        call.extra = {**(call.extra or {}), semconv.ATTR_END_UNKNOWN: True}
                    else:
                        call.failure = failure_of(call, exc, None if exc is not None else "did not return")
                    call.inferred = True
                    self._close(call, now, stack[-1] if stack else None)
                else:
                    self._open.pop(call.uuid, None)
        except Exception as caught:  # noqa: BLE001
            reraise_if_signalled(caught)
            report("recorder_error", "dcp_otel failed to end an unfinished DCP call", exc_info=True)

    def open_calls(self) -> list[tuple[Call, int | None]]:
        """Every call open in this process right now, with the id of the thread inside it.

        Uploads and stagings (which no thread is inside: they end with a
        future) have ``None``. Never raises; a call ending meanwhile may or may
        not be included.
        """
        found: list[tuple[Call, int | None]] = []
        try:
            for ident, stack in list(self._stacks.items()):
                found.extend((call, ident) for call in tuple(stack) if call.span_id and call.op is not None)
            found.extend((call, None) for call in self.uploads.open_calls())
        except Exception as exc:  # noqa: BLE001 - a reader of telemetry state never raises
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to read the open DCP calls", exc_info=True)
        return found

    def open_since(self) -> int:
        """When the earliest operation with a call open now started (0: none): the training steps after it may yet
        overlap its background work (see :meth:`SpanBuilder._fold`). 1 while an upload has ended and is not handed
        to the builder yet (its window is not known: no step is folded). Read from the builder's thread."""
        if self.uploads.ending():
            return 1
        return min((call.op.start_ns or call.start_ns for call, _ in self.open_calls() if call.op is not None),
                   default=0)  # fmt: skip

    def checkpointing(self) -> bool:
        """Whether a thread is inside a checkpoint operation's call now (``save``, ``async_save``'s staging, a
        ``load``): what the builder waits out before it builds (see :meth:`SpanBuilder.defer`). An upload's
        steps on torch's own thread do not count. Read from the builder's thread: nothing on the hot path.
        """
        try:
            for stack in list(self._stacks.values()):
                if any(call.kind == KIND_OPERATION for call in tuple(stack)):
                    return True
        except Exception as exc:  # noqa: BLE001 - a reader of telemetry state never raises
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to read the open DCP calls", exc_info=True)
        return False

    def interrupt_open(self, cause: str, describe: Callable[[Operation], str],
                       stacks: dict[int, str] | None = None) -> list[Operation]:  # fmt: skip
        """End every open call as failed, because the process is ending (``cause``: ``SIGTERM``, ``exit``).

        Called from any thread (a signal handler, the watchdog, ``atexit``)
        while the calls' own threads may be blocked for good (in a collective
        waiting for a rank that hangs). Each open call gets the failure
        ``describe(op)`` with its thread's stack (``stacks``: thread id to its
        formatted stack), the end time now and ``dcp.interrupted``; its
        operation is complete and goes to the builder, which the caller then
        drains. The threads' stacks are cleared: should a thread return after
        all (SIGINT, caught), the ends torch logs for these calls are dropped.
        Returns the operations ended.
        """
        ended: list[Operation] = []
        # Bounded: a thread frozen (in a signal handler) or stuck while holding it must not hang the ending.
        if not self._interrupt_lock.acquire(timeout=LOCK_WAIT_S):
            report("recorder_error", "dcp_otel could not end the open DCP calls: another ending holds them")
            return ended
        try:
            now = time.time_ns()
            by_op: dict[int, tuple[Operation, list[tuple[Call, int | None]]]] = {}
            for call, ident in self.open_calls():
                if call.end_ns == 0 and call.op is not None:
                    by_op.setdefault(id(call.op), (call.op, []))[1].append((call, ident))
            for ident, stack in list(self._stacks.items()):
                on_thread = tuple(stack)
                for call in on_thread:
                    self._interrupted[call.uuid] = None
                stack.clear()
                outermost = next((call.token for call in on_thread if call.token is not None), None)
                if outermost is not None:  # that thread's context, to restore should it call DCP again
                    self._stale_tokens[ident] = outermost
            while len(self._interrupted) > MAX_INTERRUPTED:
                self._interrupted.pop(next(iter(self._interrupted)))
            for op, calls in by_op.values():
                self._end_interrupted(op, calls, cause, describe(op), stacks or {}, now)
                ended.append(op)
        except Exception as exc:  # noqa: BLE001 - the process is ending: whatever can be kept is
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to end the open DCP calls", exc_info=True)
        finally:
            self._interrupt_lock.release()
        return ended

    def _end_interrupted(self, op: Operation, calls: list[tuple[Call, int | None]], cause: str, description: str,
                         stacks: dict[int, str], now: int) -> None:  # fmt: skip
        op_stack = next((stacks[ident] for _, ident in calls if ident in stacks), None)
        finished: list[Call] = []
        claimed = 0  # uploads taken from their futures: released once handed to the builder
        try:
            for call, ident in calls:
                self._open.pop(call.uuid, None)
                if call.kind in (KIND_UPLOAD, KIND_STAGING):
                    if not self.uploads.claim(call):
                        continue  # its future ended it meanwhile
                    claimed += 1
                stack = stacks.get(ident, op_stack) if ident is not None else op_stack
                call.failure = Failure.interrupted(description, stack)
                call.inferred = True
                call.extra = {**(call.extra or {}), semconv.ATTR_INTERRUPTED: cause}
                call.end_ns = now
                if call.keys is not None:  # a conversion: its per-key lane is free
                    self.release_lane(call)
                call.token = None  # its context belongs to a thread that may never come back
                if call.kind == KIND_OPERATION:
                    op.start_ns = call.start_ns
                    op.wait_s = max(0, now - call.start_ns - call.children_ns) / 1e9
                finished.append(call)
            if op.submitted:  # built already: these are late parts of it
                self.builder.submit(op, finished)
                return
            op.calls.extend(finished)
            op.interrupted = cause
            # The operation's lock is held for a few bytecodes at a time; held longer, its holder is frozen
            # (the main thread, in the signal handler that waits for this) or gone: go on without it.
            locked = op.lock.acquire(timeout=LOCK_WAIT_S)
            try:
                op.end_ns = max(op.end_ns, now)
                op.failed = op.failed or description
                op.submitted = True
            finally:
                if locked:
                    op.lock.release()
            self.builder.submit(op)
        finally:
            for wake in self.call_ended:  # (its calls ended: what waits for them looks again)
                wake()
            for _ in range(claimed):
                self.uploads.done()
