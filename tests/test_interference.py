"""What a checkpoint's background work costs the training steps around it: the arithmetic, and the step clock.

The steps come from torch's global optimizer step hook (``dcp_otel.tracing.steps``): registered by
``instrument()``, gone after ``uninstrument()``. The arithmetic (``dcp_otel.tracing.interference``) compares the
steps that overlapped an upload with the median step before it, the time blocked in checkpoint calls left out,
and says seconds lost only beyond noise. The 2-rank job with real uploads is ``test_interference_job.py``.
"""

from __future__ import annotations

import threading

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks

import dcp_otel
from dcp_otel.tracing.interference import MIN_BASELINE, StepLedger, assess, wait_until_ns
from dcp_otel.tracing.steps import CLOCK, StepClock
from tests.conftest import Traced

MS = 1_000_000


def ends_of(durations_ms: list[float], start: int = 0) -> list[int]:
    ends, now = [start], start
    for d in durations_ms:
        now += int(d * MS)
        ends.append(now)
    return ends


def test_steps_twice_their_usual_time_during_an_upload_lost_what_they_took_beyond_it() -> None:
    """20 steps of 100 ms (one 1 ms either side), then 6 of 200 ms while the upload ran: 2x, 0.6 s lost."""
    ends = ends_of([99, 100, 101] * 7 + [200] * 6 + [100] * 5)
    window = (ends[21], ends[27] - 50 * MS)  # returned at step 21's end, durable inside step 27
    found = assess(ends, window)
    assert found is not None
    assert found.steps == 6 and found.usual_s == 0.1
    assert abs(found.ratio - 2.0) < 1e-9 and abs(found.lost_s - 0.6) < 1e-9


def test_within_noise_no_seconds_are_lost_and_the_ratio_is_still_said() -> None:
    """Steps 3% slower during the upload, on steps that vary by 1%: below the 15% floor, nothing lost."""
    ends = ends_of([99, 100, 101] * 7 + [103] * 10)
    found = assess(ends, (ends[21], ends[-1] - MS))
    assert found is not None and found.steps == 10 and found.lost_s == 0.0 and 1.02 < found.ratio < 1.04


def test_noisy_steps_need_a_larger_slowdown_to_count() -> None:
    """Steps that vary by +-40 ms around 100 ms: a 25% slowdown of 4 steps is within 3 robust deviations."""
    ends = ends_of([60, 100, 140] * 7 + [125] * 4)
    found = assess(ends, (ends[21], ends[-1] - MS))
    assert found is not None and found.lost_s == 0.0 and found.ratio == 1.25
    steady = assess(ends_of([99, 100, 101] * 7 + [125] * 4), (ends[21], ends[-1] - MS))
    assert steady is not None and abs(steady.lost_s - 0.1) < 1e-6  # the same slowdown on steady steps: said


def test_the_time_blocked_in_the_save_itself_is_no_interference() -> None:
    """The step that called async_save took 1.1 s, 1 s of it inside the call: 0.1 s, its usual time."""
    ends = ends_of([100] * 10 + [1100, 100, 100])
    call = (ends[10] + 50 * MS, ends[10] + 1050 * MS)
    found = assess(ends, (call[1], ends[12] - MS), blocked=[call])
    assert found is not None and found.steps == 2 and found.lost_s == 0.0 and abs(found.ratio - 1.0) < 1e-9


def test_it_says_nothing_without_enough_steps_before_or_none_during() -> None:
    ends = ends_of([100] * (MIN_BASELINE - 1) + [300, 300])
    assert assess(ends, (ends[MIN_BASELINE - 1], ends[-1])) is None  # too few steps to know the usual one
    ends = ends_of([100] * 10)
    assert assess(ends, (ends[-1] + MS, ends[-1] + 2 * MS)) is None  # no step overlapped it (yet)
    assert assess([], (1, 2)) is None


def test_steps_under_another_checkpoints_upload_are_no_baseline() -> None:
    """The 10 steps before were slowed by the previous upload: the usual step comes from the 10 before those."""
    ends = ends_of([100] * 10 + [300] * 10 + [300] * 5)
    found = assess(ends, (ends[20], ends[-1] - MS), busy=[(ends[10], ends[20])])
    assert found is not None and found.usual_s == 0.1 and found.ratio == 3.0


def test_the_builder_waits_for_the_step_an_upload_ended_in_bounded_by_a_few_usual_steps() -> None:
    ends = ends_of([100] * 10)
    assert wait_until_ns(ends, ends[-1]) == 0  # that step has ended
    assert wait_until_ns(ends, ends[-1] + MS) == ends[-1] + MS + 300 * MS  # 3 usual steps
    assert wait_until_ns(ends_of([10] * 10), 10**12) == 10**12 + 200 * MS  # at least 0.2 s
    assert wait_until_ns([], 5) == 0


def test_each_step_is_observed_once_with_whether_a_checkpoint_overlapped_it() -> None:
    ledger = StepLedger()
    ends = ends_of([100] * 6)
    ledger.windows.append((ends[3] + MS, ends[4] - MS))
    seen = ledger.new_steps(ends, 0, upto_ns=ends[5])
    assert [o for _, o in seen] == ["none", "none", "none", "checkpoint", "none"]
    assert ledger.new_steps(ends, 0, upto_ns=ends[5]) == []  # once
    more = ends_of([100] * 8)
    assert [round(s, 3) for s, _ in ledger.new_steps(more, 0, upto_ns=more[-1])] == [0.1, 0.1, 0.1]


def test_only_the_pace_optimizers_steps_are_training_steps_until_another_keeps_stepping_alone() -> None:
    clock = StepClock()
    a, b = object(), object()
    for _ in range(4):
        clock._hook(a, (), {})
        clock._hook(b, (), {})  # a GAN's two optimizers: one training step each time
    assert clock.count == 4
    clock._hook(b, (), {})  # a was thrown away (an LR finder's): b steps a second time since a's last
    assert clock.count == 5
    clock._hook(b, (), {})  # b is the pace from now on
    ends, first = clock.ends()
    assert clock.count == 6 and len(ends) == 6 and ends == sorted(ends) and first == 0


def test_the_ring_gives_the_step_ends_oldest_first_across_its_wrap_leaving_out_the_slots_being_overwritten() -> None:
    from dcp_otel.tracing.steps import RING

    opt = object()
    for steps in (0, 1, 7, RING - 16, RING - 15, RING, RING + 1, 3 * RING + 5):
        clock = StepClock()
        for _ in range(steps):
            clock._hook(opt, (), {})
        ends, first = clock.ends()
        assert first == max(0, steps - RING + 16) and len(ends) == steps - first
        assert ends == sorted(ends) and (not ends or ends[-1] == clock.last_end())
        newest, newest_first = clock.ends(9)  # the newest few alone (the builder's look at the pace of steps now)
        assert newest == ends[-9:] and newest_first == first + len(ends) - len(newest)


def test_instrument_registers_one_optimizer_hook_and_uninstrument_leaves_none(traced: Traced) -> None:
    """Every optimizer's step is seen while instrumented; after uninstrument() torch has no hook of ours."""
    assert CLOCK._hook in list(_global_optimizer_post_hooks.values())
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = CLOCK.count
    for _ in range(3):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    assert CLOCK.count == before + 3
    dcp_otel.uninstrument()
    assert CLOCK._hook not in list(_global_optimizer_post_hooks.values()) and not CLOCK.installed
    optimizer.step()
    assert CLOCK.count == before + 3


def test_only_the_training_threads_checkpoint_calls_are_its_blocked_time() -> None:
    """A save the application runs on a thread of its own does not block the steps: it is left out of them."""
    clock = StepClock()
    clock._hook(object(), (), {})  # the training thread (this one) steps
    elsewhere = threading.Thread(target=clock.blocked_call, args=(1, 2))
    elsewhere.start()
    elsewhere.join()
    clock.blocked_call(3, 4)
    assert list(clock.blocked) == [(3, 4)]


def test_steps_under_two_uploads_at_once_are_charged_to_one_of_them_never_twice() -> None:
    """A second async save while the first still uploads: the steps both overlapped stay with the first."""
    ends = ends_of([100] * 10 + [200] * 10)
    first = (ends[10], ends[18] - MS)
    second = (ends[15] - MS, ends[20] - MS)
    charged = assess(ends, first)
    later = assess(ends, second, busy=[first])
    assert charged is not None and later is not None
    assert charged.steps == 8 and later.steps == 2  # steps 16-18 overlap both: the first's


def test_a_dozen_optimizers_stepping_in_turn_are_one_training_step_each_turn() -> None:
    """One optimizer per model part (pipeline stages, optimizers in backward): the first sets the pace; when its
    model is thrown away and another dozen take over, the first of them to step twice does."""
    clock = StepClock()
    for model in range(2):
        parts = [object() for _ in range(12)]
        for _ in range(30):
            for part in parts:
                clock._hook(part, (), {})
        assert clock.count == 30 * (model + 1) - model  # (the new pace is known at its second step)


def test_instrumenting_again_starts_a_new_clock() -> None:
    """Steps seen by an earlier instrumentation, and the time between, are never counted again."""
    clock = StepClock()
    clock._hook(object(), (), {})
    clock.blocked_call(1, 2)
    assert clock.install()
    try:
        assert clock.count == 0 and not clock.blocked and clock.ends() == ([], 0)
    finally:
        clock.remove()
    assert not clock.installed and clock.removed_ns > 0


def test_the_step_table_is_each_step_against_each_interval_whatever_the_intervals() -> None:
    """The builder finds each interval's steps by bisection; the definition is every step against every interval
    (its time less its overlap with each blocked call, and whether any busy window overlaps it at all). The ends
    are in order: the clock keeps them so (the next test)."""
    import random

    from dcp_otel.tracing.interference import _overlap, step_table

    rng = random.Random(48)
    for _ in range(300):
        ends = sorted(rng.sample(range(0, 2_000), rng.randint(2, 40)))
        if rng.random() < 0.3:  # steps that end at the same time
            ends = sorted(ends + ends[: rng.randint(1, 3)])

        def intervals() -> list[tuple[int, int]]:
            return [(a, a + rng.randint(0, 300)) for a in (rng.randint(-100, 2_100) for _ in range(rng.randint(0, 8)))]

        blocked, busy = intervals(), intervals()
        lo = rng.randint(1, len(ends) - 1)
        hi = rng.randint(lo, len(ends))
        steps = [(ends[k - 1], ends[k]) for k in range(lo, hi)]
        expected = ([b - a - sum(_overlap((a, b), i) for i in blocked) for a, b in steps],
                    [any(_overlap(step, w) for w in busy) for step in steps])  # fmt: skip
        assert step_table(ends, lo, hi, blocked, busy) == expected, (ends, lo, hi, blocked, busy)


def test_a_wall_clock_stepped_back_makes_a_step_of_no_time_and_keeps_the_ends_in_order(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from dcp_otel.tracing import steps

    times = iter([100, 200, 150, 300, 250, 400])
    monkeypatch.setattr(steps, "time", SimpleNamespace(time_ns=lambda: next(times)))
    clock, opt = StepClock(), object()
    for _ in range(6):
        clock._hook(opt, (), {})
    assert clock.ends() == ([100, 200, 200, 300, 300, 400], 0)
    ledger = StepLedger()
    ends, first = clock.ends()
    assert [s for s, _ in ledger.new_steps(ends, first, upto_ns=400)] == [1e-7, 0.0, 1e-7, 0.0, 1e-7]
