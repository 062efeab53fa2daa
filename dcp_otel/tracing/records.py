"""What the hot path records: one :class:`Call` per DCP call, one :class:`Operation` per checkpoint.

A :class:`Call` is created when a DCP call starts and finished (``end_ns``,
failure) when it ends, on the caller's thread, with nothing computed that is
not needed right then. Once its :class:`Operation` is complete, the operation
and its calls are handed to :mod:`dcp_otel.tracing.builder`, which reads them
and never writes them: from then on they are immutable.

Usage (what :mod:`dcp_otel.tracing.tracker` does)::

    call = Call(uuid, "write_data", start_ns, span_id, parent, op, op.step_attributes)
    ...
    call.end_ns = end_ns
    op.calls.append(call)
"""

from __future__ import annotations

import heapq
import random
import threading
from collections import deque
from typing import Any, Final, NamedTuple

from opentelemetry import trace
from opentelemetry.trace import SpanContext, TraceFlags

from dcp_otel import semconv
from dcp_otel.metrics.prometheus import Exemplar, exemplar_for_context
from dcp_otel.tracing.failures import Failure, global_rank_of

_getrandbits = random.getrandbits


def new_span_id() -> int:
    """A random, valid span id (chosen on the hot path; ids need be unique, not secret)."""
    return _getrandbits(64) or 1


MAX_STATUS_TEXT: Final = 256
MAX_KEY_TEXT: Final = 128
#: Kinds of calls that are not steps: the spans every rank exports in every detail mode.
KIND_OPERATION: Final = "operation"
KIND_STEP: Final = "step"
KIND_UPLOAD: Final = "upload"
KIND_STAGING: Final = "staging"
#: One of DCP's object collectives: exported with the steps, but waiting, not the rank's own work.
KIND_COLLECTIVE: Final = "collective"


def key_of(func_name: str) -> str:
    """The state-dict key a per-key call ``_stateful_to_state_dict.<key>`` names (bounded)."""
    return func_name[len(semconv.STATEFUL_KEY_PREFIX) :][:MAX_KEY_TEXT]


#: A summary's floor while it names no slowest keys (``limit`` 0): no key's time reaches it.
_NEVER: Final = 1 << 63


class KeyStats:
    """Summary of the per-key ``_stateful_to_state_dict.<key>`` calls: how many, their time, the slowest.

    A key's end adds to the count and the total (two int additions: a 10,000-key state dict logs 20,000
    records on the caller's thread, and nothing per key is allocated that the garbage collector tracks); only a
    key at least as slow as the slowest kept so far (``floor``) goes into the heap of the slowest.

    Usage::

        stats = KeyStats(limit=5)
        stats.add("_stateful_to_state_dict.model", 1_200)   # (the per-key lane does what add does, in the tap)
        stats.to_attributes()[semconv.ATTR_STATE_DICT_SLOWEST_KEYS]   # -> ["model"]
    """

    __slots__ = ("limit", "count", "total_ns", "slowest", "floor", "failed_key")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self.total_ns = 0
        #: min-heap of (duration, order, per-key function name): the slowest ``limit`` keys, the later first on a tie
        self.slowest: list[tuple[int, int, str]] = []
        self.floor = 0 if limit else _NEVER  # a key this slow or slower is among the slowest
        self.failed_key: str | None = None

    def add(self, func_name: str, duration_ns: int) -> None:
        """One key's call returned: ``func_name`` is its ``_stateful_to_state_dict.<key>`` (the key is cut
        from it only for the slowest, when the span is built)."""
        self.count += 1
        self.total_ns += duration_ns
        if duration_ns >= self.floor:
            self.slow(duration_ns, func_name)

    def slow(self, duration_ns: int, func_name: str) -> None:
        """The ``count``-th key, ``duration_ns`` at least the floor, ranks among the slowest (the later first on
        a tie: its order is higher)."""
        slowest = self.slowest
        if len(slowest) < self.limit:
            heapq.heappush(slowest, (duration_ns, self.count, func_name))
        else:
            heapq.heapreplace(slowest, (duration_ns, self.count, func_name))
        if len(slowest) >= self.limit:
            self.floor = slowest[0][0]

    def to_attributes(self) -> dict[str, Any]:
        ordered = sorted(self.slowest, reverse=True)
        attrs: dict[str, Any] = {
            semconv.ATTR_STATE_DICT_KEYS: self.count,
            semconv.ATTR_STATE_DICT_KEYS_SECONDS: self.total_ns / 1e9,
            semconv.ATTR_STATE_DICT_SLOWEST_KEYS: [key_of(name) for _, _, name in ordered],
            semconv.ATTR_STATE_DICT_SLOWEST_SECONDS: [d / 1e9 for d, _, _ in ordered],
        }
        if self.failed_key is not None:
            attrs[semconv.ATTR_STATE_DICT_FAILED_KEY] = self.failed_key
        return attrs


class Call:
    """One DCP call (or an async save's upload or staging): a span to be.

    Its ``span_id`` is chosen when it starts and made current through a
    non-recording span, so whatever the call does (a storage plugin's own
    spans) nests under the span the builder emits later with that id.

    Built twice per DCP step on the caller's thread, so only what every call
    needs is set here; the rest (``kind``, ``keys``, ``failure``, ...) keeps
    its class-level default until a rare call sets it.
    """

    __slots__ = ("uuid", "func_name", "start_ns", "end_ns", "span_id", "parent", "op", "attributes", "token",
                 "children_ns", "rec", "__dict__")  # fmt: skip

    kind: str = KIND_STEP
    keys: KeyStats | None = None
    owns_part: bool = False  # its end may complete the operation
    part_ended: bool = False  # that part is counted (Operation.part_done)
    prior: Any = None  # the context its start found (the general path's calls; see dcp_otel.tracing.cut_short)
    watched: tuple[int, Any] | None = None  # an operation call's: the frame running it (ditto)
    failure: Failure | None = None
    inferred: bool = False
    extra: dict[str, Any] | None = None  # attributes learnt while it ran (byte counts)
    sent_bytes: int = 0  # a collective's: the bytes torch pickled for it on this rank, and unpickled
    received_bytes: int = 0
    arrivals: list[tuple[int, int]] | None = None  # the coordinator's write gather: (rank, since_ns) each sent
    helpers: set[int] | None = None  # threads working for it now (a pool's), whose stacks a stall report adds
    summary: Any = None  # what it did, summarized by the builder (``summary.to_attributes()``): a library's items

    def __init__(
        self,
        uuid: str,
        func_name: str,
        start_ns: int,
        span_id: int,
        parent: SpanContext | trace.Span | Call | None,
        op: Operation | None,
        attributes: dict[str, Any],
        kind: str = KIND_STEP,
    ) -> None:
        self.uuid = uuid
        self.func_name = func_name
        self.start_ns = start_ns
        self.end_ns = 0
        self.span_id = span_id  # 0: a per-key call, summarized on its parent, no span
        self.parent = parent  # the span (or its context) current when the call started; a collective's: its step
        self.op = op
        self.attributes = attributes  # shared, never mutated (replaced when they change)
        self.token: object | None = None
        self.children_ns = 0  # time in its own child calls; the rest of an operation is collective wait
        self.rec = -1  # where its process's record holds it (dcp_otel.spool.record), if it does
        if kind != KIND_STEP:
            self.kind = kind

    @property
    def name(self) -> str:
        if self.kind == KIND_UPLOAD:
            return semconv.SPAN_ASYNC_UPLOAD
        if self.kind == KIND_STAGING:
            return semconv.SPAN_ASYNC_STAGING
        if self.kind == KIND_COLLECTIVE:
            return semconv.SPAN_COLLECTIVE_PREFIX + self.func_name
        return semconv.SPAN_PREFIX + self.func_name

    @property
    def parent_context(self) -> SpanContext | None:
        """The valid span context of the parent, if any."""
        parent = self.parent
        if isinstance(parent, Call):  # a collective's step: its context made here, off the caller's thread
            op = self.op
            parent = SpanContext(op.trace_id, parent.span_id, False, op.flags) if op is not None else None
        elif parent is not None and not isinstance(parent, SpanContext):
            parent = parent.get_span_context() if isinstance(parent, trace.Span) else None
        return parent if parent is not None and parent.is_valid else None

    @property
    def duration_s(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9


class KeyCall(Call):
    """A state dict's per-key call, ``_stateful_to_state_dict.<key>``, while it runs: no span (``span_id``
    0), no context, its time summarized on its conversion's :class:`KeyStats` when it returns.

    Made only where the per-key lane (:mod:`~dcp_otel.tracing.key_lane`) does not take a key (a conversion on a
    second thread, or nested in a key), one a key on the caller's thread: only the three fields it needs are set;
    everything else a reader of the thread's stack asks a :class:`Call` is a class default here (a value set
    later goes to the instance, as on a call).
    """

    __slots__ = ()

    end_ns = 0
    span_id = 0
    parent = None
    op = None
    attributes: dict[str, Any] = {}  # noqa: RUF012 - never mutated (a call's are replaced, never changed)
    token = None
    children_ns = 0
    rec = -1

    def __init__(self, uuid: str, func_name: str, start_ns: int) -> None:
        self.uuid = uuid
        self.func_name = func_name
        self.start_ns = start_ns


class ThreadStack(list):  # type: ignore[type-arg]
    """A thread's open calls, innermost last, and where its process's record keeps them (``base``, -1: nowhere).

    A list (its ``append`` and ``pop`` are the list's own, in C): two attributes more, read once per call.
    """

    __slots__ = ("base", "calls")

    def __init__(self, base: int) -> None:
        super().__init__()
        self.base = base
        self.calls = 0  # calls written into the record: the next one goes to its ring's entry calls % RING


class Staged(NamedTuple):
    """What a stager was given to copy: bytes, from which devices, into which kind of host memory."""

    nbytes: int
    devices: str  # "cuda:0", or sorted and joined: "cpu,cuda:0"
    pinned: bool
    shared: bool


class Operation:
    """One checkpoint operation on this rank: the unit that owns a trace and is built as one.

    ``pending`` counts the calls that may end last (the operation call itself,
    an async upload and staging, the top-level calls of an operation adopted in
    the async save process); when it drops to zero the operation is complete
    and goes to the builder. An async save thus counts as a success, with its
    duration up to the end of the upload, only once its checkpoint is durable.
    """

    __slots__ = (
        "name", "rank", "rank_label", "world_size", "group_rank", "coordinator", "tracer", "trace_id", "flags",
        "attributes", "step_attributes", "root_span_id", "caller", "pending", "failed", "end_ns", "start_ns",
        "wait_s", "lock", "storage", "exemplar_span_id", "_exemplar", "calls", "gathered", "submitted", "adopted", "span_id", "interrupted",
        "group", "collective_error", "staging", "released_ns", "rec_serial", "rec_slot", "start_uuid", "queued",
        "background",
    )  # fmt: skip

    def __init__(
        self,
        name: str,
        rank: int,
        tracer: trace.Tracer,
        attributes: dict[str, Any],
        trace_id: int,
        flags: TraceFlags,
        step_attributes: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.rank = rank
        self.rank_label = str(rank)  # the metrics' rank label
        self.world_size = int(attributes.get(semconv.ATTR_WORLD_SIZE, 1))
        self.group_rank = int(attributes.get(semconv.ATTR_GROUP_RANK, rank))
        self.coordinator = bool(attributes.get(semconv.ATTR_COORDINATOR, False))
        self.tracer = tracer  # the tracer of the provider current when it started
        self.trace_id = trace_id
        self.flags = flags
        #: On the root and on each rank's operation span: everything we know.
        self.attributes = attributes
        #: On every other span: what identifies it (rank, checkpoint, classes).
        self.step_attributes = step_attributes if step_attributes is not None else {
            k: v for k, v in attributes.items() if k not in OPERATION_ONLY
        }
        self.root_span_id = 0  # the coordinator's dcp.checkpoint span, built with the operation
        self.caller: SpanContext | None = None  # the span current when the operation was called
        self.span_id = 0  # this rank's operation span
        self.storage: object | None = None  # what _storage_setup chose, for read plans' byte counts
        #: The span its metrics' exemplar points at (0: none); the exemplar itself is made when first read.
        self.exemplar_span_id = 0
        self._exemplar: Exemplar | None | bool = False  # False: not made yet
        self.calls: list[Call] = []  # finished calls, in the order they ended
        self.gathered: list[tuple[Call, object]] = []  # objects DCP gathered (write results, read plans)
        self.pending = 0
        self.failed: str | None = None
        self.end_ns = 0
        self.start_ns = 0  # of this rank's operation span
        self.wait_s = 0.0  # of the operation span: not covered by its steps
        self.submitted = False
        self.adopted = False  # continued in the async save process from a carried context
        self.interrupted: str | None = None  # ended by the process ending (SIGTERM, exit) while open
        self.group: object | None = None  # the process group DCP ran it on, once seen (None: the default)
        self.collective_error = 0  # id() of the exception one of its collectives raised, while it propagates
        self.released_ns = 0  # when its last collective so far returned on this rank (0: none yet)
        self.staging: Staged | None = None  # what an async save's stager copied (dcp_otel.tracing.facts)
        self.rec_serial = 0  # its number and slot in its process's record (dcp_otel.spool.record); 0: not there
        self.rec_slot = -1
        self.start_uuid = ""  # the call that began it (a start cut short drops it: dcp_otel.tracing.cut_short)
        self.queued = False  # handed to the builder (or dropped there): once
        self.background: tuple[int, int] | None = None  # when its background work ran beside training (builder)
        self.lock = threading.Lock()

    @property
    def sampled(self) -> bool:
        return bool(self.flags.sampled)

    @property
    def exemplar(self) -> Exemplar | None:
        """The exemplar of this operation's observations: one trace, one rank, the same for all of them.

        Made when the builder (or an upload's end) first reads it, off the caller's thread: its hex ids
        are not the training thread's work at an operation's start.
        """
        found = self._exemplar
        if found is False:
            span_id = self.exemplar_span_id
            found = self._exemplar = exemplar_for_context(
                SpanContext(self.trace_id, span_id, False, self.flags), self.rank_label) if span_id else None  # fmt: skip
        return found  # type: ignore[return-value]

    def add_part(self) -> None:
        with self.lock:
            self.pending += 1

    def part_done(self, end_ns: int, error: str | None, part: Call | None = None) -> bool:
        """One part ended; True when it was the last (the operation is complete).

        ``part``: the call that ended, counted once however often its end is told (an end cut short and
        finished again, :mod:`dcp_otel.tracing.cut_short`).
        """
        with self.lock:
            if part is not None:
                if part.part_ended:
                    return False
                part.part_ended = True
            self.pending -= 1
            if end_ns > self.end_ns:  # (no call under the lock: a signal handler's exception lands at none)
                self.end_ns = end_ns
            if error and not self.failed:
                self.failed = error
            if self.pending > 0 or self.submitted:
                return False
            self.submitted = True
            return True


class DurationHistory:
    """The last durations of each operation's successful runs in this process (the builder adds them).

    Read from any thread (the stall watchdog derives its thresholds from it):
    each operation's ``deque`` is only appended to.
    """

    def __init__(self, size: int = 20) -> None:
        self._size = size
        self._by_operation: dict[str, deque[float]] = {}
        self._last_end: dict[str, tuple[int, str]] = {}  # operation -> (end_ns, checkpoint id) of its last run

    def add(self, operation: str, duration_s: float, end_ns: int = 0, checkpoint_id: str = "") -> None:
        found = self._by_operation.get(operation)
        if found is None:
            found = self._by_operation[operation] = deque(maxlen=self._size)
        found.append(duration_s)
        if end_ns > self._last_end.get(operation, (0, ""))[0]:
            self._last_end[operation] = (end_ns, checkpoint_id)  # one store: read whole from any thread

    def last_success(self, operations: frozenset[str]) -> tuple[int, str] | None:
        """``(end_ns, checkpoint id)`` of the last successful run of any of ``operations`` (an async save's end:
        when it became durable)."""
        return max((last for name, last in tuple(self._last_end.items()) if name in operations), default=None)

    def last_success_ns(self, operations: frozenset[str]) -> int | None:
        last = self.last_success(operations)
        return last[0] if last is not None else None

    def longest(self, operation: str) -> float | None:
        """The longest of the remembered runs of ``operation`` (``None``: none yet)."""
        found = self._by_operation.get(operation)
        return max(tuple(found)) if found else None


#: Attributes that say something about the operation as a whole, kept off step spans.
OPERATION_ONLY: Final = frozenset(
    {semconv.ATTR_OPERATION_SEQ, semconv.ATTR_RUN_ID, semconv.ATTR_COORDINATOR, semconv.ATTR_GROUP_RANK,
     semconv.ATTR_GENERATION}
)


def failure_of(call: Call, exc: BaseException | None, error: str | None) -> Failure:
    """``call``'s failure, told for its rank, with the ranks torch names mapped to global ranks."""
    op = call.op
    return Failure(exc, error, op.rank if op is not None else None, global_rank_of(op.group if op is not None else None))
