"""What torch tells about a DCP call besides its start and end.

A mixin of :class:`~dcp_otel.tracing.tracker.SpanRecorder`: per-key times of
``_stateful_to_state_dict`` (summarized on it, no span), the storage DCP chose,
the exception of a step torch does not log (``_DistWrapper`` caught it), and the
objects DCP gathers (write results, summed as they pass; read plans, whose bytes
the builder counts).

Usage (what the patches and the logger tap do)::

    recorder.on_key_event("end", uuid, "_stateful_to_state_dict.model", time_ns)
    recorder.on_gathered(write_results, group)
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from opentelemetry import context as context_api
from torch.distributed.checkpoint.planner import LoadPlan

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.attach.unlogged_calls import CheckpointFile, ConsolidatedOutput
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.tracing.measure import WrittenBytes, written_bytes
from dcp_otel.tracing.operations import OPERATION_KEY
from dcp_otel.tracing.records import Call, KeyCall, Operation, failure_of, key_of
from dcp_otel.tracing.staged import staged

#: What carries byte counts: local read plans, a consolidation's output folder, a checkpointer's file (write results,
#: a list, are summed as they pass).
_GATHERED_TYPES = (LoadPlan, ConsolidatedOutput, CheckpointFile)


class CallFacts:
    """The recorder's ``on_*`` for what torch tells besides starts and ends; never raises."""

    if TYPE_CHECKING:  # what the recorder (SpanRecorder, in dcp_otel.tracing.tracker) holds
        _local: threading.local
        _open: dict[str, Call]

        def _stack(self) -> list[Call]: ...

        def _close(self, call: Call, end_ns: int, parent: Call | None, again: bool = False) -> None: ...

        def _close_above(self, stack: list[Call], index: int, time_ns: int, cause: str) -> None: ...

    def on_key_event(self, kind: str, uuid: str, func_name: str, time_ns: int) -> None:
        """A ``_stateful_to_state_dict.<key>`` record on the general path: no span, just a summary.

        torch's own per-key records are recorded by the hot path (``SpanRecorder.on_record``), which does
        the same in its own frame: keep the two in step. What reaches here is the rest: a key's exception,
        an orphan or unmatched record (reported), a record of another type than ``dict``.
        """
        stack = self._stack()
        if kind == "start":
            if not stack or stack[-1].keys is None:
                report("orphan_key_event", "dropped a per-key DCP event with no enclosing state-dict conversion")
                return
            stack.append(KeyCall(uuid, func_name, time_ns))
            return
        index = len(stack) - 1
        while index >= 0 and stack[index].uuid != uuid:
            index -= 1
        if index < 0:
            report("unmatched_event", "dropped a DCP %s event with no matching start", kind)
            return
        if index < len(stack) - 1:  # a call inside the key's conversion raised without its end (a state-dict call
            self._close_above(stack, index, time_ns, f"the conversion of {key_of(func_name)!r} ended")  # cut short)
        call = stack.pop()
        parent_keys = stack[-1].keys if stack else None
        if parent_keys is None:
            return
        if kind == "end":
            parent_keys.add(func_name, max(0, time_ns - call.start_ns))
        else:
            parent_keys.failed_key = key_of(func_name)

    def on_call_facts(self, attributes: dict[str, Any]) -> None:
        """What the innermost open call on this thread learnt while it ran (a library's own latencies, the
        items it wrote): on its span. ``attributes`` is the caller's own new dict; nothing open: dropped."""
        try:
            stack = self._local.stack
        except AttributeError:
            return
        if stack:
            call = stack[-1]
            if call.span_id:  # (not a per-key call)
                extra = call.extra
                call.extra = attributes if extra is None else {**extra, **attributes}

    def innermost_call(self) -> Call | None:
        """The innermost open call on this thread (not a per-key one), for a wrapper inside it to tell it what its
        pool's threads do (``helpers``: their stacks join its stall reports) and what it did (``summary``)."""
        try:
            stack = self._local.stack
        except AttributeError:
            return None
        return stack[-1] if stack and stack[-1].span_id else None

    def on_staging(self, stager: object, state_dict: object) -> None:
        """An async save's stager is given ``state_dict`` to copy (on the caller's thread, before the copy)."""
        try:
            op = context_api.get_value(OPERATION_KEY)
            if isinstance(op, Operation) and op.staging is None:
                op.staging = staged(stager, state_dict)
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to read what an async save stages", exc_info=True)

    def on_storage_resolved(self, storage: object, reader: bool) -> None:
        """DCP chose the storage for the current operation (``_storage_setup``).

        Given only a ``checkpoint_id``, DCP infers the storage class and never
        logs it; it does so before any step starts, so from here on the class
        name is on the operation's span, its root, and every later step span.
        """
        try:
            op = context_api.get_value(OPERATION_KEY)
            if storage is None or not isinstance(op, Operation):
                return
            op.storage = storage
            key = semconv.ATTR_STORAGE_READER if reader else semconv.ATTR_STORAGE_WRITER
            name = type(storage).__name__
            if op.attributes.get(key) == name:
                return
            # New dicts rather than in-place updates: calls started before keep theirs,
            # except the call that resolved the storage (save, load, an async save's background save).
            op.attributes = {**op.attributes, key: name}
            op.step_attributes = {**op.step_attributes, key: name}
            stack = self._stack()
            if stack and stack[-1].op is op:
                stack[-1].attributes = {**stack[-1].attributes, key: name}
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to record the storage class", exc_info=True)

    def on_wrapped_exception(self, exc: BaseException) -> None:
        """``_DistWrapper`` caught ``exc`` from a step that torch does not log.

        Called on the failing step's own thread, right after it raised: the
        innermost open call is that step, so it ends here with the exact time
        and the exception, and its context is detached so the collective that
        follows runs under the parent again.
        """
        top: Call | None = None
        try:
            try:
                stack = self._stack()
                if not stack:
                    return
                top = stack[-1]
                if not top.span_id or top.func_name not in semconv.COLLECTIVE_STEPS:
                    return
                top.failure = failure_of(top, exc, None)
                stack.pop()
                self._close(top, time.time_ns(), stack[-1] if stack else None)
            except BaseException:  # cut short off the stack and not ended (dcp_otel.tracing.cut_short): ended now
                if top is not None and top.uuid in self._open and top not in self._stack():
                    self._close(top, time.time_ns(), None, again=True)
                raise
        except Exception as caught:  # noqa: BLE001
            reraise_if_signalled(caught)
            report("recorder_error", "dcp_otel failed to record a DCP step failure", exc_info=True)

    def on_gathered(self, obj: object, group: object | None = None) -> None:
        """``_DistWrapper.gather_object`` is sending this rank's result to the coordinator (within ``group``).

        That is where DCP's own write results (after ``write_data``) and local
        read plans (before ``read_data``) pass. Write results are summed here,
        while torch's freshly made objects are in cache (10,000 in about 0.3-0.6 ms),
        and only the total is kept: holding them for the builder made it sum and
        free them cold, 20-25 ms of the interpreter lock a checkpoint later. Read
        plans are kept for the builder, which needs the reader's metadata.
        The process group is kept too (before any failure torch reports: a
        failed step's exception is gathered as well), to name failed ranks by
        their global rank.
        """
        try:
            stack = self._stack()
            if stack and stack[-1].op is not None:
                call = stack[-1]
                op = call.op
                assert op is not None
                if group is not None and op.group is None:
                    op.group = group
                if type(obj) is list:
                    written = written_bytes(obj)
                    if written is not None:
                        op.gathered.append((call, WrittenBytes(written)))
                elif type(obj) in _GATHERED_TYPES:
                    op.gathered.append((call, obj))
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("metrics_error", "dcp_otel failed to count checkpoint bytes", exc_info=True)
