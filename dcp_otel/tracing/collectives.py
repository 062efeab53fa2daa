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

import threading
import time
from typing import TYPE_CHECKING

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.tracing.light import span_context as light_span_context
from dcp_otel.tracing.records import KIND_COLLECTIVE, Call, failure_of, new_span_id


class CollectiveCalls:
    """The recorder's side of DCP's collectives; never raises."""

    if TYPE_CHECKING:  # what the recorder (SpanRecorder, in dcp_otel.tracing.tracker) holds
        _local: threading.local
        _open: dict[str, Call]

        def _stack(self) -> list[Call]: ...

        def _close(self, call: Call, end_ns: int, parent: Call | None) -> None: ...

    def collective_scope(self, pattern: str, step: object) -> object:
        """``_DistWrapper.<pattern>(step, ...)`` begins: the collectives it makes belong to torch's ``step``.

        Returns what :meth:`end_collective_scope` restores.
        """
        local = self._local
        previous = getattr(local, "collective", None)
        local.collective = (pattern, step if type(step) is str else None)
        return previous

    def end_collective_scope(self, previous: object) -> None:
        self._local.collective = previous

    def collective_started(self, method: str) -> Call | None:
        """One of DCP's object collectives begins on this thread, inside an operation (else ``None``).

        It goes on the thread's stack, so the collective a rank is in when the process ends is ended
        with the rest; it is not made current (nothing runs inside it but torch.distributed).
        """
        try:
            stack = self._stack()
            parent = stack[-1] if stack else None
            op = parent.op if parent is not None else None
            if op is None or not parent.span_id or parent.kind == KIND_COLLECTIVE or op.interrupted is not None:  # type: ignore[union-attr]
                return None
            span_id = new_span_id()
            parent_ctx = light_span_context(op.trace_id, parent.span_id, op.flags)  # type: ignore[union-attr]
            call = Call(f"collective-{span_id:016x}", method, time.time_ns(), span_id, parent_ctx, op,
                        op.step_attributes, KIND_COLLECTIVE)  # fmt: skip
            scope = getattr(self._local, "collective", None)
            if scope is not None:
                pattern, step = scope
                call.extra = {semconv.ATTR_COLLECTIVE_PATTERN: pattern}
                if step:
                    call.extra[semconv.ATTR_COLLECTIVE_STEP] = step
            stack.append(call)
            self._open[call.uuid] = call
            return call
        except Exception:  # noqa: BLE001 - telemetry never raises into training
            report("recorder_error", "dcp_otel failed to record a DCP collective", exc_info=True)
            return None

    def collective_ended(self, call: Call, exc: BaseException | None) -> None:
        """The collective returned, or raised ``exc`` (which then propagates out of the operation)."""
        try:
            stack = self._stack()
            if call not in stack:  # ended already: the process was ending (SIGINT, caught)
                return
            while stack and stack[-1] is not call:  # nothing nests in a collective; never drop the rest
                stack.pop()
            stack.pop()
            if exc is not None and call.op is not None:
                call.failure = failure_of(call, exc, None)
                call.failure.came_from_collective()
                call.op.collective_error = id(exc)
            self._close(call, time.time_ns(), stack[-1] if stack else None)
        except Exception:  # noqa: BLE001
            report("recorder_error", "dcp_otel failed to record a DCP collective", exc_info=True)

    def on_object_bytes(self, sent: int, received: int) -> None:
        """torch pickled (``sent``) or unpickled (``received``) an object of that many bytes: counted on
        the collective this thread is in, if it is one of DCP's."""
        try:
            stack = self._local.stack
        except AttributeError:
            return
        if not stack or stack[-1].kind != KIND_COLLECTIVE:
            return
        call = stack[-1]
        extra = call.extra if call.extra is not None else {}
        if sent:
            extra[semconv.ATTR_COLLECTIVE_SENT_BYTES] = extra.get(semconv.ATTR_COLLECTIVE_SENT_BYTES, 0) + sent
        if received:
            key = semconv.ATTR_COLLECTIVE_RECEIVED_BYTES
            extra[key] = extra.get(key, 0) + received
        call.extra = extra
