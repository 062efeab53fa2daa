"""How a call ends: its failure, the calls it left open above it, its part of its operation.

A mixin of :class:`~dcp_otel.tracing.tracker.SpanRecorder`, for every end but a plain step's (which
``on_record`` ends in one frame) and a collective's (``collective_ended``): an operation's own call, a
failed step, a nested save, a call ended because the code that ran it returned without its end.

Each step of an end is taken once: an end that an exception cut short (a signal handler's, see
:mod:`~dcp_otel.tracing.cut_short`) comes back here for the rest; the call stays among the open calls until
it is in its operation's, its part of the operation is counted once (``Operation.part_done``), and the
operation goes to the builder once (``SpanBuilder.submit``).

Usage::

    recorder._finish(uuid, "exception", time_ns, error, exc)   # the call of ``uuid`` and what it left open
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.spool.layout import I64, OFF_ENTRY_END
from dcp_otel.tracing.failures import Failure
from dcp_otel.tracing.light import detach as light_detach
from dcp_otel.tracing.records import KIND_COLLECTIVE, KIND_OPERATION, Call, Operation, failure_of
from dcp_otel.tracing.steps import CLOCK

if TYPE_CHECKING:
    from collections.abc import Callable

    from dcp_otel.spool.record import ProcessRecord
    from dcp_otel.tracing.builder import SpanBuilder

_pack_end = I64.pack_into
#: Operations that wait in steps of their own (the checkpointer's barrier, its wait for the previous write).
_WAITING_IN_STEPS = frozenset({semconv.CHECKPOINTER_SAVE, semconv.CHECKPOINTER_ASYNC_SAVE, semconv.CHECKPOINTING_SAVE,
                               semconv.CHECKPOINTING_ASYNC_SAVE})  # fmt: skip
_WAIT_STEPS = semconv.WAIT_STEPS


def _detach_quietly(token: object) -> None:
    """Detach a call's context; a token of another context (a thread's that a call started on) is counted.

    Not through ``context_api.detach``, which catches everything itself (what a signal handler raises in it too):
    the one clause here lets a handler's exception through.
    """
    try:
        light_detach(token)
    except Exception as exc:  # noqa: BLE001
        reraise_if_signalled(exc)
        report("recorder_error", "dcp_otel failed to detach a DCP call's context", exc_info=True)


class CallEnds:
    """Ends calls: see the module's docstring."""

    if TYPE_CHECKING:  # what the recorder (SpanRecorder, in dcp_otel.tracing.tracker) holds
        _open: dict[str, Call]
        _interrupted: dict[str, None]
        _local: threading.local
        builder: SpanBuilder
        call_ended: list[Callable[[], None]]
        record: ProcessRecord | None

        def _stack(self) -> list[Call]: ...

        def release_lane(self, call: Call) -> None: ...

    def _finish(self, uuid: str, kind: str, time_ns: int, error: str | None, exc: BaseException | None) -> None:
        stack = self._stack()
        index = len(stack) - 1
        while index >= 0 and stack[index].uuid != uuid:
            index -= 1
        if index < 0:
            if uuid not in self._interrupted:  # (ended already, as the process was ending)
                report("unmatched_event", "dropped a DCP %s event with no matching start", kind)
            return
        failed = kind == "exception"
        if failed and exc is None and error is None:
            error = "exception (not described by torch)"
        failure = failure_of(stack[index], exc, error) if failed else None
        op = stack[index].op
        if failure is not None and exc is not None and op is not None and op.collective_error == id(exc):
            failure.came_from_collective()  # a peer went away: the failure did not start here
        self._close_above(stack, index, time_ns,
                          failure.description if failure is not None else "exception not logged by torch; see parent span")  # fmt: skip
        call = stack.pop()
        call.failure = failure
        self._close(call, time_ns, stack[-1] if stack else None)

    def _close_above(self, stack: list[Call], index: int, time_ns: int, cause: str) -> None:
        """The calls above ``stack[index]`` raised without torch logging it (an end can only come after they
        returned or raised), or their own end was cut short: they end failed, with ``cause``."""
        while len(stack) > index + 1:
            child = stack.pop()
            if child.span_id:
                child.failure = Failure(None, f"did not return: {cause}")
                child.inferred = True
                self._close(child, time_ns, stack[-1])
            else:
                self._open.pop(child.uuid, None)

    def _close(self, call: Call, end_ns: int, parent: Call | None, again: bool = False) -> None:
        """End ``call`` (inlined for a plain step in ``on_record`` and for a collective in
        ``collective_ended``: keep the three in step).

        The call stays among the open calls until its end is whole. ``again``: an end that an exception cut
        short (:mod:`~dcp_otel.tracing.cut_short`), finished: the call is off its thread's stack, and what it
        did already is not done twice.
        """
        if not call.span_id:  # a per-key call: summarized by on_key_event, no span
            self._open.pop(call.uuid, None)
            return
        if not (again and call.end_ns):
            call.end_ns = end_ns
            if call.keys is not None:  # a conversion: its per-key lane is free
                self.release_lane(call)
            if call.rec >= 0:
                _pack_end(self.record.mm, call.rec + OFF_ENTRY_END, end_ns)  # type: ignore[union-attr]
            if parent is not None and call.kind != KIND_COLLECTIVE:  # a collective's time stays waiting
                parent.children_ns += end_ns - call.start_ns
        token = call.token
        call.token = None
        if token is not None:  # (inline, not _detach_quietly: an exception out of a function's first instruction
            try:  # would leave the token taken from the call and the context attached for good)
                light_detach(token)
            except Exception as exc:  # noqa: BLE001 - as context_api.detach: a token of another context
                reraise_if_signalled(exc)
                report("recorder_error", "dcp_otel failed to detach a DCP call's context", exc_info=True)
        op = call.op
        if op is None:
            self._open.pop(call.uuid, None)
            return
        if op.submitted and not call.owns_part:  # ended after its operation was built: build it on its own
            self._open.pop(call.uuid, None)  # (first: a late call's end cut short is lost, never built twice)
            self.builder.submit(op, [call])
            return
        if not again or not (op.queued or any(c is call for c in op.calls)):
            op.calls.append(call)
        if call.owns_part or call.kind == KIND_OPERATION:
            self._hand_on(call, op)
        self._open.pop(call.uuid, None)

    def _hand_on(self, call: Call, op: Operation) -> None:
        """What an operation learns from its own call's end; the last part hands it to the builder (once)."""
        end_ns = call.end_ns
        if call.kind == KIND_OPERATION:
            op.start_ns = call.start_ns
            for wake in self.call_ended:  # what waits for checkpoint calls to end looks again (the builder's build)
                wake()
            CLOCK.blocked_call(call.start_ns, end_ns)  # its caller's step was not slowed by this: it waited in it
            waited_ns = end_ns - call.start_ns - call.children_ns
            if op.name in _WAITING_IN_STEPS:  # the checkpointer waits in steps of its own
                waited_ns += sum(c.end_ns - c.start_ns for c in op.calls if c.func_name in _WAIT_STEPS)
            op.wait_s = waited_ns / 1e9
        if call.owns_part and (
            op.part_done(end_ns, call.failure.description if call.failure is not None else None, call)
            or (op.submitted and not op.queued)  # complete, and an end cut short never handed it on (submit: once)
        ):
            self.builder.submit(op)
