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
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from opentelemetry import trace
from opentelemetry.trace import SpanContext, TraceFlags

from dcp_otel import semconv
from dcp_otel.redact import redact_text

_getrandbits = random.getrandbits


def new_span_id() -> int:
    """A random, valid span id (chosen on the hot path; ids need be unique, not secret)."""
    return _getrandbits(64) or 1


MAX_STATUS_TEXT: Final = 256
#: An exception event's message and stack trace are cut to these (an OTLP batch must stay below 4 MiB).
MAX_EXCEPTION_TEXT: Final = 4096
MAX_STACKTRACE_TEXT: Final = 16384
MAX_FRAMES: Final = 16  # of each side of a multi-rank failure
MAX_KEY_TEXT: Final = 128
#: The exception type of a call ended because its process was ending (SIGTERM, exit).
INTERRUPTED_TYPE: Final = "dcp_otel.Interrupted"
#: Kinds of calls that are not steps: the spans every rank exports in every detail mode.
KIND_OPERATION: Final = "operation"
KIND_STEP: Final = "step"
KIND_UPLOAD: Final = "upload"
KIND_STAGING: Final = "staging"
#: One of DCP's object collectives: exported with the steps, but waiting, not the rank's own work.
KIND_COLLECTIVE: Final = "collective"


@dataclass
class KeyStats:
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


class Failure:
    """A failure, described once, on the thread that saw it (failures are rare).

    The exception object is not kept: its traceback holds the frames of the
    failed call (and whatever tensors they reference) alive. Its text is taken
    now, in the form the SDK's ``record_exception`` gives an ``exception`` event,
    capped and with credentials redacted (a storage error often quotes a signed
    URL).

    torch's ``CheckpointException`` is never formatted whole: its text holds
    every failed rank's traceback (1.4 MB at 1,024 failed ranks, and 0.4 s to
    format on the training thread). Its event keeps this rank's own failure
    (``rank``; the first failed rank's when this rank did not fail), and the
    failed ranks go to ``dcp.failed_ranks``. torch keys them by the rank in the
    process group the save ran on: ``to_global`` maps those to global ranks
    (:func:`global_rank_of`), so every rank is named by its global rank.

    ``origin``: the exception is this rank's own (not torch's report of the
    failed ranks, nor one inferred), with its type in ``origin``: where a
    failure started is counted there, once. :meth:`came_from_collective` takes
    it back for an exception one of DCP's collectives raised (a peer gone).
    """

    __slots__ = ("description", "event", "failed_ranks", "origin", "in_collective")

    def __init__(self, exc: BaseException | None, error: str | None, rank: int | None = None,
                 to_global: GlobalRank | None = None) -> None:  # fmt: skip
        to_global = to_global or _same_rank
        # torch's own error text when there is no exception object (an inferred end, say)
        self.description = redact_text(describe(exc, error, rank, to_global) if exc is not None else (error or "exception"))
        self.failed_ranks = failed_ranks(exc, to_global) if exc is not None else None
        self.origin: str | None = None
        self.in_collective = False
        if exc is None:
            self.event: dict[str, Any] = {"exception.message": capped(redact_text(error or self.description))}
            return
        if self.failed_ranks is None and not any(failed_ranks(e) for e in _chain(exc)):
            self.origin = type(exc).__name__
        message, stacktrace = _exception_text(exc, rank, to_global)
        self.event = {
            "exception.type": _type_name(exc),
            "exception.message": capped(redact_text(message)),
            "exception.stacktrace": capped(redact_text(stacktrace), MAX_STACKTRACE_TEXT),
            "exception.escaped": "False",
        }

    def came_from_collective(self) -> None:
        """The exception was raised by one of DCP's collectives: another rank's failure (it went away,
        the collective timed out waiting for it), not where the failure started."""
        self.in_collective = True
        self.origin = None

    @classmethod
    def interrupted(cls, description: str, stack: str | None) -> Failure:
        """A call the process ended while it was still open ("terminated by SIGTERM during write_data").

        Its exception event has the stack of the thread that was inside the
        call as stack trace, where it is known.
        """
        failure = cls(None, description)
        failure.event = {"exception.type": INTERRUPTED_TYPE, "exception.message": capped(redact_text(description))}
        if stack:
            failure.event["exception.stacktrace"] = capped(redact_text(stack), MAX_STACKTRACE_TEXT)
        return failure


def capped(text: str, limit: int = MAX_EXCEPTION_TEXT) -> str:
    """``text``, cut to ``limit`` characters with a note of how much was cut (keeping the start and the end)."""
    if len(text) <= limit:
        return text
    note = f"\n... [{len(text) - limit} characters cut by dcp-otel] ...\n"
    head = (limit - len(note)) * 2 // 3
    return text[:head] + note + text[len(text) - (limit - len(note) - head) :]


def _type_name(exc: BaseException) -> str:
    module, qualname = type(exc).__module__, type(exc).__qualname__
    return f"{module}.{qualname}" if module and module != "builtins" else qualname


def _exception_text(exc: BaseException, rank: int | None, to_global: GlobalRank) -> tuple[str, str]:
    """The message and stack trace of ``exc``; of a multi-rank failure, only one rank's own."""
    failures = global_failures(exc, to_global)
    if not failures:
        # A multi-rank failure further down the chain (a wrapper raised from it) is summarized, not formatted whole.
        inner = next((e for e in _chain(exc) if failed_ranks(e)), None)
        if inner is None:
            return str(exc), "".join(traceback.format_exception(exc))
        summary = f"{describe(inner, None, rank, to_global)}\n\nDuring handling of the above exception, another exception occurred:\n\n"
        # (traceback's format_exception and format_exception_only build the whole chain's text, even unused)
        lines = ["Traceback (most recent call last):\n", *traceback.format_tb(exc.__traceback__, limit=-MAX_FRAMES),
                 _exception_line(exc)]  # fmt: skip
        return str(exc), summary + "".join(lines)
    ranks = sorted(failures)
    own = rank if rank in failures else ranks[0]
    cause = _cause(failures[own])
    cause_text = _exception_line(cause).strip() if isinstance(cause, BaseException) else str(cause)
    header = f"{type(exc).__name__}: ranks [{rank_ranges(ranks)}] failed ({len(ranks)}); rank {own}"
    header += " (this rank)" if own == rank else ""
    message = f"{header}: {cause_text}"
    failure = failures[own]
    remote = failure[1] if isinstance(failure, tuple) and len(failure) > 1 else None
    # The innermost frames of each side: where the coordinator raised it, and where the rank failed.
    local = traceback.format_tb(exc.__traceback__, limit=-MAX_FRAMES)
    parts = ["Traceback (most recent call last):\n", *local, f"{_type_name(exc)}: {header}\n"]
    if isinstance(remote, list):  # torch's StackSummary of the failing rank
        frames = traceback.StackSummary.from_list(list(remote)[-MAX_FRAMES:])
        parts += [f"\nrank {own}, where it failed (innermost {len(frames)} frames):\n", *frames.format()]
    parts.append(cause_text + "\n")
    return message, "".join(parts)


def _exception_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{_type_name(exc)}: {text}\n" if text else f"{_type_name(exc)}\n"


def _chain(exc: BaseException, depth: int = 8) -> list[BaseException]:
    """The exceptions ``exc`` was raised from or while handling (at most ``depth``)."""
    found: list[BaseException] = []
    current = exc.__cause__ or exc.__context__
    while current is not None and len(found) < depth and current is not exc:
        found.append(current)
        current = current.__cause__ or current.__context__
    return found


def _cause(failure: object) -> object:
    """The exception in one of ``CheckpointException.failures``' values (an exception, or it and its stack)."""
    return failure[0] if isinstance(failure, tuple) and failure else failure


def rank_ranges(ranks: list[int]) -> str:
    """Sorted ranks as ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    parts: list[str] = []
    start = prev = None
    for r in ranks:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)


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
                 "children_ns", "__dict__")  # fmt: skip

    kind: str = KIND_STEP
    keys: KeyStats | None = None
    owns_part: bool = False  # its end may complete the operation
    failure: Failure | None = None
    inferred: bool = False
    extra: dict[str, Any] | None = None  # attributes learnt while it ran (byte counts)

    def __init__(
        self,
        uuid: str,
        func_name: str,
        start_ns: int,
        span_id: int,
        parent: SpanContext | trace.Span | None,
        op: Operation | None,
        attributes: dict[str, Any],
        kind: str = KIND_STEP,
    ) -> None:
        self.uuid = uuid
        self.func_name = func_name
        self.start_ns = start_ns
        self.end_ns = 0
        self.span_id = span_id  # 0: a per-key call, summarized on its parent, no span
        self.parent = parent  # the span (or its context) current when the call started
        self.op = op
        self.attributes = attributes  # shared, never mutated (replaced when they change)
        self.token: object | None = None
        self.children_ns = 0  # time in its own child calls; the rest of an operation is collective wait
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
        if parent is not None and not isinstance(parent, SpanContext):
            parent = parent.get_span_context() if isinstance(parent, trace.Span) else None
        return parent if parent is not None and parent.is_valid else None

    @property
    def duration_s(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9


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
        "wait_s", "lock", "storage", "exemplar", "calls", "gathered", "submitted", "adopted", "span_id", "interrupted",
        "group", "collective_error",
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
        self.exemplar: dict[str, str] | None = None  # one trace, one rank: the same for every observation
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
        self.lock = threading.Lock()

    @property
    def sampled(self) -> bool:
        return bool(self.flags.sampled)

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

    def add(self, operation: str, duration_s: float) -> None:
        found = self._by_operation.get(operation)
        if found is None:
            found = self._by_operation[operation] = deque(maxlen=self._size)
        found.append(duration_s)

    def longest(self, operation: str) -> float | None:
        """The longest of the remembered runs of ``operation`` (``None``: none yet)."""
        found = self._by_operation.get(operation)
        return max(tuple(found)) if found else None


#: Attributes that say something about the operation as a whole, kept off step spans.
OPERATION_ONLY: Final = frozenset(
    {semconv.ATTR_OPERATION_SEQ, semconv.ATTR_RUN_ID, semconv.ATTR_COORDINATOR, semconv.ATTR_GROUP_RANK,
     semconv.ATTR_GENERATION}
)


#: Maps a rank in a checkpoint's process group to its global rank.
GlobalRank = Callable[[int], int]


def _same_rank(rank: int) -> int:
    return rank


def global_rank_of(group: object | None) -> GlobalRank:
    """The global rank of each rank of process group ``group`` (``None`` or the default group: the same).

    Read from torch's own table of the group's ranks, on this process: no collective.
    """
    if group is None:
        return _same_rank
    try:
        import torch.distributed as dist

        if group is dist.group.WORLD:
            return _same_rank
        ranks = dist.get_process_group_ranks(group)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a group torch does not know (any more): its own numbering
        return _same_rank
    return lambda rank: ranks[rank] if 0 <= rank < len(ranks) else rank


def global_failures(exc: BaseException, to_global: GlobalRank = _same_rank) -> dict[int, object] | None:
    """torch's ``CheckpointException.failures`` (group rank to error) by global rank; ``None`` for another exception."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return None
    return {to_global(r): f for r, f in failures.items() if isinstance(r, int)}


def failed_ranks(exc: BaseException, to_global: GlobalRank = _same_rank) -> list[int] | None:
    """The failing ranks of torch's ``CheckpointException``, as global ranks."""
    failures = global_failures(exc, to_global)
    return sorted(failures) if failures is not None else None


def describe(exc: BaseException | None, error: str | None, rank: int | None = None,
             to_global: GlobalRank = _same_rank) -> str:  # fmt: skip
    """A one-line status description: the exception type and its first line.

    For ``CheckpointException`` (whose text is a multi-rank traceback dump):
    the failing ranks and one rank's own exception (``rank``'s if it failed,
    else the first failed rank's), never the whole text.
    """
    failures = global_failures(exc, to_global) if exc is not None else None
    if exc is not None and failures:
        ranks = sorted(failures)
        own = rank if rank in failures else ranks[0]
        cause = _cause(failures[own])
        cause_text = str(cause).strip().splitlines()
        detail = f"{type(cause).__name__}: {cause_text[0]}" if cause_text else type(cause).__name__
        return f"{type(exc).__name__}: ranks [{rank_ranges(ranks)}] failed; rank {own}: {detail}"
    if exc is not None:
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return (error or "exception").strip().splitlines()[0] if (error or "").strip() else "exception"
