"""The answer first: what failed, who straggled across the run, and how each kind of operation trends.

A run's report can hold hundreds of checkpoint operations on dozens of ranks.
Before any detail, a person wants: how many operations, which failed (which
checkpoint, which rank, that rank's own exception in full), whether one rank
is slow across the run (not just once), and whether checkpoints are getting
slower. :func:`summarize` computes that; :func:`worst_first` orders the
details so the ones worth reading come first.

Usage::

    summary = summarize(checkpoints(spans))
    summary.straggler       # RunStraggler(rank=2, slowest_in=7, of=7, median_skew=25.3)
    [t.operation for t in summary.trends]
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from dcp_otel import semconv
from dcp_otel.report.model import Checkpoint
from dcp_otel.report.unfinished import Unfinished
from dcp_otel.tracing.failures import rank_ranges

#: A rank is the run's straggler when it was the straggler of at least this share of the checkpoints.
RUN_STRAGGLER_SHARE = 0.5
#: Failures a summary lists one by one (the rest are counted).
FAILURES_SHOWN = 5
#: Checkpoints shown in detail by default, the worst first (the summary covers all of them).
DETAIL_LIMIT = 10


@dataclass(frozen=True)
class Failure:
    """One failed checkpoint operation."""

    index: int  # its position in the run, oldest first
    operation: str
    checkpoint_id: str
    ranks: list[int]
    cause: str  # the failing rank's own exception, in full when the spans carry it
    lost_peer: str | None = None  # :meth:`Checkpoint.lost_peer`: failed in DCP's collectives, a peer gone


@dataclass(frozen=True)
class UnfinishedCheckpoint:
    """A checkpoint operation some rank never finished (a hung job that was stopped, or killed)."""

    index: int  # its position in the run, oldest first
    operation: str
    checkpoint_id: str
    ranks: list[Unfinished]  # stuck ranks first, then those that were waiting for them

    @property
    def stuck(self) -> list[Unfinished]:
        """The ranks in their own work (a step, not waiting for others): where to look."""
        return [u for u in self.ranks if not u.waiting]

    @property
    def waiting(self) -> list[Unfinished]:
        return [u for u in self.ranks if u.waiting]

    def headline(self) -> str:
        """``"rank 1 never finished write_data (14.1 s, terminated by SIGTERM); ranks 0,2-7 waited in ..."``."""
        parts = [f"rank {u.rank} never finished {_where(u)} ({u.seconds:.1f} s, {_cause(u)})" for u in self.stuck[:3]]
        if len(self.stuck) > 3:
            parts.append(f"{len(self.stuck) - 3} more ranks never finished their own steps")
        by_collective: dict[str, list[int]] = {}
        for u in self.waiting:
            by_collective.setdefault(u.waiting_in or "?", []).append(u.rank)
        verb = "waited for " + ("it" if len(self.stuck) == 1 else "them") if self.stuck else "waited"
        for collective, ranks in by_collective.items():
            label = "rank" if len(ranks) == 1 else "ranks"
            parts.append(f"{label} {rank_ranges(sorted(ranks))} {verb} in {collective}")
        return "; ".join(parts)


def _where(u: Unfinished) -> str:
    step = "between steps" if u.step == semconv.STEP_NONE else u.step
    return f"{step} in the {u.where}" if u.where else step


def _cause(u: Unfinished) -> str:
    if u.cause is None:
        return "no end recorded"
    return "interrupted at exit" if u.cause == semconv.INTERRUPTED_AT_EXIT else f"terminated by {u.cause}"


@dataclass(frozen=True)
class RunStraggler:
    """A rank that was the straggler of many checkpoints."""

    rank: int
    slowest_in: int
    of: int
    median_skew: float  # its work against the median rank's, over the checkpoints it straggled


@dataclass(frozen=True)
class Trend:
    """One operation kind over the run, oldest first."""

    operation: str
    durations_s: list[float]
    throughputs_bps: list[float | None]  # all ranks' bytes over the checkpoint's duration
    failed: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.durations_s)

    def change(self) -> float | None:
        """The last fifth's median duration over the first fifth's (1.5: 50% slower), with 5 or more."""
        n = len(self.durations_s)
        if n < 5:
            return None
        k = max(1, n // 5)
        first, last = statistics.median(self.durations_s[:k]), statistics.median(self.durations_s[-k:])
        return last / first if first > 0 else None


@dataclass(frozen=True)
class Summary:
    operations: int
    ranks: int
    by_operation: dict[str, int]
    failures: list[Failure]  # finished, with an error (the unfinished ones are below)
    straggler: RunStraggler | None
    trends: list[Trend]  # of the finished checkpoints
    unfinished: list[UnfinishedCheckpoint]
    #: Ranks of the world that sent no span of any checkpoint (a killed process, a lost file).
    silent: list[int] = field(default_factory=list)

    @property
    def ranks_said(self) -> str:
        """``"4"``, or ``"3 of 4"`` when ranks of the world sent nothing."""
        return f"{self.ranks} of {self.ranks + len(self.silent)}" if self.silent else str(self.ranks)

    @property
    def silent_said(self) -> str | None:
        """``"no spans from rank 1: ..."`` (``None``: every rank sent spans)."""
        if not self.silent:
            return None
        return f"no spans from rank {rank_ranges(self.silent)}: a process killed before it exported, or a file not given"

    @property
    def kinds(self) -> str:
        """``"2 save, 2 async_save, 1 load"``."""
        return ", ".join(f"{n} {op}" for op, n in self.by_operation.items())


def summarize(checkpoints: list[Checkpoint]) -> Summary:
    """The run's summary (``checkpoints`` oldest first, as :func:`~dcp_otel.report.model.checkpoints` gives them)."""
    failures = [
        Failure(i, c.operation, c.checkpoint_id, c.failed_ranks, c.error_detail or c.error or "failed", c.lost_peer())
        for i, c in enumerate(checkpoints)
        if c.error and not c.is_unfinished
    ]
    unfinished = [UnfinishedCheckpoint(i, c.operation, c.checkpoint_id, c.unfinished)
                  for i, c in enumerate(checkpoints) if c.is_unfinished]  # fmt: skip
    # (An unfinished checkpoint's slowest rank is the one that hung: the unfinished list says so.)
    multi_rank = [c for c in checkpoints if len(c.ranks) > 1 and not c.is_unfinished]
    stragglers = Counter(c.straggler for c in multi_rank if c.straggler is not None)
    straggler = None
    if stragglers:
        rank, count = max(stragglers.items(), key=lambda item: (item[1], -item[0]))
        if count >= RUN_STRAGGLER_SHARE * len(multi_rank):
            skews = [c.straggler_skew for c in multi_rank if c.straggler == rank]
            straggler = RunStraggler(rank, count, len(multi_rank), statistics.median(skews))
    trends = []
    finished = [c for c in checkpoints if not c.is_unfinished]  # (an unfinished one has no duration)
    for operation in dict.fromkeys(c.operation for c in finished):
        mine = [c for c in finished if c.operation == operation]
        trends.append(Trend(
            operation,
            [c.duration_s for c in mine],
            [sum(r.bytes for r in c.ranks) / c.duration_s if c.duration_s > 0 and any(r.bytes for r in c.ranks)
             else None for c in mine],
            sum(1 for c in mine if c.error),
        ))  # fmt: skip
    return Summary(
        operations=len(checkpoints),
        ranks=len({r.rank for c in checkpoints for r in c.ranks}),
        silent=sorted({r for c in checkpoints for r in c.silent_ranks} - {r.rank for c in checkpoints for r in c.ranks}),
        by_operation=dict(Counter(c.operation for c in checkpoints)),
        failures=failures,
        straggler=straggler,
        trends=trends,
        unfinished=unfinished,
    )


def worst_first(checkpoints: list[Checkpoint]) -> list[int]:
    """Indices of ``checkpoints``, the ones worth reading first: unfinished, failed, then slowest against
    their kind's median."""
    medians = {
        op: statistics.median(c.duration_s for c in checkpoints if c.operation == op)
        for op in {c.operation for c in checkpoints}
    }

    def badness(i: int) -> tuple[int, float, int]:
        c = checkpoints[i]
        median = medians[c.operation]
        return (0 if c.is_unfinished else 1 if c.error else 2, -(c.duration_s / median if median > 0 else 1.0), i)

    return sorted(range(len(checkpoints)), key=badness)


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 24) -> str:
    """``values`` as a line of block characters, resampled to at most ``width`` (bucket medians)."""
    if not values:
        return ""
    if len(values) > width:
        step = len(values) / width
        values = [statistics.median(values[int(i * step) : max(int(i * step) + 1, int((i + 1) * step))])
                  for i in range(width)]  # fmt: skip
    low, high = min(values), max(values)
    span = high - low
    return "".join(SPARKS[int((v - low) / span * (len(SPARKS) - 1)) if span > 0 else 0] for v in values)
