"""DCP's own collectives as calls: ``_DistWrapper``'s object collectives, their step and bytes.

A mixin of :class:`~dcp_otel.tracing.tracker.SpanRecorder`: the patches around
``_DistWrapper`` (:mod:`dcp_otel.attach.patches`) tell the recorder when one of
DCP's collectives begins and ends on this thread, and how many bytes torch
pickled and unpickled for it. Each becomes a ``dcp.collective.<method>`` call
under the step it serves; its time stays the operation's waiting.

Usage (what the patches do)::

    previous = recorder.collective_scope("reduce_scatter", "plan")
    call = recorder.collective_started("gather_object")
    ...                                    # torch.distributed's collective
    recorder.collective_ended(call, None)
    recorder.end_collective_scope(previous)
"""

from __future__ import annotations

import random
import threading
import time
from typing import TYPE_CHECKING

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.spool.layout import ENTRY, ENTRY_SHIFT, I64, KIND_CODES, OFF_ENTRY_END, RING_MASK
from dcp_otel.spool.record import ProcessRecord
from dcp_otel.tracing.records import KIND_COLLECTIVE, Call, failure_of

_COLLECTIVE_CODE = KIND_CODES[KIND_COLLECTIVE]
_pack_entry = ENTRY.pack_into
_pack_end = I64.pack_into

_getrandbits = random.getrandbits

if TYPE_CHECKING:
    from dcp_otel.tracing.builder import SpanBuilder


class CollectiveCalls:
    """The recorder's side of DCP's collectives; never raises."""

    if TYPE_CHECKING:  # what the recorder (SpanRecorder, in dcp_otel.tracing.tracker) holds
        _local: threading.local
        _open: dict[str, Call]
        builder: SpanBuilder
        record: ProcessRecord | None

    def collective_scope(self, pattern: str, step: object) -> object:
        """``_DistWrapper.<pattern>(step, ...)`` begins: the collectives it makes belong to torch's ``step``.

        Returns what :meth:`end_collective_scope` restores.
        """
        local = self._local
        previous = getattr(local, "collective", None), getattr(local, "collective_tag", "")
        # The attributes its collectives share (never mutated: a call that learns more replaces its dict).
        extra = {semconv.ATTR_COLLECTIVE_PATTERN: pattern}
        if type(step) is str and step:
            extra[semconv.ATTR_COLLECTIVE_STEP] = step
        local.collective = extra
        local.collective_tag = f"|{pattern}|{step if type(step) is str else ''}"  # whom they serve, in the record
        return previous

    def end_collective_scope(self, previous: object) -> None:
        self._local.collective, self._local.collective_tag = previous  # type: ignore[misc]

    def collective_started(self, method: str) -> Call | None:
        """One of DCP's object collectives begins on this thread, inside an operation (else ``None``).

        It goes on the thread's stack, so the collective a rank is in when the process ends is ended
        with the rest; it is not made current (nothing runs inside it but torch.distributed).
        """
        try:
            local = self._local
            try:
                stack: list[Call] = local.stack
            except AttributeError:  # a thread with no DCP call yet: not in an operation
                return None
            if not stack:
                return None
            parent = stack[-1]
            op = parent.op
            if op is None or not parent.span_id or parent.kind == KIND_COLLECTIVE or op.interrupted is not None:
                return None
            span_id = _getrandbits(64) or 1  # (new_span_id, one call fewer)
            # Keyed in the open calls by a hex id (DCP's uuids have dashes: never the same); its parent is
            # its step, whose context the builder makes (nothing runs under a collective: no context now).
            call = Call(hex(span_id), method, time.time_ns(), span_id, parent, op, op.step_attributes, KIND_COLLECTIVE)
            extra = getattr(local, "collective", None)
            if extra is not None:
                call.extra = extra
            stack.append(call)
            self._open[call.uuid] = call
            base = stack.base  # type: ignore[attr-defined]
            if base >= 0:  # the name says whom it serves: "gather_object|all_reduce|write"
                call.rec = rec = base + ((stack.calls & RING_MASK) << ENTRY_SHIFT)  # type: ignore[attr-defined]
                stack.calls += 1  # type: ignore[attr-defined]
                _pack_entry(self.record.mm, rec, span_id, call.start_ns, 0, op.rec_serial, _COLLECTIVE_CODE,  # type: ignore[union-attr]
                            (method + getattr(local, "collective_tag", "")).encode())  # fmt: skip
            return call
        except Exception as exc:  # noqa: BLE001 - telemetry never raises into training
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to record a DCP collective", exc_info=True)
            return None

    def collective_ended(self, call: Call, exc: BaseException | None) -> None:
        """The collective returned, or raised ``exc`` (which then propagates out of the operation)."""
        try:
            stack = self._local.stack  # there since collective_started, on this same thread
            if not stack or stack[-1] is not call:
                if call not in stack:  # ended already: the process was ending (SIGINT, caught)
                    return
                while stack[-1] is not call:  # nothing nests in a collective; never drop the rest
                    stack.pop()
            stack.pop()
            op = call.op  # never None: collective_started makes a call only inside an operation
            if exc is not None and op is not None:
                call.failure = failure_of(call, exc, None)
                call.failure.came_from_collective()
                op.collective_error = id(exc)
            # The recorder's _close for a call that owns no part of its operation, has no token, and whose
            # time stays its parent's waiting: keep the two in step.
            call.end_ns = time.time_ns()
            if call.rec >= 0:
                _pack_end(self.record.mm, call.rec + OFF_ENTRY_END, call.end_ns)  # type: ignore[union-attr]
            self._open.pop(call.uuid, None)
            if op is None:
                return
            op.released_ns = call.end_ns
            if op.submitted:  # ended after its operation was built: built on its own
                self.builder.submit(op, [call])
            else:
                op.calls.append(call)
        except Exception as caught:  # noqa: BLE001
            reraise_if_signalled(caught)
            report("recorder_error", "dcp_otel failed to record a DCP collective", exc_info=True)

    def on_arrivals(self, call: Call, marks: list[tuple[int, int]]) -> None:
        """The coordinator's write gather ``call`` received ``marks``: (rank, its time since the plan released it)."""
        if marks:
            call.arrivals = marks

    def current_collective(self) -> Call | None:
        """DCP's collective this thread is in, if any: where torch's pickled bytes are counted.

        Torch pickles the objects of every object collective (the training code's too); only DCP's
        count, so the patches ask this first and size nothing for the others. The bytes are two
        integers on the call (``sent_bytes``, ``received_bytes``); the builder makes them attributes.
        """
        try:
            stack = self._local.stack
        except AttributeError:
            return None
        if stack and stack[-1].kind == KIND_COLLECTIVE:
            return stack[-1]  # type: ignore[no-any-return]
        return None
