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

import re
import statistics
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan

#: Spans that are not steps of a rank's operation.
_NOT_STEPS: Final = frozenset({semconv.SPAN_CHECKPOINT, semconv.SPAN_ASYNC_UPLOAD, semconv.SPAN_ASYNC_STAGING,
                               semconv.SPAN_STALL})  # fmt: skip
_OPERATION_SPANS: Final = frozenset(semconv.span_name(op) for op in semconv.OPERATIONS)
#: Steps that move the bytes: where their throughput is measured.
_IO_STEP: Final = semconv.IO_STEPS
#: The checkpointer's waits: for the other ranks (a step inside its write), for the previous checkpoint.
_WAITS: Final = frozenset(semconv.span_name(step) for step in semconv.WAIT_STEPS)
#: Where the upload side of an async save runs its steps: DCP's background save, the checkpoint process's write.
_UPLOAD_PARENTS: Final = _OPERATION_SPANS | {semconv.SPAN_ASYNC_UPLOAD}
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

    @property
    def work_s(self) -> float:
        """Time in its own steps, both sides of an async save: what makes a rank the straggler."""
        return self.busy_s + self.upload_busy_s

    @property
    def throughput_bps(self) -> float | None:
        return self.bytes / self.io_s if self.bytes and self.io_s > 0 else None


@dataclass
class Unfinished:
    """One rank of a checkpoint that never finished: where it was when its process ended or last reported."""

    rank: int
    step: str  # its innermost open step (semconv.STEP_NONE: between steps)
    seconds: float  # how long it had been there
    #: Why it ended: the signal's name, "exit", or None when no end was recorded at all (killed
    #: with SIGKILL, or the spans of its end were lost): only its stall reports say where it was.
    cause: str | None
    description: str  # "terminated by SIGTERM during write_data", or what its last stall report said
    waiting_in: str | None = None  # the collective (or wait step) it was waiting in for other ranks
    where: str | None = None  # the checkpoint process it was in, when not the rank itself
    stack: str | None = None  # the stack of the thread that was inside the call
    stalls: int = 0  # stall reports of this rank in this checkpoint

    @property
    def waiting(self) -> bool:
        """It was waiting for other ranks, not doing its own work."""
        return self.waiting_in is not None


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
            rank = _rank_of(span)
            if rank is None or span.name == semconv.SPAN_CHECKPOINT:
                continue
            ancestors, parent = [], by_id.get(span.parent_id)
            while parent is not None and parent.name != semconv.SPAN_CHECKPOINT:
                ancestors.append(parent)
                parent = by_id.get(parent.parent_id)
            yield rank, span, ancestors

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


def _rank_of(span: FileSpan) -> int | None:
    rank = span.attributes.get(semconv.ATTR_RANK)
    return int(rank) if isinstance(rank, int) else None


def checkpoints(spans: list[FileSpan]) -> list[Checkpoint]:
    """Every checkpoint operation in ``spans`` (DCP spans only), oldest first."""
    by_trace: dict[str, list[FileSpan]] = defaultdict(list)
    for span in spans:
        if span.name.startswith(semconv.SPAN_PREFIX) and span.attributes.get(semconv.ATTR_OPERATION):
            by_trace[span.trace_id].append(span)
    found = [_checkpoint(trace_id, group) for trace_id, group in by_trace.items()]
    return sorted((c for c in found if c.ranks or c.unfinished), key=lambda c: c.start_ns)


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
    failed: set[int] = set()
    first_error: str | None = None  # what the first rank to fail said
    for op_span in sorted((s for s in spans if is_operation_span(s)), key=lambda s: _rank_of(s) or 0):
        rank = _rank_of(op_span)
        if rank is None:
            continue
        subtree = _subtree(op_span, children)
        own_steps = [s for s in subtree if s.name not in _NOT_STEPS and s.name not in _OPERATION_SPANS]
        # Busy: in steps run right under the rank's operation span; the rest of it is waiting for
        # the other ranks. An async save's background save (under its upload) is the upload's side.
        # The checkpointer's waits are steps (the barrier inside the write): waiting all the same.
        waits = [s for s in own_steps if s.name in _WAITS]
        in_upload = {s.span_id for s in waits if _under(s, semconv.SPAN_ASYNC_UPLOAD, by_id, op_span)}
        caller_wait = sum(s.duration_s for s in waits if s.span_id not in in_upload)
        direct = sum(s.duration_s for s in children[op_span.span_id] if s.name not in _NOT_STEPS) - caller_wait
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
            bytes=max((int(s.attributes.get(bytes_key) or 0) for s in subtree
                       if s.name in _OPERATION_SPANS or s.name.removeprefix(semconv.SPAN_PREFIX) in _IO_STEP),
                      default=0),  # fmt: skip
            io_s=sum(s.duration_s for s in own_steps if s.name.removeprefix(semconv.SPAN_PREFIX) in _IO_STEP)
            - io_waits,
        )
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
        failed.update(int(r) for r in op_span.attributes.get(semconv.ATTR_FAILED_RANKS, []) or [])
        ranks.append(result)
    # The root cause: the step that raised first (a barrier fails only after the rank it waits for did).
    first = min(raised, key=lambda pair: (pair[1].end_ns, pair[0]), default=None)
    root_cause = (first[1].status_message or None) if first is not None else None
    cause_detail = (first[1].exception or root_cause) if first is not None else None
    return Checkpoint(
        unfinished=_unfinished(spans, {r.rank for r in ranks}),
        trace_id=trace_id,
        operation=operation,
        # Summary-only operation spans (detail="auto") leave what every rank shares to the root.
        checkpoint_id=str(next((s.attributes[semconv.ATTR_CHECKPOINT_ID] for s in spans
                                if semconv.ATTR_CHECKPOINT_ID in s.attributes), "")),  # fmt: skip
        start_ns=min(s.start_ns for s in spans),
        end_ns=max(s.end_ns for s in spans),
        ranks=ranks,
        steps=[StepResult(name, dict(by_rank)) for name, by_rank in steps.items()],
        failed_ranks=sorted(failed),
        # Where it started: a rank whose own step raised its own exception, not torch's report of another's.
        origins=sorted({rank for rank, step in raised if not step.status_message.startswith(WRAPPER)}),
        error=root_cause or first_error,
        spans=spans,
        error_detail=cause_detail or root_cause or first_error,
    )


def _unfinished(spans: list[FileSpan], ended: set[int]) -> list[Unfinished]:
    """The ranks whose part never ended: ended as their process ended (``dcp.interrupted``), or, with no
    operation span at all (``ended``: the ranks that have one), only reported stalled."""
    by_id = {s.span_id: s for s in spans}
    by_rank: dict[int, list[FileSpan]] = defaultdict(list)
    for span in spans:
        rank = _rank_of(span)
        if rank is not None:
            by_rank[rank].append(span)
    found = []
    for rank, mine in sorted(by_rank.items()):
        interrupted = [s for s in mine if s.attributes.get(semconv.ATTR_INTERRUPTED)]
        stalls = sorted((s for s in mine if s.name == semconv.SPAN_STALL), key=lambda s: s.start_ns)
        if interrupted:
            found.append(_interrupted_rank(rank, mine, interrupted, stalls, by_id))
        elif stalls and rank not in ended:
            found.append(_stalled_rank(rank, stalls))
    return sorted(found, key=lambda u: (u.waiting, u.rank))


def _interrupted_rank(rank: int, mine: list[FileSpan], interrupted: list[FileSpan], stalls: list[FileSpan],
                      by_id: dict[str, FileSpan]) -> Unfinished:  # fmt: skip
    # The innermost call it was in is the latest to start: a call nests in the one open when it began.
    inner = max(interrupted, key=lambda s: s.start_ns)
    parent = by_id.get(inner.parent_id)
    own_operation = inner.name in _OPERATION_SPANS and (parent is None or parent.name == semconv.SPAN_CHECKPOINT)
    step = semconv.STEP_NONE if own_operation else inner.name.removeprefix(semconv.SPAN_PREFIX)
    # Between steps: since the last of its steps ended.
    ended = {s.span_id for s in interrupted}
    last_end = max((s.end_ns for s in mine if s.parent_id == inner.span_id and s.span_id not in ended
                    and s.name != semconv.SPAN_STALL and s.end_ns <= inner.end_ns), default=inner.start_ns)  # fmt: skip
    stall = next((s for s in reversed(stalls) if s.parent_id == inner.span_id), None)  # reported on this call
    description = inner.status_message or inner.exception or "interrupted"
    waiting = _WAITING_IN.search(description)
    waiting_in = waiting.group(1) if waiting else _collective(stall)
    if waiting_in is None and step in semconv.WAIT_STEPS:
        waiting_in = step
    return Unfinished(rank=rank, step=step, seconds=(inner.end_ns - max(inner.start_ns, last_end)) / 1e9,
                      cause=str(inner.attributes[semconv.ATTR_INTERRUPTED]), description=description,
                      waiting_in=waiting_in, where=_where(stall) or _where_from(description),
                      stack=inner.stacktrace or _stack(stall), stalls=len(stalls))  # fmt: skip


def _stalled_rank(rank: int, stalls: list[FileSpan]) -> Unfinished:
    """A rank that never ended the operation, as its last stall report saw it (SIGKILL leaves no more)."""
    last = stalls[-1]
    step = str(last.attributes.get(semconv.ATTR_STEP, semconv.STEP_NONE))
    seconds = float(last.attributes.get(semconv.ATTR_STALL_SECONDS) or 0.0)
    where = "between steps" if step == semconv.STEP_NONE else f"in {step}"
    return Unfinished(rank=rank, step=step, seconds=seconds, cause=None,
                      description=f"no end recorded; last reported stalled {where} after {seconds:.1f} s",
                      waiting_in=_collective(last), where=_where(last), stack=_stack(last),
                      stalls=len(stalls))  # fmt: skip


#: How an interrupted call's description names the collective it waited in.
_WAITING_IN: Final = re.compile(r"waiting in (.+)$")
_IN_PROCESS: Final = re.compile(r" in the (.+? process)\b")


def _collective(stall: FileSpan | None) -> str | None:
    if stall is None or not stall.attributes.get(semconv.ATTR_STALL_COLLECTIVE):
        return None
    name, caller = stall.attributes[semconv.ATTR_STALL_COLLECTIVE], stall.attributes.get(semconv.ATTR_STALL_COLLECTIVE_CALLER)
    return f"{name} ({caller})" if caller else str(name)


def _where(stall: FileSpan | None) -> str | None:
    where = stall.attributes.get(semconv.ATTR_STALL_WHERE) if stall is not None else None
    return str(where) if where else None


def _where_from(description: str) -> str | None:
    found = _IN_PROCESS.search(description)
    return found.group(1) if found else None


def _stack(stall: FileSpan | None) -> str | None:
    stack = stall.attributes.get(semconv.ATTR_CODE_STACKTRACE) if stall is not None else None
    return stack if isinstance(stack, str) else None


def _from_summary(result: RankResult, op_span: FileSpan, steps: dict[str, dict[int, float]], is_async: bool) -> None:
    """A rank's busy, wait and I/O time from the summary on its operation span.

    The summary's step seconds cover both sides of an async save: what the
    caller's side did not spend (``busy_s``) is the upload's.
    """
    attrs = op_span.attributes
    names, seconds = attrs.get(semconv.ATTR_STEP_NAMES) or [], attrs.get(semconv.ATTR_STEP_SECONDS) or []
    wait = attrs.get(semconv.ATTR_WAIT_SECONDS)
    if isinstance(wait, (int, float)):
        result.wait_s = min(float(wait), op_span.duration_s)
        result.busy_s = op_span.duration_s - result.wait_s
    result.io_s = total = 0.0
    for name, value in zip(names, seconds, strict=False):  # a malformed file: what pairs up
        if isinstance(name, str) and isinstance(value, (int, float)):
            steps[name][result.rank] += float(value)
            total += float(value)
            if name in _IO_STEP:
                result.io_s += float(value)
            if name in semconv.STAGING_STEPS:
                result.staging_s += float(value)
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
