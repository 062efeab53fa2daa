"""The hot path: pair DCP's start/end events into calls, keep their nesting, note failures.

Everything here runs on the thread that called DCP, so it only records: on a
call's start, a span id chosen now, a light span carrying it made current (a
storage plugin's spans nest under that id) and one small
:class:`~dcp_otel.tracing.records.Call`; on its end, detach, and the call joins
its operation. No SDK span, no attribute dict, no histogram observation: a
complete operation goes to :class:`~dcp_otel.tracing.builder.SpanBuilder`.

Calls pair by DCP's ``uuid`` on a per-thread stack (DCP calls nest strictly
within a thread). A top-level operation starts this rank's part of a trace
shared by all ranks (:mod:`~dcp_otel.tracing.operations`). A step whose
exception torch does not log fails as soon as that is visible
(:meth:`SpanRecorder.on_wrapped_exception`), at the latest when its parent
ends. The per-key calls of ``_stateful_to_state_dict`` are summarized on it.

Usage (what :class:`dcp_otel.DCPInstrumentor` does)::

    recorder = SpanRecorder(InstrumentOptions())
    if not recorder.on_record(msg):               # the two records of every step, in one frame
        recorder.on_event(parse_event(msg), exc=sys.exc_info()[1])   # everything else
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan

from dcp_otel import _forksafe, semconv
from dcp_otel._selftelemetry import report
from dcp_otel.config import InstrumentOptions
from dcp_otel.events import ENTRY_POINTS, MAX_FUNC_NAME, DCPEvent
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.metrics.prometheus import MetricsSink
from dcp_otel.spool.layout import ENTRY, ENTRY_SHIFT, I64, KIND_CODES, OFF_ENTRY_END, RING_MASK
from dcp_otel.spool.record import ProcessRecord
from dcp_otel.tracing.builder import SpanBuilder
from dcp_otel.tracing.call_ends import CallEnds, _detach_quietly
from dcp_otel.tracing.collectives import CollectiveCalls
from dcp_otel.tracing.cut_short import CutShort, passes_records_along, watched_frame
from dcp_otel.tracing.detail import DetailPolicy
from dcp_otel.tracing.drain import ProviderHooks
from dcp_otel.tracing.facts import CallFacts
from dcp_otel.tracing.key_lane import KeyLanes
from dcp_otel.tracing.light import SPAN_KEY, with_span
from dcp_otel.tracing.light import attach as light_attach
from dcp_otel.tracing.light import detach as light_detach
from dcp_otel.tracing.light import get_current as light_get_current
from dcp_otel.tracing.light import span_context as light_span_context
from dcp_otel.tracing.open_calls import OpenCalls
from dcp_otel.tracing.operations import OPERATION_KEY, OperationStarter, has_class_fields
from dcp_otel.tracing.records import (
    KIND_OPERATION,
    KIND_STEP,
    Call,
    KeyCall,
    KeyStats,
    Operation,
    ThreadStack,
    new_span_id,
)
from dcp_otel.tracing.trace_ids import SequenceTables
from dcp_otel.tracing.uploads import InFlight

_KEY_PREFIX = semconv.STATEFUL_KEY_PREFIX
_STATEFUL_PARENT = _KEY_PREFIX[:-1]  # "_stateful_to_state_dict"
_getrandbits = random.getrandbits
_ENTRY_POINTS = ENTRY_POINTS
#: Registered thread stacks past which those of ended threads are dropped.
_PRUNE_STACKS_AT = 64
_pack_entry = ENTRY.pack_into
_pack_end = I64.pack_into
_STEP_CODE = KIND_CODES[KIND_STEP]
_OPERATION_CODE = KIND_CODES[KIND_OPERATION]


class SpanRecorder(OpenCalls, CallFacts, CollectiveCalls, CallEnds, CutShort, KeyLanes):
    """Records DCP calls for the builder; thread-safe; never raises from its ``on_*``."""

    def __init__(self, options: InstrumentOptions, metrics: MetricsSink | None = None) -> None:
        self.options = options
        self.metrics = metrics
        self.builder = SpanBuilder(DetailPolicy(options.detail, options.span_budget), metrics,
                                   options.max_queued_operations)  # fmt: skip
        #: Begins operations; carries them to the async save process (export / adopt).
        self.starter = OperationStarter(options, self)
        self._local = threading.local()
        # uuid -> open call. Only single dict operations touch it, which are
        # atomic under the GIL: no lock on the per-step path.
        self._open: dict[str, Call] = {}
        # thread id -> that thread's stack of open calls, registered once per thread (not per call),
        # so the watchdog can tell which thread is inside a call and read its Python stack.
        self._stacks: dict[int, list[Call]] = {}
        # uuids of calls ended because the process was ending: their own end, if it ever comes, is dropped.
        self._interrupted: dict[str, None] = {}
        self._stale_tokens: dict[int, object] = {}  # thread id -> the context token its interrupted calls left
        self._interrupt_lock = threading.RLock()  # the ending thread and atexit may both end the open calls
        self._max_open = options.max_open_spans
        self._seq = SequenceTables()
        self.uploads = InFlight()
        self.builder.checkpointing = self.checkpointing  # (it builds between checkpoints, not during one)
        self.builder.open_since = self.open_since  # (steps after an open checkpoint's start wait for its build)
        #: Called on the caller's thread when a checkpoint operation's call ends (once a checkpoint): what waits
        #: while a thread is inside one (:meth:`checkpointing`) looks again, instead of looking every few ms.
        self.call_ended: list[Callable[[], None]] = [self.builder.nudge]
        self._hooks = ProviderHooks(self.builder, float(options.flush_timeout_s or 10))
        #: Where open calls are written ahead, for a survivor should this process die (None: nowhere).
        self.record: ProcessRecord | None = None
        #: Called when an operation starts (or is continued here): starts the stall watchdog.
        self.watch: Callable[[], None] | None = None
        #: Reads the starting call's own arguments (``no_dist``, ``process_group``), where this torch allows.
        self.call_arguments: Callable[[], Mapping[str, Any] | None] | None = None
        self.closed = False
        _forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        """The child forgets the parent's calls in flight (they are the parent's to end)."""
        self._local = threading.local()
        self._open = {}
        self._stacks = {}
        self.drop_lane()  # (the parent's: its thread's ident may be this thread's)
        self._interrupted = {}
        self._stale_tokens = {}
        self._interrupt_lock = threading.RLock()  # the ending thread and atexit may both end the open calls
        self._seq.reset_lock()
        self.uploads = InFlight()

    # --- bookkeeping ----------------------------------------------------
    def open_count(self) -> int:
        """DCP spans open right now in this process (0 between operations)."""
        return len(self._open)

    def stack_depth(self) -> int:
        """DCP calls in flight on the calling thread, per-key calls included."""
        return len(self._stack())

    def wait_for_uploads(self, timeout: float | None = None) -> bool:
        """Block until every async upload has ended and been built; ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.uploads.wait(timeout):
            return False
        remaining = 3600.0 if deadline is None else max(0.0, deadline - time.monotonic())
        return self.builder.drain(remaining)

    def drain(self, timeout_s: float, metrics_only: bool = False) -> bool:
        """Wait until every finished operation is built (or only measured); ``False`` past ``timeout_s``."""
        return self.builder.drain(timeout_s, metrics_only)

    def close(self) -> None:
        """Stop building (on uninstrument); what is queued is still built."""
        self.closed = True  # torch's records no longer reach us: a call open now never sees its end
        self.drop_lane()  # (nor its keys: the tap, inert, reads no lane)
        self.starter.close()
        self.builder.close()
        self._hooks.remove_all()

    def hook_provider(self, provider: object) -> None:
        """Make ``provider``'s own flush and shutdown build what is queued first (once per provider)."""
        self._hooks.add(provider)

    def provider(self) -> trace.TracerProvider:
        """The tracer provider spans go to: the configured one, else the global one."""
        return self.options.tracer_provider or trace.get_tracer_provider()

    def _stack(self) -> list[Call]:
        stack: list[Call] | None = getattr(self._local, "stack", None)
        if stack is None:
            record = self.record
            stack = self._local.stack = ThreadStack(record.thread_base() if record is not None else -1)
            ident = threading.get_ident()
            self._stacks[ident] = stack
            if len(self._stacks) > _PRUNE_STACKS_AT:  # threads come and go (one executor per async save)
                self._prune_stacks()
        return stack

    def _prune_stacks(self) -> None:
        alive = {thread.ident for thread in threading.enumerate()}
        for ident, stack in list(self._stacks.items()):
            if ident not in alive and not stack:
                self._stacks.pop(ident, None)

    # --- events ---------------------------------------------------------
    def on_event(self, event: DCPEvent, exc: BaseException | None = None) -> None:
        """Handle one parsed DCP event; ``exc`` is the exception being logged, if any."""
        try:
            if event.func_name.startswith(semconv.STATEFUL_KEY_PREFIX):
                self.on_key_event(event.kind, event.uuid, event.func_name, event.time_ns)
            elif event.kind == "start":
                self._start(event)
            else:
                self._finish(event.uuid, event.kind, event.time_ns, event.error, exc)
        except Exception as caught:  # noqa: BLE001 - telemetry never raises into training
            reraise_if_signalled(caught)
            report("recorder_error", "dcp_otel failed to record a DCP event", exc_info=True)

    def on_record(self, msg: Any) -> bool:
        """The hot path: one record of DCP's logger, a step's start inside an operation or an end.

        One frame for the two records every DCP step logs (what would read more
        naturally as three small methods costs a third more here), and for the
        two of every key of a state dict (``_stateful_to_state_dict.<key>``) that
        the tap's per-key lane does not take (:mod:`~dcp_otel.tracing.key_lane`:
        a conversion on a second thread, or nested in a key; :meth:`on_key_event`
        on the general path does the same for what it gets); a new operation's start goes from
        here straight to :meth:`_start`. Returns ``False``, having done nothing,
        for anything else (a call that names its own storage or planner like a
        nested save, an exception, anything malformed, a per-key call outside a
        conversion): the tap's general path takes those.
        """
        try:
            if type(msg) is not dict:
                return False
            try:  # torch's records always have these; anything else goes the general way
                kind, uuid, time_ns = msg["event"], msg["uuid"], msg["time"]
            except KeyError:
                return False
            if type(time_ns) is not int or time_ns <= 0:
                return False
            try:
                stack = self._local.stack
            except AttributeError:
                stack = self._stack()
            if kind == "end":
                # Matching the innermost open call is the validation that matters for an end.
                if not stack:
                    return False
                call = stack[-1]
                if call.uuid != uuid:
                    return False
                stack.pop()  # the innermost call returned
                if not call.span_id:  # a per-key call (no span): its time joins its conversion's summary
                    keys = stack[-1].keys if stack else None
                    if keys is not None:
                        took = time_ns - call.start_ns
                        keys.add(call.func_name, took if took > 0 else 0)
                    return True
                op = call.op
                if op is None or op.submitted or call.owns_part:  # not a plain step
                    self._close(call, time_ns, stack[-1] if stack else None)
                    return True
                call.end_ns = time_ns
                if call.keys is not None:  # a conversion: its per-key lane is free
                    self.release_lane(call)
                if call.rec >= 0:
                    _pack_end(self.record.mm, call.rec + OFF_ENTRY_END, time_ns)  # type: ignore[union-attr]
                token = call.token
                call.token = None
                try:
                    light_detach(token)
                except Exception as exc:  # noqa: BLE001 - as context_api.detach: a token of another context
                    reraise_if_signalled(exc)
                    report("recorder_error", "dcp_otel failed to detach a DCP call's context", exc_info=True)
                if stack:
                    stack[-1].children_ns += time_ns - call.start_ns
                # Open until here (cut_short finishes what a signal handler's exception cut off before): out
                # of the open calls and into its operation's in one step, no call between.
                del self._open[uuid]
                op.calls.append(call)
                return True
            if kind != "start":
                return False
            # First what the record says, then the context.
            func_name = msg.get("func_name")
            if type(uuid) is not str or not uuid or type(func_name) is not str:
                return False
            if func_name.startswith(_KEY_PREFIX):  # a state dict's per-key call (2 records a key): no span, no context
                if not stack or stack[-1].keys is None:
                    return False  # (the general path reports it)
                stack.append(KeyCall(uuid, func_name, time_ns))
                return True
            ctx = light_get_current()
            op = ctx.get(OPERATION_KEY)  # a Context is a dict: get_value without the call
            if op is None and len(func_name) <= MAX_FUNC_NAME:
                # A new operation, what every save, load and async save starts with: straight to its start,
                # as the general path would take it (torch mutates the record before its end: a copy).
                self._start(DCPEvent(kind, uuid, func_name, time_ns, None, dict(msg)), ctx)
                return True
            if type(op) is not Operation or "storage_writer" in msg or "storage_reader" in msg or "planner" in msg \
                    or op.interrupted is not None or func_name in _ENTRY_POINTS:  # fmt: skip
                return False
            open_calls = self._open
            if len(open_calls) >= self._max_open or uuid in open_calls:
                self._over_limit(uuid)
                return True
            # The parent is the span current now, read straight from the context; the builder takes its ids.
            span_id = _getrandbits(64) or 1
            call = Call(uuid, func_name, time_ns, span_id, ctx.get(SPAN_KEY), op, op.step_attributes)  # type: ignore[arg-type]
            if func_name == _STATEFUL_PARENT:
                call.keys = KeyStats(self.options.slowest_keys)
                self.open_lane(call)
            light = NonRecordingSpan(light_span_context(op.trace_id, span_id, op.flags))
            if not stack and op.adopted:
                call.owns_part = True
                op.add_part()
            stack.append(call)
            open_calls[uuid] = call
            base = stack.base
            if base >= 0:  # written ahead: what a survivor says should the process die now (serial 0: not recorded)
                call.rec = rec = base + ((stack.calls & RING_MASK) << ENTRY_SHIFT)
                stack.calls += 1
                _pack_entry(self.record.mm, rec, span_id, time_ns, 0, op.rec_serial, _STEP_CODE, func_name.encode())  # type: ignore[union-attr]
            # Its context last: a start cut short before this (cut_short) leaves the context as it found it.
            call.token = light_attach(with_span(ctx, light))
        except Exception as exc:  # noqa: BLE001 - telemetry never raises into training
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to record a DCP event", exc_info=True)
        return True

    # --- the stack --------------------------------------------------------
    def _over_limit(self, uuid: str) -> bool:
        """Whether call ``uuid`` must be dropped (counted): too many open, or a duplicate."""
        if len(self._open) < self._max_open and uuid not in self._open:
            return False
        report("span_limit", "dropped a DCP span: %d spans already open, or a duplicate uuid", len(self._open))
        return True

    def _push(
        self, uuid: str, func_name: str, time_ns: int, op: Operation, attributes: dict[str, Any],
        ctx: context_api.Context, begins: bool = False, span_id: int = 0, prior: context_api.Context | None = None,
    ) -> Call:  # fmt: skip
        """Make a light span current while call ``uuid`` runs, and remember the call until it ends.

        ``begins``: the call begins ``op``, made current with it. ``prior``: the context the call's start
        found (default ``ctx``), what a start cut short puts back. The general path (operations, nested
        saves); :meth:`on_record` does the same for a plain step in one frame: keep the two in step.
        """
        span_id = span_id or new_span_id()
        call = Call(uuid, func_name, time_ns, span_id, ctx.get(SPAN_KEY), op, attributes)  # type: ignore[arg-type]
        call.prior = ctx if prior is None else prior
        if func_name == _STATEFUL_PARENT:
            call.keys = KeyStats(self.options.slowest_keys)
            self.open_lane(call)
        light = NonRecordingSpan(light_span_context(op.trace_id, span_id, op.flags))
        stack = self._stack()
        if not stack and op.adopted:  # a top-level call of an operation continued in this process
            call.owns_part = True
            op.add_part()
        stack.append(call)
        self._open[uuid] = call
        base = stack.base  # type: ignore[attr-defined]
        if base >= 0:  # written ahead (as on_record does for a plain step: keep the two in step)
            call.rec = rec = base + ((stack.calls & RING_MASK) << ENTRY_SHIFT)  # type: ignore[attr-defined]
            stack.calls += 1  # type: ignore[attr-defined]
            _pack_entry(self.record.mm, rec, span_id, time_ns, 0, op.rec_serial, _OPERATION_CODE if begins else _STEP_CODE,  # type: ignore[union-attr]
                        func_name.encode())  # fmt: skip
        # Its context last (see on_record). One new Context: set_value(OPERATION_KEY, ...) then
        # set_span_in_context, without the copy between.
        call.token = light_attach(Context({**ctx, OPERATION_KEY: op, SPAN_KEY: light}) if begins else
                                  with_span(ctx, light))  # fmt: skip
        return call

    def _start(self, event: DCPEvent, ctx: context_api.Context | None = None) -> None:
        """A call starts: a step of the operation current in ``ctx`` (default: the current context), or one."""
        if self._over_limit(event.uuid):
            return
        if ctx is None:
            ctx = light_get_current()
        enclosing = ctx.get(OPERATION_KEY)
        # An application's own call inside an operation: it nests, or finds that operation's call left behind.
        if enclosing is not None and event.func_name in _ENTRY_POINTS and self.left_behind(self._stack(), enclosing):
            ctx = light_get_current()  # the context that call found
            enclosing = ctx.get(OPERATION_KEY)
        if type(enclosing) is Operation and enclosing.interrupted is not None:
            # This thread was inside an operation the process ended (SIGINT, caught): its context
            # goes back to what it was before that operation, and this call starts afresh.
            token = self._stale_tokens.pop(threading.get_ident(), None)
            if token is not None:
                _detach_quietly(token)
                ctx = context_api.get_current()
            enclosing = ctx.get(OPERATION_KEY)
            if type(enclosing) is Operation and enclosing.interrupted is not None:
                ctx = context_api.set_value(OPERATION_KEY, None, ctx)
                enclosing = None
        if type(enclosing) is Operation:
            attributes = enclosing.step_attributes
            if has_class_fields(event.details):  # steps never have them; a nested save does
                attributes = {**attributes, **self.starter.class_attributes(event)}
            self._push(event.uuid, event.func_name, event.time_ns, enclosing, attributes, ctx)
            return
        op, parent_ctx = self.starter.begin(event, ctx, self._seq)
        # The operation travels with the context, into the async save thread too.
        call = self._push(event.uuid, event.func_name, event.time_ns, op, op.attributes, parent_ctx,
                          True, op.span_id, ctx)  # fmt: skip
        call.kind = KIND_OPERATION
        call.watched = watched_frame()  # (the frame that runs it: see CutShort.left_behind)
        op.add_part()
        call.owns_part = True


passes_records_along(SpanRecorder.on_record, SpanRecorder.on_event)
