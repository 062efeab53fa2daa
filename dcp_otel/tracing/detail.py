"""How much of a finished operation a rank exports: every step span, or a summary.

Decided by each rank on its own, after the operation, from what it recorded:
no collective, no message to any other rank.

* ``full``: every step span of every rank (one checkpoint on N ranks is about
  8N spans in one trace).
* ``auto``: every rank exports its operation span (and an async save's upload
  span) carrying a compact summary of its steps: each step's seconds, the
  bytes and throughput, the time it waited for the others. Step spans come
  only from the ranks worth reading, and a checkpoint's expected step spans
  stay within ``span_budget`` whatever the job does:

  - every rank of an operation the process ended while it was open (a job
    stopped with SIGTERM): where each rank was is the answer;
  - the coordinator (group rank 0), whose steps include the global plan and
    the metadata;
  - a rank whose own call failed; a ``CheckpointException`` names every failed
    rank on every rank, so each knows its place in that list, and only the
    first ``budget / steps`` failed ranks export steps (a mass failure stays
    within the budget);
  - a *candidate*, if it is in this checkpoint's candidate sample (below). A
    rank busy (its operation minus its waiting) for less than
    :data:`FLOOR_S` is never one: the others cannot have waited a second for
    it. Above the floor, a rank that has :data:`MIN_HISTORY` earlier
    operations of the kind is a candidate when it was busy more than
    :data:`SLOW_FACTOR` times its own median of them (``slow``); a rank
    without that history yet, when it waited in the collectives for at most
    :data:`STRAGGLER_WAIT_SHARE` of its operation (``straggler``: the
    collectives release every rank when the last one arrives, so the rank
    that arrived last waited least);
  - a deterministic 1-in-K sample of ranks (``sampled``), drawn afresh for
    every checkpoint from its trace id.

The budget, minus the coordinator's steps, is split: :data:`SAMPLE_SHARE` of it
for the 1-in-K sample, K = ceil(world x steps / (that share)); the rest caps the
candidates, C = that rest / steps ranks, each candidate exporting with
probability min(1, C / world). A rank cannot tell "I was slow and the others
waited for me" from "we were all equally slow" without asking them, and we add
no collective; so a slowdown of the whole job (a shared filesystem at half
speed) makes every rank a candidate, and the cap keeps it within the budget. In
a balanced job that has its history, nobody is a candidate: only the
coordinator and the sample export steps, about a quarter of the budget. A lone
straggler is certain to be detailed while C >= world (the default budget of
2,000 and 8-step ranks: up to 186 ranks), and with probability C / world
beyond; its summary names it on every checkpoint.

Usage::

    policy = DetailPolicy("auto", span_budget=2000)
    detailed, reason = policy.decide(op, step_calls, op_call)
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import deque
from typing import Final, Literal

from dcp_otel import semconv
from dcp_otel.tracing.records import Call, Operation

DetailMode = Literal["full", "auto"]
DETAIL_MODES: Final = ("full", "auto")
#: Busy for less than this, a rank cannot have held the others up for a second: never a candidate.
FLOOR_S: Final = 1.0
#: A rank without history that waited for at most this share of its operation was waited for.
STRAGGLER_WAIT_SHARE: Final = 0.25
#: A rank busy for more than this many times its own recent median was slow.
SLOW_FACTOR: Final = 2.0
#: Operations of one kind remembered per rank for its median, and the fewest it needs.
HISTORY: Final = 16
MIN_HISTORY: Final = 3
#: The budget's share (after the coordinator's steps) for the 1-in-K sample; the rest caps the candidates.
SAMPLE_SHARE: Final = 0.25

REASON_FULL: Final = "full"
REASON_COORDINATOR: Final = "coordinator"
REASON_FAILED: Final = "failed"
REASON_INTERRUPTED: Final = "interrupted"  # the process ended while it was open (SIGTERM, exit)
REASON_STRAGGLER: Final = "straggler"
REASON_SLOW: Final = "slow"
REASON_SAMPLED: Final = "sampled"
REASON_SUMMARY: Final = "summary"  # not detailed: the operation span's summary only


def _room(steps_per_rank: int, budget: int) -> float:
    """Step spans left once the coordinator's are counted (they are always exported)."""
    return max(1.0, budget - max(1, steps_per_rank))


def sample_every(world_size: int, steps_per_rank: int, budget: int) -> int:
    """K of the 1-in-K sample: how many ranks share one detailed rank."""
    share = max(1.0, _room(steps_per_rank, budget) * SAMPLE_SHARE)
    return max(1, math.ceil(world_size * max(1, steps_per_rank) / share))


def candidate_cap(steps_per_rank: int, budget: int) -> int:
    """C: how many candidate ranks one checkpoint's budget holds (at least one)."""
    rest = _room(steps_per_rank, budget) * (1.0 - SAMPLE_SHARE)
    return max(1, math.floor(rest / max(1, steps_per_rank)))


def _position(trace_id: int, rank: int, salt: str) -> int:
    digest = hashlib.blake2b(f"{trace_id:032x}/{rank}{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def in_sample(trace_id: int, rank: int, every: int) -> bool:
    """Whether ``rank`` is in this checkpoint's 1-in-``every`` sample (the same answer on every rank)."""
    return every <= 1 or _position(trace_id, rank, "") % every == 0


def in_candidate_sample(trace_id: int, rank: int, cap: int, world_size: int) -> bool:
    """Whether a candidate ``rank`` exports its steps: probability min(1, cap / world), drawn from the trace id
    independently of :func:`in_sample`, so every rank (and a test) computes the same answer."""
    if cap >= world_size:
        return True
    return _position(trace_id, rank, "/candidate") % world_size < cap


class DetailPolicy:
    """One process's detail decisions; only the builder thread calls :meth:`decide`."""

    def __init__(self, mode: DetailMode, span_budget: int) -> None:
        self.mode = mode
        self.span_budget = span_budget
        self._busy: dict[str, deque[float]] = {}

    def decide(self, op: Operation, steps: list[Call], op_call: Call | None, collectives: int = 0) -> tuple[bool, str]:
        """(whether this rank exports its step spans, and its ``collectives`` collective spans, why).

        The budget counts both: a rank's spans below its operation span.
        """
        spans = len(steps) + collectives
        busy_s = _busy_s(op, op_call, steps)
        history = self._busy.setdefault(op.name, deque(maxlen=HISTORY))
        median = statistics.median(history) if len(history) >= MIN_HISTORY else None
        history.append(busy_s)
        if self.mode == "full":
            return True, REASON_FULL
        if op.interrupted is not None:  # where each rank was when the job was stopped: every rank says
            return True, REASON_INTERRUPTED
        if op.coordinator or (op.adopted and op.rank == 0):  # adopted: continued in the async save process
            return True, REASON_COORDINATOR
        if self._failed_here(op, steps, op_call, spans):
            return True, REASON_FAILED
        candidate = _candidate(op, op_call, busy_s, median)
        if candidate is not None and in_candidate_sample(
            op.trace_id, op.rank, candidate_cap(spans, self.span_budget), op.world_size
        ):
            return True, candidate
        if in_sample(op.trace_id, op.rank, sample_every(op.world_size, spans, self.span_budget)):
            return True, REASON_SAMPLED
        return False, REASON_SUMMARY

    def _failed_here(self, op: Operation, steps: list[Call], op_call: Call | None, steps_per_rank: int) -> bool:
        """A call of this rank failed; of a multi-rank failure, only the first failed ranks say so. A collective
        that raised (a peer gone: every other rank sees the same) is not a failure of this rank's own."""
        calls = steps if op_call is None else [*steps, op_call]
        failures = [call.failure for call in calls
                    if call.failure is not None and not call.inferred and not call.failure.in_collective]  # fmt: skip
        if not failures:
            return False
        ranks = next((f.failed_ranks for f in failures if f.failed_ranks), None)
        if ranks is None:  # this rank's own exception, not torch's report of everyone's
            return True
        if op.rank not in ranks:
            return False
        return ranks.index(op.rank) < max(1, self.span_budget // max(1, steps_per_rank))


def _busy_s(op: Operation, op_call: Call | None, steps: list[Call]) -> float:
    if op_call is not None:  # what it did not spend waiting for the other ranks
        return max(0.0, op_call.duration_s - op.wait_s)
    return sum(call.duration_s for call in steps)


def _candidate(op: Operation, op_call: Call | None, busy_s: float, median: float | None) -> str | None:
    """Why this rank may be worth reading beyond the sample (``slow``, ``straggler``), or None."""
    if busy_s < FLOOR_S:
        return None
    if median is not None:  # it knows its usual self: only a change from it is news
        return REASON_SLOW if busy_s > SLOW_FACTOR * median else None
    if op_call is None or op.world_size <= 1 or op_call.end_ns <= op_call.start_ns:
        return None
    return REASON_STRAGGLER if op.wait_s <= STRAGGLER_WAIT_SHARE * op_call.duration_s else None


def summary_attributes(
    op: Operation, steps: list[Call], detailed: bool, reason: str, collectives: list[Call] | None = None
) -> dict[str, object]:
    """The compact per-step summary every rank's operation span carries."""
    seconds: dict[str, float] = {}
    for call in sorted(steps, key=lambda c: c.start_ns):
        seconds[call.func_name] = seconds.get(call.func_name, 0.0) + call.duration_s
    attrs: dict[str, object] = {
        semconv.ATTR_DETAIL: semconv.DETAIL_STEPS if detailed else semconv.DETAIL_SUMMARY,
        semconv.ATTR_STEP_NAMES: list(seconds),
        semconv.ATTR_STEP_SECONDS: list(seconds.values()),
        semconv.ATTR_WAIT_SECONDS: max(0.0, op.wait_s),
    }
    # Of that wait, the time in DCP's collectives run right under the operation (an async save's are the
    # background save's, on the upload's side).
    under_op = [c.duration_s for c in collectives or () if (p := c.parent_context) is not None and p.span_id == op.span_id]
    if under_op:
        attrs[semconv.ATTR_COLLECTIVE_SECONDS] = sum(under_op)
    if detailed:  # a summary-only span says why by its ATTR_DETAIL alone
        attrs[semconv.ATTR_DETAIL_REASON] = reason
    return attrs


#: The coordinator names the rank it waited for only when that rank was at least this much later than the others'
#: median (besides SLOW_FACTOR times it): milliseconds of jitter in a balanced job name nobody.
NAMED_LEAD_S: Final = 0.1


def named_straggler(marks: list[tuple[int, int]]) -> dict[str, int | float]:
    """The attributes naming the rank the coordinator's write gather waited for, from every rank's
    (rank, nanoseconds from the plan's release to sending its write results); empty when none stood out.

    Compared with the median of the *other* ranks, so that two ranks can name one. Whatever the world size
    this is one sort on the builder thread and four attributes on spans exported anyway: every checkpoint a
    persistent straggler delays names it, at 10,000 ranks too, within any span budget.
    """
    if len(marks) < 2:
        return {}
    ordered = sorted(marks, key=lambda mark: mark[1])
    rank, last_ns = ordered[-1]
    median_ns = statistics.median(mark[1] for mark in ordered[:-1])
    if last_ns < SLOW_FACTOR * median_ns or last_ns - median_ns < NAMED_LEAD_S * 1e9:
        return {}
    return {
        semconv.ATTR_STRAGGLER_RANK: rank,
        semconv.ATTR_STRAGGLER_SECONDS: last_ns / 1e9,
        semconv.ATTR_STRAGGLER_MEDIAN_SECONDS: median_ns / 1e9,
        semconv.ATTR_STRAGGLER_RANKS: len(marks),
    }
