"""Build OpenTelemetry spans from DCP events: pairing, nesting, failures.

One :class:`SpanRecorder` per instrumentation turns the start/end/exception
events of torch's ``_dcp_method_logger`` into spans:

* start and end are paired by DCP's per-call ``uuid`` on a per-thread stack
  (DCP calls nest strictly within a thread), and each span is attached to the
  OpenTelemetry context while its call runs, so whatever the call does (a
  storage plugin's HTTP requests, say) nests under it;
* a top-level operation (``save``, ``async_save``, ``load``) with no enclosing
  DCP span starts a trace shared by all ranks (see :mod:`dcp_otel.trace_ids`);
* a step whose exception torch does not log is closed with ERROR as soon as the
  failure is visible: when ``_DistWrapper`` wraps the exception
  (:meth:`SpanRecorder.on_wrapped_exception`), or at the latest when its parent
  ends; no span is left open and no bookkeeping outlives its operation;
* the per-key calls of ``_stateful_to_state_dict`` are summarized on their
  parent instead of becoming one span per key.

Usage (what :class:`dcp_otel.DCPInstrumentor` does)::

    recorder = SpanRecorder(InstrumentOptions())
    recorder.on_event(parse_event(record.msg), exc=sys.exc_info()[1])
"""

from __future__ import annotations

import heapq
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextvars import Token
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, Status, StatusCode
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.storage import WriteResult

from dcp_otel import _forksafe, semconv
from dcp_otel._selftelemetry import report
from dcp_otel.config import InstrumentOptions
from dcp_otel.events import DCPEvent, operation_fields
from dcp_otel.metrics import Exemplar, MetricsSink, exemplar_for, exemplar_for_context
from dcp_otel.redact import redact_checkpoint_id
from dcp_otel.trace_ids import (
    CheckpointKey,
    SequenceCounter,
    _OverridableIds,
    chosen_ids_tracer,
    derive_ids,
    remote_root_context,
    resolve_run_id,
    start_root_span,
)
from dcp_otel.version import __version__

#: Context key holding the :class:`_Operation` a DCP span belongs to; it travels
#: with the context, into the async save thread too.
_OPERATION_KEY = context_api.create_key("dcp_otel.operation")
_STATEFUL_PARENT = semconv.STATEFUL_KEY_PREFIX[:-1]  # "_stateful_to_state_dict"
_SPAN_PREFIX = semconv.SPAN_PREFIX
_STAGE_STEP = "stage_state_dict"  # async_save's staging, when the stager is synchronous
#: Attributes that say something about the operation as a whole, kept off step spans.
_OPERATION_ONLY = frozenset(
    {semconv.ATTR_OPERATION_SEQ, semconv.ATTR_RUN_ID, semconv.ATTR_COORDINATOR, semconv.ATTR_GROUP_RANK}
)
_MAX_STATUS_TEXT = 256
_MAX_KEY_TEXT = 128


class _Operation:
    """One checkpoint operation on this rank: the unit that owns a trace.

    ``pending`` counts the spans of this operation that outlive their call
    stack (the operation span itself and an async upload); when it drops to
    zero the coordinator's root span ends, so for an async save the root covers
    the upload too, and the operation's metrics are recorded: an async save
    counts as a success, with its duration up to the end of the upload, only
    once its checkpoint is durable.
    """

    __slots__ = (
        "name", "rank", "tracer", "attributes", "step_attributes", "root", "pending", "failed", "end_ns", "lock",
        "storage", "exemplar", "start_ns", "wait_s",
    )  # fmt: skip

    def __init__(self, name: str, rank: int, tracer: trace.Tracer, attributes: dict[str, Any]) -> None:
        self.name = name
        self.rank = str(rank)  # the metrics' rank label
        self.storage: object | None = None  # what _storage_setup chose, for read plans' byte counts
        # The same for every observation of this operation on this rank (one trace, one rank).
        self.exemplar: Exemplar | None = None
        self.tracer = tracer
        #: On the root and on each rank's operation span: everything we know.
        self.attributes = attributes
        #: On every other span: what identifies it (rank, checkpoint, classes);
        #: each attribute costs every span about 0.6 us in the SDK.
        self.step_attributes = {k: v for k, v in attributes.items() if k not in _OPERATION_ONLY}
        self.root: Span | None = None
        self.pending = 0
        self.failed: str | None = None
        self.end_ns = 0
        self.start_ns = 0  # of this rank's operation span
        self.wait_s = 0.0  # of the operation span: not covered by its steps
        self.lock = threading.Lock()

    def add_part(self) -> None:
        with self.lock:
            self.pending += 1

    def part_done(self, end_ns: int, error: str | None) -> bool:
        """One part ended; True when it was the last (the operation is complete)."""
        with self.lock:
            self.pending -= 1
            self.end_ns = max(self.end_ns, end_ns)
            if error and not self.failed:
                self.failed = error
            if self.pending > 0:
                return False
            if self.root is None:
                return True
            root, self.root = self.root, None
        if self.failed:
            root.set_status(Status(StatusCode.ERROR, self.failed))
        root.end(end_time=self.end_ns)
        return True


@dataclass
class _KeyStats:
    """Summary of the per-key ``_stateful_to_state_dict.<key>`` calls."""

    limit: int
    count: int = 0
    total_ns: int = 0
    slowest: list[tuple[int, int, str]] = field(default_factory=list)  # min-heap
    failed_key: str | None = None

    def add(self, key: str, duration_ns: int) -> None:
        self.count += 1
        self.total_ns += duration_ns
        if self.limit:
            item = (duration_ns, self.count, key)
            if len(self.slowest) < self.limit:
                heapq.heappush(self.slowest, item)
            elif item > self.slowest[0]:
                heapq.heapreplace(self.slowest, item)

    def to_attributes(self) -> dict[str, Any]:
        ordered = sorted(self.slowest, reverse=True)
        attrs: dict[str, Any] = {
            semconv.ATTR_STATE_DICT_KEYS: self.count,
            semconv.ATTR_STATE_DICT_KEYS_SECONDS: self.total_ns / 1e9,
            semconv.ATTR_STATE_DICT_SLOWEST_KEYS: [key for _, _, key in ordered],
            semconv.ATTR_STATE_DICT_SLOWEST_SECONDS: [d / 1e9 for d, _, _ in ordered],
        }
        if self.failed_key is not None:
            attrs[semconv.ATTR_STATE_DICT_FAILED_KEY] = self.failed_key
        return attrs


class _Entry:
    """One DCP call in flight on one thread."""

    __slots__ = ("uuid", "func_name", "start_ns", "span", "token", "op", "owns_op_part", "keys", "children_ns")

    def __init__(
        self,
        uuid: str,
        func_name: str,
        start_ns: int,
        span: Span | None = None,
        op: _Operation | None = None,
        keys: _KeyStats | None = None,
        owns_op_part: bool = False,
    ) -> None:
        self.uuid = uuid
        self.func_name = func_name
        self.start_ns = start_ns
        self.span = span  # None: a per-key call, summarized on its parent
        self.token: Token[context_api.Context] | None = None
        self.op = op
        self.owns_op_part = owns_op_part
        self.keys = keys
        self.children_ns = 0  # time in its own child calls; the rest of an operation is collective wait


class SpanRecorder:
    """Turns DCP events into spans; thread-safe; never raises from its ``on_*``."""

    def __init__(self, options: InstrumentOptions, metrics: MetricsSink | None = None) -> None:
        self._options = options
        self._metrics = metrics
        self._local = threading.local()
        # uuid -> open span entry. Only single dict operations touch it, which
        # are atomic under the GIL: no lock on the per-step path.
        self._open: dict[str, _Entry] = {}
        self._seq = SequenceCounter()
        # (provider, its tracer, the twin that starts root spans with chosen ids)
        self._tracer_cache: tuple[object, trace.Tracer, tuple[trace.Tracer, _OverridableIds] | None] | None = None
        # Async uploads whose span is still open. Their future's done-callback
        # ends the span *after* waiters on the future wake up, so anyone who
        # needs the telemetry complete waits on this, not on the future.
        self._uploads = threading.Condition()
        self._uploads_in_flight = 0
        _forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        """The child forgets the parent's spans in flight (they are the parent's to end)."""
        self._local = threading.local()
        self._open = {}
        self._seq.reset_lock()
        self._uploads = threading.Condition()
        self._uploads_in_flight = 0

    # --- bookkeeping ----------------------------------------------------
    def open_count(self) -> int:
        """DCP spans open right now in this process (0 between operations)."""
        return len(self._open)

    def stack_depth(self) -> int:
        """DCP calls in flight on the calling thread, per-key calls included."""
        return len(self._stack())

    def wait_for_uploads(self, timeout: float | None = None) -> bool:
        """Block until every async upload span has ended; ``False`` on timeout."""
        with self._uploads:
            return self._uploads.wait_for(lambda: self._uploads_in_flight == 0, timeout)

    def close(self) -> None:
        """Forget the tracers (on uninstrument); the provider's own were never changed."""
        self._tracer_cache = None

    def _stack(self) -> list[_Entry]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def provider(self) -> trace.TracerProvider:
        """The tracer provider spans go to: the configured one, else the global one."""
        return self._options.tracer_provider or trace.get_tracer_provider()

    def _tracer(self) -> tuple[trace.Tracer, tuple[trace.Tracer, _OverridableIds] | None]:
        """Our tracer, and its twin for root spans (``None``: this provider cannot choose ids)."""
        provider = self.provider()
        cache = self._tracer_cache
        if cache is None or cache[0] is not provider:
            tracer = provider.get_tracer(semconv.SCOPE_NAME, __version__)
            cache = (provider, tracer, chosen_ids_tracer(tracer))
            self._tracer_cache = cache
        return cache[1], cache[2]

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
        except Exception:  # noqa: BLE001 - telemetry never raises into training
            report("recorder_error", "dcp_otel failed to record a DCP event", exc_info=True)

    def on_step_start(self, uuid: str, func_name: str, time_ns: int, details: Any) -> bool:
        """The hot path for a step's start: a DCP call inside a running operation.

        Returns ``False``, having done nothing, for anything else (a new
        operation, or a call that names its own storage or planner, like a
        nested save): :meth:`on_event` handles those.
        """
        try:
            ctx = context_api.get_current()
            op = ctx.get(_OPERATION_KEY)  # a Context is a dict: get_value without the call
            if type(op) is not _Operation or _has_class_fields(details):
                return False
            if not self._over_limit(uuid):
                span = op.tracer.start_span(
                    _SPAN_PREFIX + func_name, context=ctx, attributes=op.step_attributes, start_time=time_ns
                )
                self._push(uuid, func_name, time_ns, span, op, ctx, new_operation=False)
        except Exception:  # noqa: BLE001 - telemetry never raises into training
            report("recorder_error", "dcp_otel failed to record a DCP event", exc_info=True)
        return True

    def on_end(self, uuid: str, time_ns: int) -> None:
        """The hot path for a successful end: no event object needed."""
        try:
            self._finish(uuid, "end", time_ns, None, None)
        except Exception:  # noqa: BLE001 - telemetry never raises into training
            report("recorder_error", "dcp_otel failed to record a DCP event", exc_info=True)

    def on_key_event(self, kind: str, uuid: str, func_name: str, time_ns: int) -> None:
        """The hot path for ``_stateful_to_state_dict.<key>``: no span, just a summary."""
        stack = self._stack()
        if kind == "start":
            if not stack or stack[-1].keys is None:
                report("orphan_key_event", "dropped a per-key DCP event with no enclosing state-dict conversion")
                return
            stack.append(_Entry(uuid, func_name, time_ns))
            return
        if not stack or stack[-1].uuid != uuid:
            report("unmatched_event", "dropped a DCP %s event with no matching start", kind)
            return
        entry = stack.pop()
        parent_keys = stack[-1].keys if stack else None
        if parent_keys is None:
            return
        key = func_name[len(semconv.STATEFUL_KEY_PREFIX) :][:_MAX_KEY_TEXT]
        if kind == "end":
            parent_keys.add(key, max(0, time_ns - entry.start_ns))
        else:
            parent_keys.failed_key = key

    def on_storage_resolved(self, storage: object, reader: bool) -> None:
        """DCP chose the storage for the current operation (``_storage_setup``).

        Given only a ``checkpoint_id``, DCP infers the storage class and never
        logs it; it does so before any step starts, so from here on the class
        name is on the operation's span, its root, and every later step span.
        """
        try:
            op = context_api.get_value(_OPERATION_KEY)
            if storage is None or not isinstance(op, _Operation):
                return
            op.storage = storage
            key = semconv.ATTR_STORAGE_READER if reader else semconv.ATTR_STORAGE_WRITER
            name = type(storage).__name__
            if op.attributes.get(key) == name:
                return
            # New dicts rather than in-place updates: another thread may be
            # starting a span from the old ones right now.
            op.attributes = {**op.attributes, key: name}
            op.step_attributes = {**op.step_attributes, key: name}
            current = trace.get_current_span()  # the operation's span: it called _storage_setup
            if current.is_recording():
                current.set_attribute(key, name)
            root = op.root
            if root is not None and root.is_recording():
                root.set_attribute(key, name)
        except Exception:  # noqa: BLE001
            report("recorder_error", "dcp_otel failed to record the storage class", exc_info=True)

    def on_wrapped_exception(self, exc: BaseException) -> None:
        """``_DistWrapper`` caught ``exc`` from a step that torch does not log.

        Called on the failing step's own thread, right after it raised: the
        innermost open span is that step, so it ends here with the exact time
        and the exception object, and its context is detached so the collective
        that follows runs under the parent again.
        """
        try:
            stack = self._stack()
            if not stack:
                return
            top = stack[-1]
            if top.span is None or top.func_name not in semconv.COLLECTIVE_STEPS:
                return
            stack.pop()
            self._close(top, time.time_ns(), exc=exc, error=None, inferred=False, parent=stack[-1] if stack else None)
        except Exception:  # noqa: BLE001
            report("recorder_error", "dcp_otel failed to record a DCP step failure", exc_info=True)

    def _over_limit(self, uuid: str) -> bool:
        """Whether the span of call ``uuid`` must be dropped (counted): too many open, or a duplicate."""
        if len(self._open) < self._options.max_open_spans and uuid not in self._open:
            return False
        report("span_limit", "dropped a DCP span: %d spans already open, or a duplicate uuid", len(self._open))
        return True

    def _push(
        self, uuid: str, func_name: str, time_ns: int, span: Span, op: _Operation, ctx: context_api.Context,
        new_operation: bool,
    ) -> None:  # fmt: skip
        """Make ``span`` current while call ``uuid`` runs, and remember it until the call ends."""
        keys = _KeyStats(self._options.slowest_keys) if func_name == _STATEFUL_PARENT else None
        entry = _Entry(uuid, func_name, time_ns, span, op, keys, new_operation)
        new_ctx = trace.set_span_in_context(span, ctx)
        if new_operation:  # a step finds its operation in ``ctx`` already
            new_ctx = context_api.set_value(_OPERATION_KEY, op, new_ctx)
        entry.token = context_api.attach(new_ctx)
        self._stack().append(entry)
        self._open[uuid] = entry

    def _start(self, event: DCPEvent) -> None:
        if self._over_limit(event.uuid):
            return
        ctx = context_api.get_current()
        enclosing = context_api.get_value(_OPERATION_KEY, ctx)
        links: list[Link] = []
        caller: Span | None = None
        new_operation = not isinstance(enclosing, _Operation)
        if isinstance(enclosing, _Operation):
            op = enclosing
            parent_ctx = ctx
            attributes = op.step_attributes
            if _has_class_fields(event.details):  # steps never have them; a nested save does
                attributes = {**attributes, **_class_attributes(event)}
        else:
            op, parent_ctx, caller = self._begin_operation(event, ctx)
            attributes = op.attributes
            if caller is not None:
                links.append(Link(caller.get_span_context(), {semconv.ATTR_LINK_KIND: semconv.LINK_CALLER}))
        span = op.tracer.start_span(
            _SPAN_PREFIX + event.func_name,  # semconv.span_name, inlined on the per-step path
            context=parent_ctx,
            attributes=attributes,
            links=links,
            start_time=event.time_ns,
        )
        if new_operation:
            op.add_part()
            op.exemplar = exemplar_for(span, op.rank)
            if caller is not None and caller.is_recording():
                add_link = getattr(caller, "add_link", None)
                if add_link is not None:
                    add_link(span.get_span_context(), {semconv.ATTR_LINK_KIND: semconv.LINK_CHECKPOINT})
        self._push(event.uuid, event.func_name, event.time_ns, span, op, ctx, new_operation)

    def _begin_operation(
        self, event: DCPEvent, ctx: context_api.Context
    ) -> tuple[_Operation, context_api.Context, Span | None]:
        """A DCP call with no enclosing DCP span: start this rank's part of a trace."""
        tracer, root_tracer = self._tracer()
        fields = operation_fields(event.details)
        if fields.global_rank is not None and fields.world_size is not None:
            distributed = True
            rank, world_size = fields.global_rank, fields.world_size
            group_rank = fields.group_rank if fields.group_rank is not None else rank
        else:  # torch.distributed not initialized: DCP runs as a single process
            distributed = False
            rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
            group_rank = 0
        identity = resolve_run_id(self._options.run_id, world_size if distributed else 1)
        if identity.source == "fallback":
            report(
                "no_run_id",
                "no run id found for a %d-rank job (set %s, or torchrun --rdzv-id): checkpoints of two runs "
                "saved to the same path may share a trace",
                world_size,
                semconv.ENV_RUN_ID,
            )
        checkpoint_id = redact_checkpoint_id(fields.checkpoint_id)
        # Outside torch.distributed every process is its own coordinator: keep
        # processes apart so two of them never emit the same root span id.
        scope = "" if distributed else f"/rank{rank}/pid{os.getpid()}"
        key = CheckpointKey(
            identity.run_id + scope,
            os.environ.get(semconv.ENV_TORCHELASTIC_RESTART_COUNT, "0"),
            event.func_name,
            checkpoint_id,
        )
        seq = self._seq.next(key)
        ids = derive_ids(key, seq)
        is_coordinator = group_rank == 0
        attributes: dict[str, Any] = {
            semconv.ATTR_OPERATION: event.func_name,
            semconv.ATTR_RANK: rank,
            semconv.ATTR_WORLD_SIZE: world_size,
            semconv.ATTR_GROUP_RANK: group_rank,
            semconv.ATTR_CHECKPOINT_ID: checkpoint_id,
            semconv.ATTR_OPERATION_SEQ: seq,
            semconv.ATTR_RUN_ID: identity.run_id,
            semconv.ATTR_COORDINATOR: is_coordinator,
        }
        if fields.backend:
            attributes[semconv.ATTR_BACKEND] = fields.backend
        attributes.update(_class_attributes(event))
        op = _Operation(event.func_name, rank, tracer, attributes)

        caller = trace.get_current_span(ctx)
        caller_ctx = caller.get_span_context()
        has_caller = caller_ctx.is_valid
        if is_coordinator and root_tracer is not None:
            links = [Link(caller_ctx, {semconv.ATTR_LINK_KIND: semconv.LINK_CALLER})] if has_caller else []
            op.root = start_root_span(
                *root_tracer,
                ids,
                semconv.SPAN_CHECKPOINT,
                ctx,
                attributes=attributes,
                links=links,
                start_time=event.time_ns,
            )
            parent_ctx = trace.set_span_in_context(op.root, ctx)
        else:
            # A proxy or no-op tracer (no SDK configured) records nothing: nothing to warn about.
            if is_coordinator and not isinstance(tracer, (trace.ProxyTracer, trace.NoOpTracer)):
                report(
                    "no_chosen_ids",
                    "the tracer provider %s cannot start a span with chosen ids: ranks share a trace, "
                    "but its root span is missing",
                    type(tracer).__name__,
                )
            parent_ctx = remote_root_context(tracer, ids, ctx)
        return op, parent_ctx, caller if has_caller else None

    def _finish(self, uuid: str, kind: str, time_ns: int, error: str | None, exc: BaseException | None) -> None:
        stack = self._stack()
        index = len(stack) - 1
        while index >= 0 and stack[index].uuid != uuid:
            index -= 1
        if index < 0:
            report("unmatched_event", "dropped a DCP %s event with no matching start", kind)
            return
        failed = kind == "exception"
        if failed and exc is None and error is None:
            event_error: str | None = "exception (not described by torch)"
        else:
            event_error = error
        # Calls above it on the stack raised without torch logging it (a
        # success end can only come after they returned or raised).
        cause = _describe(exc, event_error) if failed else "exception not logged by torch; see parent span"
        while len(stack) > index + 1:
            child = stack.pop()
            if child.span is not None:
                self._close(child, time_ns, exc=None, error=f"did not return: {cause}", inferred=True, parent=stack[-1])
        entry = stack.pop()
        parent = stack[-1] if stack else None
        if failed:
            self._close(entry, time_ns, exc=exc, error=event_error, inferred=False, parent=parent)
        else:
            self._close(entry, time_ns, exc=None, error=None, inferred=False, parent=parent)

    def _close(
        self,
        entry: _Entry,
        end_ns: int,
        *,
        exc: BaseException | None,
        error: str | None,
        inferred: bool,
        parent: _Entry | None,
    ) -> None:
        self._open.pop(entry.uuid, None)
        span = entry.span
        if span is None:  # a per-key call: summarized by on_key_event, no span
            return
        description: str | None = None
        if exc is not None or error is not None or inferred or entry.keys is not None:  # not a plain success
            description = _annotate(span, entry, end_ns, exc, error, inferred)
        span.end(end_time=end_ns)
        if entry.token is not None:
            context_api.detach(entry.token)
            entry.token = None
        if parent is not None:
            parent.children_ns += end_ns - entry.start_ns
        op = entry.op
        if op is None:
            return
        metrics = self._metrics
        if entry.owns_op_part:
            op.start_ns = entry.start_ns
            op.wait_s = (end_ns - entry.start_ns - entry.children_ns) / 1e9
            if op.part_done(end_ns, description) and metrics is not None:
                _operation_metrics(metrics, op)
        elif metrics is not None:
            try:  # a separate concern: failures here only count
                duration_s = (end_ns - entry.start_ns) / 1e9
                metrics.step_done(op.name, entry.func_name, op.rank, duration_s, op.exemplar)
                if entry.func_name == _STAGE_STEP:
                    metrics.async_phase_done(semconv.PHASE_STAGING, op.rank, duration_s, op.exemplar)
            except Exception:  # noqa: BLE001
                report("metrics_error", "dcp_otel failed to record checkpoint metrics", exc_info=True)

    def on_gathered(self, obj: object) -> None:
        """``_DistWrapper.gather_object`` is sending this rank's result to the coordinator.

        That is where DCP's own write results (after ``write_data``) and local
        read plans (before ``read_data``) pass: count their bytes, on the
        counters and on the operation span that is current.
        """
        try:
            op = context_api.get_value(_OPERATION_KEY)
            if not isinstance(op, _Operation):
                return
            written = _written_bytes(obj)
            if written is not None:
                attr = semconv.ATTR_WRITTEN_BYTES
                if self._metrics is not None:
                    self._metrics.bytes_written(op.rank, written)
            else:
                read = _planned_read_bytes(obj, op.storage)
                if read is None:
                    return
                attr = semconv.ATTR_READ_BYTES
                if self._metrics is not None:
                    self._metrics.bytes_read(op.rank, read)
            span = trace.get_current_span()  # the operation span whose collective this is
            if span.is_recording():
                span.set_attribute(attr, written if written is not None else read)
        except Exception:  # noqa: BLE001
            report("metrics_error", "dcp_otel failed to count checkpoint bytes", exc_info=True)

    # --- across a process boundary (async save in a daemon process) -------
    def export_operation(self) -> dict[str, Any] | None:
        """The current DCP operation and span as plain data another process can adopt.

        The span context travels as propagation headers (the global
        propagator's, W3C ``traceparent`` by default), as OpenTelemetry's
        messaging instrumentations carry it; the operation as its name, rank and
        step attributes. ``None`` when no DCP operation is current.
        """
        try:
            op = context_api.get_value(_OPERATION_KEY)
            if not isinstance(op, _Operation):
                return None
            headers: dict[str, str] = {}
            propagate.inject(headers)
            return {"headers": headers, "operation": op.name, "rank": op.rank, "attributes": dict(op.step_attributes)}
        except Exception:  # noqa: BLE001
            report("recorder_error", "dcp_otel failed to carry a DCP operation to another process", exc_info=True)
            return None

    def adopt_operation(self, carried: object) -> context_api.Context | None:
        """The context in which DCP calls continue the operation :meth:`export_operation` described.

        Spans started in it are children of the exported span, carry the
        operation's attributes, and their metrics are that operation's steps.
        ``None`` (with a counted warning) for anything malformed.
        """
        try:
            if not isinstance(carried, dict):
                raise TypeError(f"expected a dict, got {type(carried).__name__}")
            headers, name, rank, attributes = (
                carried["headers"], carried["operation"], carried["rank"], carried["attributes"]
            )  # fmt: skip
            if not (isinstance(headers, dict) and isinstance(name, str) and isinstance(attributes, dict)):
                raise TypeError("malformed operation carrier")
            ctx = propagate.extract({str(k): str(v) for k, v in headers.items()})
            op = _Operation(name, int(rank), self._tracer()[0], attributes)
            op.exemplar = exemplar_for_context(trace.get_current_span(ctx).get_span_context(), op.rank)
            return context_api.set_value(_OPERATION_KEY, op, ctx)
        except Exception:  # noqa: BLE001
            report("malformed_carrier", "dcp_otel could not continue a DCP operation from another process", exc_info=True)
            return None

    # --- async save -----------------------------------------------------
    def begin_async_upload(
        self, staging: Future[Any] | None
    ) -> tuple[context_api.Context, Callable[[Future[Any] | BaseException], None]] | None:
        """Open the upload (and async staging) spans of the current async save.

        Returns the context to run the background save in, and the callback
        that ends the upload span: call it with the upload future when it is
        done, or with the exception if handing off failed. ``None`` when no
        DCP operation is current (nothing to attach to).
        """
        try:
            op = context_api.get_value(_OPERATION_KEY)
            if not isinstance(op, _Operation):
                return None
            ctx = context_api.get_current()
            now = time.time_ns()
            if staging is not None:
                staging_span = op.tracer.start_span(
                    semconv.SPAN_ASYNC_STAGING, context=ctx, attributes=op.step_attributes, start_time=now
                )
                staging.add_done_callback(lambda fut: _end_from_future(staging_span, fut))
            upload = op.tracer.start_span(
                semconv.SPAN_ASYNC_UPLOAD, context=ctx, attributes=op.step_attributes, start_time=now
            )
            op.add_part()
        except Exception:  # noqa: BLE001
            report("recorder_error", "dcp_otel failed to trace an async upload", exc_info=True)
            return None
        with self._uploads:
            self._uploads_in_flight += 1
        metrics = self._metrics
        if metrics is not None:
            try:  # this runs inside torch's async_save: nothing may escape
                metrics.async_handed_off(op.rank)
            except Exception:  # noqa: BLE001
                report("metrics_error", "dcp_otel failed to count an async save in flight", exc_info=True)

        def finish(outcome: Future[Any] | BaseException) -> None:
            try:
                error = _end_from_future(upload, outcome)
                end_ns = time.time_ns()
                complete = op.part_done(end_ns, error)
                if metrics is not None:
                    metrics.async_upload_done(op.rank, (end_ns - now) / 1e9, exemplar_for(upload, op.rank))
                    if complete:
                        _operation_metrics(metrics, op)
            except Exception:  # noqa: BLE001
                report("recorder_error", "dcp_otel failed to end an async upload span", exc_info=True)
            finally:
                with self._uploads:
                    self._uploads_in_flight -= 1
                    self._uploads.notify_all()

        return trace.set_span_in_context(upload, ctx), finish


def _annotate(
    span: Span, entry: _Entry, end_ns: int, exc: BaseException | None, error: str | None, inferred: bool
) -> str | None:
    """Put on ``span`` what its call left behind (key summary, failure); the failure's description."""
    description: str | None = None
    if span.is_recording():
        if entry.keys is not None:
            span.set_attributes(entry.keys.to_attributes())
        if exc is not None:
            span.record_exception(exc, timestamp=end_ns)
            description = _describe(exc, error)
            failed_ranks = _failed_ranks(exc)
            if failed_ranks is not None:
                span.set_attribute(semconv.ATTR_FAILED_RANKS, failed_ranks)
        elif error is not None:
            span.add_event("exception", {"exception.message": error[: _MAX_STATUS_TEXT * 4]}, timestamp=end_ns)
            description = error
        if inferred:
            span.set_attribute(semconv.ATTR_END_INFERRED, True)
        if description is not None:
            span.set_status(Status(StatusCode.ERROR, description[:_MAX_STATUS_TEXT]))
    elif exc is not None or error is not None:
        description = _describe(exc, error)
    return description


def _operation_metrics(metrics: MetricsSink, op: _Operation) -> None:
    """The metrics of a complete operation (failures here only count)."""
    try:
        duration_s = (op.end_ns - op.start_ns) / 1e9
        metrics.operation_done(op.name, op.rank, op.failed is None, duration_s, op.wait_s, op.end_ns / 1e9, op.exemplar)
    except Exception:  # noqa: BLE001
        report("metrics_error", "dcp_otel failed to record checkpoint metrics", exc_info=True)


def _written_bytes(obj: object) -> int | None:
    """Total ``size_in_bytes`` if ``obj`` is DCP's list of ``WriteResult``, else ``None``."""
    if not isinstance(obj, list) or not obj or not all(isinstance(item, WriteResult) for item in obj):
        return None
    return int(sum(item.size_in_bytes for item in obj))


def _planned_read_bytes(obj: object, storage: object | None) -> int | None:
    """Bytes a local ``LoadPlan`` will read, from the reader's ``storage_data`` (offsets and lengths)."""
    storage_data = getattr(storage, "storage_data", None)
    if not isinstance(obj, LoadPlan) or not isinstance(storage_data, dict):
        return None
    total = 0
    for item in obj.items:
        length = getattr(storage_data.get(item.storage_index), "length", None)
        if isinstance(length, int):
            total += length
    return total


def _end_from_future(span: Span, outcome: Future[Any] | BaseException) -> str | None:
    """End ``span`` with the outcome of a future (or an exception); return the error text."""
    exc: BaseException | None
    if isinstance(outcome, BaseException):
        exc = outcome
    elif outcome.cancelled():
        exc = None
        span.set_status(Status(StatusCode.ERROR, "cancelled"))
        span.end()
        return "cancelled"
    else:
        exc = outcome.exception()
    error = None
    if exc is not None:
        error = _describe(exc, None)
        if span.is_recording():
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, error[:_MAX_STATUS_TEXT]))
    span.end()
    return error


def _failed_ranks(exc: BaseException) -> list[int] | None:
    """The failing ranks of torch's ``CheckpointException`` (``failures`` maps rank to error)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return None
    return sorted(r for r in failures if isinstance(r, int))


def _describe(exc: BaseException | None, error: str | None) -> str:
    """A one-line status description: the exception type and its first line.

    For ``CheckpointException`` (whose text is a multi-rank traceback dump):
    the failing ranks and the first rank's own exception.
    """
    ranks = _failed_ranks(exc) if exc is not None else None
    if exc is not None and ranks:
        first = exc.failures[ranks[0]]  # type: ignore[attr-defined]
        cause = first[0] if isinstance(first, tuple) and first else first
        cause_text = str(cause).strip().splitlines()
        detail = f"{type(cause).__name__}: {cause_text[0]}" if cause_text else type(cause).__name__
        return f"{type(exc).__name__}: ranks {ranks} failed; rank {ranks[0]}: {detail}"
    if exc is not None:
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return (error or "exception").strip().splitlines()[0] if (error or "").strip() else "exception"


_CLASS_FIELDS = (
    ("storage_writer", semconv.ATTR_STORAGE_WRITER),
    ("storage_reader", semconv.ATTR_STORAGE_READER),
    ("planner", semconv.ATTR_PLANNER),
)


def _has_class_fields(details: Any) -> bool:
    return "storage_writer" in details or "storage_reader" in details or "planner" in details


def _class_attributes(event: DCPEvent) -> dict[str, str]:
    """The storage and planner class names torch logged for this call, if any."""
    details = event.details
    return {attr: str(details[field]) for field, attr in _CLASS_FIELDS if details.get(field)}


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default

