"""A DCP record whose handling an exception cut short, made whole: a start undone, an end finished.

A mixin of :class:`~dcp_otel.tracing.tracker.SpanRecorder`. Python runs a signal handler on the main
thread at a call, a backward jump or a function's start, wherever the thread is; what the handler raises
(a one-shot ``SIGALRM`` timeout's ``TimeoutError``, torchelastic's ``SignalException``) comes out of
there. Landing inside dcp-otel's handling of one of DCP's records, it leaves that handling half done: a
call on its thread's stack whose function never runs, a context nobody detaches (every later DCP call of
the thread would nest in an operation that never ends, its spans never exported, its calls piling up), a
slot of the process's record left open (a survivor would name it where a later death happened), an
operation never handed to the builder. It also leaves the application's exception to pass through, as
it must.

So the two places a record comes in, the logger tap (torch's records) and dcp-otel's own wrappers of
the calls torch does not log, catch whatever comes out of handling one and call :meth:`CutShort.cut_short`
before letting it through:

* a **start** is undone: the exception comes out where the start is logged, before the function is
  called, so the call never runs: no span, the context as the start found it, an operation it began
  dropped (its record slot free again);
* an **end** is finished: the function ran; its span ends, its operation is built as usual.

Each start and end is ordered so that what it left tells how far it got: a call is on its thread's
stack before its context is attached, and among the open calls until it is in its operation's calls
(``on_record``, ``_push``, ``_close``); a part of an operation is counted once however often it is told
(``Operation.part_done``), and an operation handed to the builder once (``SpanBuilder.submit``).

Some places are out of reach of any ``try`` of ours: a handler runs at a function's very first
instruction too, so an exception can come out of the tap's ``debug`` before it reads torch's end record,
or out of ``__exit__`` before it ends a state-dict call. The call then stays open on its thread's stack,
its context attached, and nothing more comes for it. :meth:`CutShort.left_behind` finds it when the thread
starts its next call that an application makes itself (``events.ENTRY_POINTS``): each operation's call
watches the Python frame that runs it (torch's logging wrapper, dcp-otel's, or the public function's),
and a frame no longer on the thread's stack means the call is over. It is ended then, failed, as every
call above it, and the context is the one it found; the new call starts afresh.

Usage (a boundary where records come in)::

    try:
        recorder.on_record(msg)
    except BaseException:
        recorder.cut_short(msg)
        raise
"""

from __future__ import annotations

import sys
import threading
import time
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, Final

from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan

from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.spool.layout import ENTRY_SIZE
from dcp_otel.tracing.light import SPAN_KEY
from dcp_otel.tracing.light import attach as light_attach
from dcp_otel.tracing.light import detach as light_detach
from dcp_otel.tracing.light import get_current as light_get_current
from dcp_otel.tracing.operations import OPERATION_KEY
from dcp_otel.tracing.records import KIND_OPERATION, Operation

#: How an operation call that its thread left without its end ends (see CutShort.left_behind).
LEFT_BEHIND: Final = "did not end as recorded: its end was cut short (an exception, a signal handler's)"

if TYPE_CHECKING:
    from dcp_otel.spool.record import ProcessRecord
    from dcp_otel.tracing.records import Call


class CutShort:
    """Makes whole what an exception left of a record's handling (see the module's docstring)."""

    if TYPE_CHECKING:  # what the recorder (SpanRecorder, in dcp_otel.tracing.tracker) holds
        _open: dict[str, Call]
        _local: threading.local
        record: ProcessRecord | None

        def _stack(self) -> list[Call]: ...

        def _finish(self, uuid: str, kind: str, time_ns: int, error: str | None, exc: BaseException | None) -> None: ...

        def _close(self, call: Call, end_ns: int, parent: Call | None, again: bool = False) -> None: ...

        def release_lane(self, call: Call) -> None: ...

        def _hand_on(self, call: Call, op: Operation) -> None: ...

    def cut_short(self, msg: Any) -> None:
        """Handling ``msg`` (one of DCP's records: start, end, exception) was cut short on this thread.

        Idempotent: what it finds done stays done. Never raises, but what a signal handler raises meanwhile.
        """
        try:
            if type(msg) is not dict:
                return
            kind, uuid = msg.get("event"), msg.get("uuid")
            if type(uuid) is not str or not uuid:
                return
            if kind == "start":
                self._undo_start(uuid)
            elif kind in ("end", "exception"):
                error = msg.get("error")
                self._finish_end(uuid, kind, error if isinstance(error, str) else None)
        except Exception as exc:  # noqa: BLE001 - telemetry never raises into training
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to make whole a DCP record cut short", exc_info=True)

    def left_behind(self, stack: list[Call], current: object) -> bool:
        """Whether this thread's outermost operation call is over without its end (then ended here, failed),
        or the context still names ``current``, an operation built already, with no call of it open here
        (then the context is taken back): in either case the context now is the one to start from.

        Called as the thread starts an entry point inside an operation's context (a walk up its Python
        stack, about 1 us: a nested save or state-dict call, a few per checkpoint).
        """
        if not stack:
            if isinstance(current, Operation) and current.queued:
                _forget_operation(current)
                return True
            return False
        bottom = stack[0]
        watched = bottom.watched
        if watched is None:
            return False
        frame_id, code = watched
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if id(frame) == frame_id and frame.f_code is code:
                return False
            frame = frame.f_back
        self._finish(bottom.uuid, "exception", time.time_ns(), LEFT_BEHIND, None)
        return True

    def _undo_start(self, uuid: str) -> None:
        """The call never runs: off its thread's stack and the open calls, out of the record, its context gone."""
        stack = self._stack()
        call: Call | None = None
        for index in range(len(stack) - 1, -1, -1):
            if stack[index].uuid == uuid:
                call = stack[index]
                del stack[index]
                break
        found = self._open.pop(uuid, None)
        call = call or found
        if call is not None and call.keys is not None:  # a conversion: the per-key lane is free again
            self.release_lane(call)
        record = self.record
        if call is not None and call.span_id:
            if call.rec >= 0 and record is not None:  # its entry in the record: as if never written
                record.mm[call.rec : call.rec + ENTRY_SIZE] = bytes(ENTRY_SIZE)
            token = call.token
            if token is not None:
                call.token = None
                light_detach(token)
            else:
                _put_back_context(call)
            if call.owns_part and call.kind != KIND_OPERATION and call.op is not None:  # an adopted operation's
                call.end_ns = time.time_ns()  # top-level call: its part ends (it never ran)
                self._hand_on(call, call.op)
        if record is not None:
            record.abandon(uuid)  # an operation it began: never run, never built

    def _finish_end(self, uuid: str, kind: str, error: str | None) -> None:
        """The call ran and ended: whatever of its end is not done yet, now."""
        if any(call.uuid == uuid for call in self._stack()):  # nothing of the end done yet
            self._finish(uuid, kind, time.time_ns(), error, None)
            return
        call = self._open.get(uuid)
        if call is not None:  # off the stack, its end not whole
            self._close(call, time.time_ns(), None, again=True)


#: The code of each function that only passes a DCP record along, from where it was logged to where the
#: recorder starts a call (each module adds its own, see passes_records_along): not the frame that runs the call.
PASSING: set[CodeType] = set()


def passes_records_along(*functions: Any) -> None:
    """Name functions that only hand DCP records on (the tap's, the recorder's, a wrapper's start)."""
    for function in functions:
        PASSING.add(getattr(function, "__func__", function).__code__)


def watched_frame() -> tuple[int, CodeType] | None:
    """What :meth:`CutShort.left_behind` watches for an operation call starting now: the first frame up the
    stack that only passed its start along (torch's logging wrapper, dcp-otel's own wrapper, the public
    state-dict function running its ``with``)."""
    frame: FrameType | None = sys._getframe(2)
    passing = PASSING
    while frame is not None and frame.f_code in passing:
        frame = frame.f_back
    return (id(frame), frame.f_code) if frame is not None else None


def _forget_operation(op: Operation) -> None:
    """The context names an operation that ended and was built: what it held before, as far as is known."""
    current = light_get_current()
    kept = {k: v for k, v in current.items() if k not in (OPERATION_KEY, SPAN_KEY)}
    if op.caller is not None:  # the span current when the operation began (its object is gone with the context)
        kept[SPAN_KEY] = NonRecordingSpan(op.caller)
    light_attach(Context(kept))  # (its token dropped: nothing is left to detach it)


def _put_back_context(call: Call) -> None:
    """Cut short right as its context was attached (the token lost): the context its start found, again."""
    current = light_get_current()
    span = current.get(SPAN_KEY)
    if span is None or span.get_span_context().span_id != call.span_id:  # type: ignore[attr-defined]
        return  # never attached
    prior = call.prior
    if prior is None:  # a plain step (on_record): the same context but for its span
        prior = Context({k: v for k, v in current.items() if k != SPAN_KEY})
        if call.parent is not None:
            prior = Context({**prior, SPAN_KEY: call.parent})
    light_attach(prior)  # (its token dropped: nothing is left to detach it)
