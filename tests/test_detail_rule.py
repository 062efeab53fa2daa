"""The rule of ``detail="auto"``, rank by rank, at sizes no test can run: every rank's own
:class:`DetailPolicy` decides from what that rank recorded, and the checkpoint's step spans add up
to at most the budget, whatever the job does (see tests/test_detail.py for real gloo ranks)."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import TraceFlags

from dcp_otel import semconv
from dcp_otel.tracing.detail import FLOOR_S, DetailPolicy, candidate_cap, sample_every
from dcp_otel.tracing.records import KIND_OPERATION, Call, Operation

STEPS = 8  # a rank's steps in a real save: local plan, write, and the storage's own
BUDGET = 2000
_TRACER = trace.get_tracer(__name__)


def _decide(policy: DetailPolicy, rank: int, world: int, busy_s: float, wait_s: float, trace_id: int) -> str:
    """One rank's save that was busy ``busy_s`` and waited ``wait_s``; the reason it gives ("summary": none)."""
    attributes = {semconv.ATTR_WORLD_SIZE: world, semconv.ATTR_COORDINATOR: rank == 0}
    op = Operation("save", rank, _TRACER, attributes, trace_id, TraceFlags(TraceFlags.SAMPLED))
    op.wait_s = wait_s
    op_call = Call("op", "save", 0, 1, None, op, {}, kind=KIND_OPERATION)
    op_call.end_ns = int((busy_s + wait_s) * 1e9)
    steps = []
    for i in range(STEPS):
        step = Call(f"s{i}", f"step{i}", 0, 2 + i, None, op, {})
        step.end_ns = int(busy_s / STEPS * 1e9)
        steps.append(step)
    detailed, reason = policy.decide(op, steps, op_call)
    assert detailed == (reason != "summary")
    return reason


def _checkpoints(world: int, busy: list[list[float]], wait_s: float = 0.05) -> list[dict[int, str]]:
    """Each rank's reason in each checkpoint; ``busy[c][r]``: rank r's busy seconds in checkpoint c."""
    policies = [DetailPolicy("auto", BUDGET) for _ in range(world)]
    return [
        {rank: _decide(policies[rank], rank, world, times[rank], wait_s, trace_id=0x5EED + c) for rank in range(world)}
        for c, times in enumerate(busy)
    ]


def _step_spans(reasons: dict[int, str]) -> int:
    return STEPS * sum(reason != "summary" for reason in reasons.values())


def test_a_balanced_job_of_10000_ranks_exports_only_the_coordinator_and_the_sample() -> None:
    world = 10_000
    for reasons in _checkpoints(world, [[30.0] * world] * 4)[3:]:  # 30 s writes: every rank above the floor
        assert set(reasons.values()) == {"coordinator", "sampled", "summary"}
        sampled = sum(reason == "sampled" for reason in reasons.values())
        expected = world / sample_every(world, STEPS, BUDGET)
        assert 0.7 * expected < sampled < 1.3 * expected
        assert _step_spans(reasons) < 0.35 * BUDGET  # the sample's quarter; the rest is kept for candidates


def test_the_first_checkpoints_of_a_balanced_job_keep_the_budget_though_every_rank_looks_like_a_straggler() -> None:
    world = 10_000
    for reasons in _checkpoints(world, [[30.0] * world] * 3):  # no history yet; each waited 0.05 s of 30
        assert "straggler" in reasons.values()
        stragglers = sum(reason == "straggler" for reason in reasons.values())
        assert stragglers < 1.3 * candidate_cap(STEPS, BUDGET)
        assert _step_spans(reasons) < 1.05 * BUDGET  # the budget holds in expectation; one draw varies a little


def test_a_slowdown_of_the_whole_job_keeps_the_budget() -> None:
    world = 10_000
    reasons = _checkpoints(world, [[30.0] * world] * 4 + [[90.0] * world])[-1]  # the filesystem at a third
    assert "slow" in reasons.values()
    assert _step_spans(reasons) < 1.05 * BUDGET


def test_a_lone_straggler_is_detailed_while_the_cap_holds_every_rank() -> None:
    world = candidate_cap(STEPS, BUDGET)  # 186 ranks: the most for which it is certain
    assert world >= 100 and sample_every(world, STEPS, BUDGET) >= 2
    busy = [[2.0] * world for _ in range(6)]
    busy[0][7] = busy[5][7] = 8.0  # rank 7 at 4x, before it has a history and after
    runs = _checkpoints(world, busy)
    assert runs[0][7] == "straggler" and runs[5][7] == "slow"
    for reasons in runs[3:5]:  # with a history, at its usual 2 s, nobody is a candidate
        assert set(reasons.values()) <= {"coordinator", "sampled", "summary"}


def test_noise_below_the_floor_never_makes_a_candidate() -> None:
    """A rank whose steps take milliseconds doubles its time on any hiccup: that is not news."""
    world = 64
    busy = [[0.004] * world for _ in range(3)] + [[0.004 * (3 if r % 2 else 1) for r in range(world)]]
    busy.append([FLOOR_S * 0.99] * world)
    for reasons in _checkpoints(world, busy):
        assert not {"slow", "straggler"} & set(reasons.values())
