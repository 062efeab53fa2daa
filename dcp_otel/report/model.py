"""From spans to answers: per checkpoint operation, per rank and per step.

A checkpoint operation is one trace (dcp-otel puts every rank of a save,
async save or load into one). For each, this finds each rank's operation span,
its steps, the time it spent waiting for the others, its bytes and their
throughput, whether its async upload completed, and who failed. The straggler
is the rank that worked longest (its own steps: the others wait for it in the
collectives), with its skew against the median rank.

Every time is defined so that the parts add up. For a save or a load,
``busy_s + wait_s == duration_s``. An ``async_save`` has two sides, never mixed:
the caller's (``duration_s``, the time to return, is ``busy_s + wait_s``, with
``staging_s`` part of ``busy_s``) and the upload's (``upload_s`` from hand-off to
done, of which ``upload_busy_s`` in the background save's steps, of which
``io_s`` writing); bytes and throughput belong to the upload.

Usage::

    from dcp_otel.otlp_file import read_spans
    from dcp_otel.report.model import checkpoints

    for ckpt in checkpoints(read_spans(["out/traces"])):
        print(ckpt.operation, ckpt.straggler, ckpt.straggler_skew)
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan
from dcp_otel.report.unfinished import Unfinished, find_unfinished
from dcp_otel.report.values import (
    OPERATION_SPANS,
    as_list,
    as_number,
    collective_key,
    collective_label,
    count,
    interference_of,
    rank_of,
    where,
)

#: Spans that are not steps of a rank's operation.
_NOT_STEPS: Final = frozenset({semconv.SPAN_CHECKPOINT, semconv.SPAN_ASYNC_UPLOAD, semconv.SPAN_ASYNC_STAGING,
                               semconv.SPAN_STALL})  # fmt: skip
#: Steps that move the bytes: where their throughput is measured.
_IO_STEP: Final = semconv.IO_STEPS
#: The checkpointer's waits: for the other ranks (a step inside its write), for the previous checkpoint.
_WAITS: Final = frozenset(semconv.span_name(step) for step in semconv.WAIT_STEPS)
#: Where the upload side of an async save runs its steps: DCP's background save, the checkpoint process's write.
_UPLOAD_PARENTS: Final = OPERATION_SPANS | {semconv.SPAN_ASYNC_UPLOAD}
#: Steps whose error is a rank's own failure (not one it learnt from the others).
_RAISING_STEPS: Final = semconv.COLLECTIVE_STEPS | semconv.CHECKPOINTER_STEPS
#: A skew below this is noise, not a straggler.
STRAGGLER_SKEW: Final = 1.5
#: How torch's report of the failed ranks, which every rank raises, begins.
WRAPPER: Final = "CheckpointException"


@dataclass
class RankResult:
    """One rank's part of a checkpoint operation."""

    rank: int
    duration_s: float  # its operation span (an async save: the time to return)
    busy_s: float  # in its own steps (an async save: the caller's steps only)
    wait_s: float  # the rest of duration_s: waiting for other ranks
    bytes: int
    io_s: float  # in write_data / read_data (an async save: in the upload)
    upload: str | None = None  # async save only: "completed", "failed" or "unfinished"
    upload_s: float = 0.0  # async save: from hand-off to the upload's end
    upload_busy_s: float = 0.0  # async save: in the background save's steps (part of upload_s)
    staging_s: float = 0.0  # async save: copying the state dict for the upload (part of busy_s)
    error: str | None = None  # the first error among this rank's spans
    collective_s: float = 0.0  # of wait_s, in DCP's collectives (dcp.collective.* spans, or the summary)
    where: str = ""  # the host it ran on (and its pod or container), from its resource: values.where
    #: What its background work (an async save's upload) did to the training steps it overlapped, where measured:
    #: (steps, their usual seconds, their mean over that, seconds lost beyond it: 0 within noise).
    interference: tuple[int, float, float, float] | None = None

    @property
    def work_s(self) -> float:
        """Time in its own steps, both sides of an async save: what makes a rank the straggler."""
        return self.busy_s + self.upload_busy_s

    @property
    def throughput_bps(self) -> float | None:
        return self.bytes / self.io_s if self.bytes and self.io_s > 0 else None


@dataclass
class StepResult:
    """One step across ranks (durations summed when a rank ran it more than once)."""

    name: str
    by_rank: dict[int, float]

    @property
    def slowest_rank(self) -> int:
        return max(self.by_rank, key=lambda r: (self.by_rank[r], -r))

    @property
    def median_s(self) -> float:
        return statistics.median(self.by_rank.values())

    @property
    def skew(self) -> float:
        median = self.median_s
        return self.by_rank[self.slowest_rank] / median if median > 0 else 1.0


@dataclass
class CollectiveResult:
    """One of DCP's collectives across the ranks that sent their spans (``gather_object`` of ``plan``)."""

    method: str  # gather_object, scatter_object, broadcast_object, all_gather_object, barrier
    step: str  # torch's step: plan, write, read ("" when DCP called it directly)
    by_rank: dict[int, float]
    moved_bytes: int  # the most any rank pickled or unpickled in it: the coordinator's side, all ranks' objects

    @property
    def name(self) -> str:
        return collective_label(self.method, self.step)

    @property
    def longest_rank(self) -> int:
        return max(self.by_rank, key=lambda r: (self.by_rank[r], -r))

    @property
    def median_s(self) -> float:
        return statistics.median(self.by_rank.values())


_SILENT_SHOWN = 8


@dataclass
class Checkpoint:
    """One checkpoint operation: one trace."""

    trace_id: str
    operation: str
    checkpoint_id: str
    start_ns: int
    end_ns: int
    ranks: list[RankResult]
    steps: list[StepResult]
    failed_ranks: list[int]
    error: str | None  # one line: the failing rank's own exception (not torch's wrapper), if found
    spans: list[FileSpan] = field(repr=False, default_factory=list)
    error_detail: str | None = None  # that exception in full, from its span's exception event
    #: The ranks that never finished it (empty: it finished, well or not), stuck ones first.
    unfinished: list[Unfinished] = field(default_factory=list)
    #: The ranks where its failure started: their own step raised their own exception.
    origins: list[int] = field(default_factory=list)
    #: Ranks whose own failure was a checkpointer's wait (its barrier) for an origin.
    failed_waiting: list[int] = field(default_factory=list)
    #: DCP's collectives, in the order they ran (from the ranks that sent step spans).
    collectives: list[CollectiveResult] = field(default_factory=list)
    #: The ranks whose failure one of DCP's collectives raised (a peer gone, a timeout), not their own code.
    failed_in_collective: list[int] = field(default_factory=list)
    #: The first collective that raised, as :attr:`CollectiveResult.name` says it (``gather_object (write)``).
    failing_collective: str | None = None
    #: Ranks of the job that sent no operation span for it (a killed process exports nothing); known only
    #: for a checkpoint of the whole world, whose ranks are 0..world_size-1.
    silent_ranks: list[int] = field(default_factory=list)
    #: The training step it is of (``dcp.training.step``), where its spans say one.
    training_step: int | None = None

    @property
    def title(self) -> str:
        """``save /ckpt/step-1000 (step 1000)``: how the report names it."""
        step = f" (step {self.training_step})" if self.training_step is not None else ""
        return f"{self.operation} {self.checkpoint_id or '(no id)'}{step}"

    def lost_peer(self) -> str | None:
        """Said when ranks failed in DCP's collectives and none in its own code: which peer they lost.

        ``"rank 0, 1 failed in DCP's gather_object (write), waiting for a peer that went away; rank 2 sent
        no spans: it likely started there (a killed process: see its log)"``
        """
        if self.origins or not self.failed_in_collective:
            return None
        where = f"DCP's {self.failing_collective}" if self.failing_collective else "DCP's collectives"
        ranks = ", ".join(map(str, self.failed_in_collective))
        if not self.silent_ranks:
            return f"rank {ranks} failed in {where}: a peer went away or the collective timed out"
        silent = ", ".join(map(str, self.silent_ranks[:_SILENT_SHOWN]))
        more = f" and {len(self.silent_ranks) - _SILENT_SHOWN} more" if len(self.silent_ranks) > _SILENT_SHOWN else ""
        return (f"rank {ranks} failed in {where}, waiting for a peer that went away; rank {silent}{more} sent no "
                "spans: it likely started there (a killed process: see its log)")

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def is_unfinished(self) -> bool:
        """Some rank never finished it: its process ended (or was killed) while it was open."""
        return bool(self.unfinished)

    def rank_spans(self) -> Iterator[tuple[int, FileSpan, list[FileSpan]]]:
        """``(rank, span, ancestors)`` for every span of a rank, oldest first; ``ancestors``
        runs from the parent up to, not including, the checkpoint's root."""
        by_id = {s.span_id: s for s in self.spans}
        for span in sorted(self.spans, key=lambda s: s.start_ns):
            rank = rank_of(span)
            if rank is None or span.name == semconv.SPAN_CHECKPOINT:
                continue
            ancestors, parent = [], by_id.get(span.parent_id)
            while parent is not None and parent.name != semconv.SPAN_CHECKPOINT:
                ancestors.append(parent)
                parent = by_id.get(parent.parent_id)
            yield rank, span, ancestors

    @property
    def interference(self) -> tuple[int, tuple[int, float, float, float]] | None:
        """The rank whose training steps lost most to its background work, and what it lost (``None``: none measured)."""
        measured = [(r.rank, r.interference) for r in self.ranks if r.interference is not None]
        return max(measured, key=lambda pair: (pair[1][3], pair[1][2], -pair[0]), default=None)

    @property
    def interference_s(self) -> float:
        """Seconds lost to its background work, summed over its ranks."""
        return sum(r.interference[3] for r in self.ranks if r.interference is not None)

    @property
    def straggler(self) -> int | None:
        """The rank busy longest, if it stands out (``STRAGGLER_SKEW`` times the median), else ``None``."""
        if len(self.ranks) < 2:
            return None
        slowest = max(self.ranks, key=lambda r: (r.work_s, -r.rank))
        return slowest.rank if self.straggler_skew >= STRAGGLER_SKEW else None

    @property
    def straggler_skew(self) -> float:
        busy = [r.work_s for r in self.ranks]
        median = statistics.median(busy) if busy else 0.0
        return max(busy) / median if busy and median > 0 else 1.0


def checkpoints(spans: list[FileSpan]) -> list[Checkpoint]:
    """Every checkpoint operation in ``spans`` (DCP spans only), oldest first."""
    by_trace: dict[str, list[FileSpan]] = defaultdict(list)
    for span in spans:
        if span.name.startswith(semconv.SPAN_PREFIX) and span.attributes.get(semconv.ATTR_OPERATION):
            by_trace[span.trace_id].append(span)
    found = [_checkpoint(trace_id, group) for trace_id, group in by_trace.items()]
    return sorted((c for c in found if c.ranks or c.unfinished), key=lambda c: c.start_ns)


def _origins(raised: list[tuple[int, FileSpan]]) -> tuple[list[int], list[int]]:
    """The ranks where a failure started (their own exception), and those that failed waiting for them."""
    own = {rank: step for rank, step in raised if not step.status_message.startswith(WRAPPER)}
    waiting = {rank for rank, step in own.items() if step.name in _WAITS}
    if len(waiting) == len(own):  # only waits failed (a timeout): they are where it started
        waiting = set()
    return sorted(set(own) - waiting), sorted(waiting)


def _checkpoint(trace_id: str, spans: list[FileSpan]) -> Checkpoint:
    operation = str(spans[0].attributes[semconv.ATTR_OPERATION])
    op_name = semconv.span_name(operation)
    by_id = {s.span_id: s for s in spans}
    children: dict[str, list[FileSpan]] = defaultdict(list)
    for span in spans:
        children[span.parent_id].append(span)

    def is_operation_span(span: FileSpan) -> bool:
        # The rank's own operation span: not the background save under an async upload.
        parent = by_id.get(span.parent_id)
        return span.name == op_name and (parent is None or parent.name == semconv.SPAN_CHECKPOINT)

    is_async = operation in semconv.ASYNC_OPERATIONS
    bytes_key = semconv.ATTR_READ_BYTES if operation in semconv.LOAD_OPERATIONS else semconv.ATTR_WRITTEN_BYTES
    raised: list[tuple[int, FileSpan]] = []  # (rank, the step that raised) of every rank
    ranks: list[RankResult] = []
    steps: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    collectives: dict[tuple[str, str], CollectiveResult] = {}
    failed: set[int] = set()
    in_collective: list[int] = []
    first_error: str | None = None  # what the first rank to fail said
    for op_span in sorted((s for s in spans if is_operation_span(s)), key=lambda s: (rank_of(s) or 0, s.start_ns)):
        rank = rank_of(op_span)
        if rank is None or any(r.rank == rank for r in ranks[-1:]):  # (sorted by rank) a second one: the first counts
            continue
        subtree = _subtree(op_span, children)
        own_collectives = [s for s in subtree if semconv.is_collective_span(s.name)]
        own_steps = [s for s in subtree if s.name not in _NOT_STEPS and s.name not in OPERATION_SPANS
                     and not semconv.is_collective_span(s.name)]  # fmt: skip
        # Busy: in steps run right under the rank's operation span; the rest of it is waiting for
        # the other ranks. An async save's background save (under its upload) is the upload's side.
        # The checkpointer's waits are steps (the barrier inside the write): waiting all the same.
        waits = [s for s in own_steps if s.name in _WAITS]
        in_upload = {s.span_id for s in waits if _under(s, semconv.SPAN_ASYNC_UPLOAD, by_id, op_span)}
        caller_wait = sum(s.duration_s for s in waits if s.span_id not in in_upload)
        direct = sum(s.duration_s for s in children[op_span.span_id]
                     if s.name not in _NOT_STEPS and not semconv.is_collective_span(s.name)) - caller_wait  # fmt: skip
        upload_busy = sum(s.duration_s for s in own_steps if s.parent_id != op_span.span_id
                          and by_id[s.parent_id].name in _UPLOAD_PARENTS)  # fmt: skip
        upload_busy -= sum(s.duration_s for s in waits if s.span_id in in_upload)
        io_waits = sum(s.duration_s for s in waits
                       if by_id[s.parent_id].name.removeprefix(semconv.SPAN_PREFIX) in _IO_STEP)  # fmt: skip
        result = RankResult(
            rank=rank,
            duration_s=op_span.duration_s,
            busy_s=max(0.0, min(direct, op_span.duration_s)),
            wait_s=max(0.0, op_span.duration_s - direct),
            upload_busy_s=max(0.0, upload_busy),
            staging_s=sum(s.duration_s for s in children[op_span.span_id]
                          if s.name.removeprefix(semconv.SPAN_PREFIX) in semconv.STAGING_STEPS),  # fmt: skip
            # On the operation span; for an async save, on its background save or the checkpoint process's write.
            bytes=max((count(s, bytes_key) for s in subtree
                       if s.name in OPERATION_SPANS or s.name.removeprefix(semconv.SPAN_PREFIX) in _IO_STEP),
                      default=0),  # fmt: skip
            io_s=sum(s.duration_s for s in own_steps if s.name.removeprefix(semconv.SPAN_PREFIX) in _IO_STEP)
            - io_waits,
            collective_s=sum(s.duration_s for s in own_collectives if s.parent_id == op_span.span_id),
            where=where(op_span),
            interference=interference_of(op_span),
        )
        for span in sorted(own_collectives, key=lambda s: s.start_ns):  # the coordinator's first: in their order
            _add_collective(collectives, rank, span)
        if op_span.attributes.get(semconv.ATTR_DETAIL) == semconv.DETAIL_SUMMARY:
            _from_summary(result, op_span, steps, is_async)  # no step spans (detail="auto")
        for step in own_steps:
            steps[step.name.removeprefix(semconv.SPAN_PREFIX)][rank] += step.duration_s
        uploads = [s for s in subtree if s.name == semconv.SPAN_ASYNC_UPLOAD]
        if is_async:
            result.upload = "unfinished" if not uploads else "failed" if uploads[0].error else "completed"
            result.upload_s = uploads[0].duration_s if uploads else 0.0
        errors = sorted((s for s in subtree if s.error), key=lambda s: s.end_ns)
        if errors:
            result.error = errors[0].status_message or f"{errors[0].name} failed"
            first_error = first_error or result.error
        raising = [s for s in errors if s.name.removeprefix(semconv.SPAN_PREFIX) in _RAISING_STEPS]
        if raising:
            failed.add(rank)
            raised.append((rank, raising[0]))
        failed.update(int(r) for r in map(as_number, as_list(op_span.attributes.get(semconv.ATTR_FAILED_RANKS))) if r is not None)
        if op_span.attributes.get(semconv.ATTR_FAILED_IN_COLLECTIVE):
            failed.add(rank)
            in_collective.append(rank)
        ranks.append(result)
    # The root cause: the step that raised first (a barrier fails only after the rank it waits for did).
    first = min(raised, key=lambda pair: (pair[1].end_ns, pair[0]), default=None)
    root_cause = (first[1].status_message or None) if first is not None else None
    cause_detail = (first[1].exception or root_cause) if first is not None else None
    raised_in = min((s for s in spans if s.error and semconv.is_collective_span(s.name)), key=lambda s: s.end_ns,
                    default=None)  # fmt: skip
    unfinished = find_unfinished(spans, {r.rank for r in ranks})
    return Checkpoint(
        unfinished=unfinished,
        trace_id=trace_id,
        operation=operation,
        # Summary-only operation spans (detail="auto") leave what every rank shares to the root.
        checkpoint_id=str(next((s.attributes[semconv.ATTR_CHECKPOINT_ID] for s in spans
                                if semconv.ATTR_CHECKPOINT_ID in s.attributes), "")),  # fmt: skip
        training_step=next((int(v) for s in spans if (v := as_number(s.attributes.get(semconv.ATTR_TRAINING_STEP)))
                            is not None and v >= 0 and v == int(v)), None),  # fmt: skip
        start_ns=min(s.start_ns for s in spans),
        end_ns=max(s.end_ns for s in spans),
        ranks=ranks,
        steps=[StepResult(name, dict(by_rank)) for name, by_rank in steps.items()],
        failed_ranks=sorted(failed),
        # Where it started: a rank whose own step raised its own exception, not torch's report of another's,
        # nor a checkpointer's barrier that failed waiting for it.
        origins=_origins(raised)[0],
        failed_waiting=_origins(raised)[1],
        collectives=list(collectives.values()),
        failed_in_collective=in_collective,
        failing_collective=collective_label(*collective_key(raised_in)) if raised_in is not None else None,
        silent_ranks=_silent(spans, is_operation_span, {r.rank for r in ranks} | {u.rank for u in unfinished}),
        error=root_cause or first_error,
        spans=spans,
        error_detail=cause_detail or root_cause or first_error,
    )


def _silent(spans: list[FileSpan], is_operation_span: Callable[[FileSpan], bool], heard: set[int]) -> list[int]:
    """The world's ranks that sent nothing of a checkpoint every rank took part in (each rank's group rank is its
    global rank: the default group); a sub-group's checkpoint does not say which ranks it had."""
    ops = [s for s in spans if is_operation_span(s)]
    if not ops or any(s.attributes.get(semconv.ATTR_GROUP_RANK) != s.attributes.get(semconv.ATTR_RANK) for s in ops):
        return []
    world = max(count(s, semconv.ATTR_WORLD_SIZE) for s in ops)
    return [rank for rank in range(world) if rank not in heard]


def _add_collective(found: dict[tuple[str, str], CollectiveResult], rank: int, span: FileSpan) -> None:
    method, step = collective_key(span)
    result = found.setdefault((method, step), CollectiveResult(method, step, {}, 0))
    result.by_rank[rank] = result.by_rank.get(rank, 0.0) + span.duration_s
    moved = max(count(span, semconv.ATTR_COLLECTIVE_SENT_BYTES), count(span, semconv.ATTR_COLLECTIVE_RECEIVED_BYTES))
    result.moved_bytes = max(result.moved_bytes, moved)


def _from_summary(result: RankResult, op_span: FileSpan, steps: dict[str, dict[int, float]], is_async: bool) -> None:
    """A rank's busy, wait and I/O time from the summary on its operation span.

    The summary's step seconds cover both sides of an async save: what the
    caller's side did not spend (``busy_s``) is the upload's.
    """
    attrs = op_span.attributes
    names, seconds = as_list(attrs.get(semconv.ATTR_STEP_NAMES)), as_list(attrs.get(semconv.ATTR_STEP_SECONDS))
    wait = as_number(attrs.get(semconv.ATTR_WAIT_SECONDS))
    if wait is not None:
        result.wait_s = min(wait, op_span.duration_s)
        result.busy_s = op_span.duration_s - result.wait_s
    collective = as_number(attrs.get(semconv.ATTR_COLLECTIVE_SECONDS))
    if collective is not None:
        result.collective_s = min(collective, result.wait_s)
    result.io_s = total = 0.0
    for name, value in zip(names, seconds, strict=False):  # a malformed file: what pairs up
        number = as_number(value)
        if isinstance(name, str) and number is not None:
            steps[name][result.rank] += number
            total += number
            if name in _IO_STEP:
                result.io_s += number
            if name in semconv.STAGING_STEPS:
                result.staging_s += number
    if is_async:
        result.upload_busy_s = max(0.0, total - result.busy_s)


def _under(span: FileSpan, name: str, by_id: dict[str, FileSpan], stop: FileSpan) -> bool:
    """Whether ``span`` has an ancestor called ``name`` below ``stop``."""
    parent = by_id.get(span.parent_id)
    while parent is not None and parent is not stop:
        if parent.name == name:
            return True
        parent = by_id.get(parent.parent_id)
    return False


def _subtree(root: FileSpan, children: dict[str, list[FileSpan]]) -> list[FileSpan]:
    found, todo = [], [root]
    while todo:
        span = todo.pop()
        found.append(span)
        todo.extend(children[span.span_id])
    return found
