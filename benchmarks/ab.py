"""One A/B harness for benchmarks: arms interleaved in an order that rotates each round, compared round by round.

A benchmark is a scenario: its arms (plain, instrumented, whatever else it compares), each run once a round,
the order rotating (no arm always first on a warm machine, or last on a tired one). An arm is

* in-process: a callable that runs one block (set-up, timed calls, take-down) and returns its measures,
  ``{measure: value}``, or a list of them (a sample per timed call: the medians pool them): :func:`interleave`;
* a fresh process: a Python job (a script text run with ``python -c``) that prints its measures (or a list
  of them) as JSON on its last line, given the arm's arguments: :func:`run_rounds`; or every arm a block of
  one fresh process a round: :func:`run_blocks`.

Each gives ``{arm: [its samples, round by round]}``: :func:`median` pools an arm's, :func:`ratio` is the
median of its per-round ratios to a baseline arm's. A second baseline arm in the same rounds gives the noise
row (:func:`noise`: what the machine alone does), and :func:`rounds_to_resolve` the rounds that noise needs.

Usage::

    from ab import Arm, interleave, noise, ratio_rows, run_rounds

    arms = [Arm("plain", ["0"]), Arm("plain again", ["0"]), Arm("instrumented", ["1"])]
    results = run_rounds(JOB, arms, rounds=3)                                        # fresh processes
    results = interleave({"plain": save, "traced": traced_save}, rounds=9, warm=1)   # callables, one process
    for row in ratio_rows(results, "plain", ["step_ms", "return_ms"]):
        print(row)
    print(noise(results, "plain", "plain again", "step_ms"))
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent

#: One sample of an arm: its measures by name.
Measures = dict[str, float]
#: Every arm's samples, in the order they were taken (a round's, then the next round's).
Results = dict[str, list[Measures]]
T = TypeVar("T")


@dataclass(frozen=True)
class Arm:
    name: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def rotated(items: Sequence[T], r: int) -> list[T]:
    """Round ``r``'s order: ``items`` rotated by ``r`` (each first in turn)."""
    k = r % len(items)
    return [*items[k:], *items[:k]]


def interleave(arms: Mapping[str, Callable[[], Measures | list[Measures]]], rounds: int, warm: int = 0,
               between: Callable[[], None] | None = None, say: bool = False) -> Results:  # fmt: skip
    """Every arm once per round, the order rotating; ``{arm: [its samples, round by round]}``.

    ``warm`` rounds run first, uncounted (what a process pays once: imports, caches, first calls);
    ``between`` runs after each round, untimed (a flush, a collection, so no arm inherits another's).
    All arms should give as many samples a round, so that :func:`ratio` pairs samples of one round.
    """
    results: Results = {name: [] for name in arms}
    for r in range(warm + rounds):
        for name in rotated(list(arms), r):
            found = arms[name]()
            if r >= warm:
                results[name].extend(found if isinstance(found, list) else [found])
        if between is not None:
            between()
        if say:
            print(f"  round {r + 1}/{warm + rounds} done", file=sys.stderr, flush=True)
    return results


def per_call(fn: Callable[[], object], calls: int = 1, clock: Callable[[], float] = time.perf_counter) -> float:
    """``clock``'s units per call of ``fn`` over a loop of ``calls`` (``time.thread_time`` for the CPU)."""
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def run_job(job: str, arm: Arm, timeout_s: float = 600.0) -> Any:
    """Run ``job`` once as ``arm`` in a fresh interpreter; its last stdout line, parsed (its measures, or a list
    of them: a sample each)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **arm.env}
    done = subprocess.run([sys.executable, "-c", job, *arm.args], capture_output=True, text=True, env=env,
                          timeout=timeout_s, cwd=REPO)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{arm.name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_rounds(job: str, arms: list[Arm], rounds: int, say: bool = True) -> Results:
    """Every arm a fresh process of ``job`` once per round, the order rotating."""
    return interleave({arm.name: functools.partial(run_job, job, arm) for arm in arms}, rounds, say=say)


def run_blocks(job: str, codes: str, args: Callable[[str, int], list[str]], rounds: int,
               timeout_s: float = 600.0, env: Mapping[str, str] | None = None) -> Results:  # fmt: skip
    """Every round one fresh process of ``job`` running every arm as a block of it (the same heap and caches).

    The job gets ``args(order, round)``, ``order`` the arms' one-letter ``codes`` rotated for the round, and
    prints ``{arm: measures}``; each process may run ``timeout_s``, with ``env`` added to its environment.
    A block's place in its process shows in what it measures (the heap the blocks before it left): only
    ``len(codes)`` rounds, or a multiple, put every arm in every place alike.
    """
    results: Results = {}
    for r in range(rounds):
        arm = Arm("blocks", args("".join(rotated(codes, r)), r), dict(env or {}))
        for name, measures in run_job(job, arm, timeout_s).items():
            results.setdefault(name, []).append(measures)
    return results


def ratio(results: Results, arm: str, baseline: str, measure: str) -> float:
    """The median over rounds of ``arm``'s measure over ``baseline``'s in the same round (a sample without the
    measure, or nan, left out: a round with nothing to measure, or a sample of another kind)."""
    nan = math.nan
    pairs = zip(results[arm], results[baseline], strict=True)
    ratios = [a / b for a, b in ((x.get(measure, nan), y.get(measure, nan)) for x, y in pairs) if b > 0 and a == a]
    return statistics.median(ratios) if ratios else math.nan


def median(results: Results, arm: str, measure: str) -> float:
    values = [v for v in (r.get(measure, math.nan) for r in results[arm]) if v == v]
    return statistics.median(values) if values else math.nan


def ratio_rows(results: Results, baseline: str, measures: list[str]) -> list[tuple[str, str, float, float, float]]:
    """``(arm, measure, arm's median, baseline's median, ratio)`` for every other arm and measure."""
    return [(arm, measure, median(results, arm, measure), median(results, baseline, measure),
             ratio(results, arm, baseline, measure))
            for arm in results if arm != baseline for measure in measures]  # fmt: skip


def noise(results: Results, baseline: str, again: str, measure: str) -> float:
    """How far ``again`` (the baseline run twice) strays from ``baseline``: its ratio's distance from 1 (0: nan)."""
    r = ratio(results, again, baseline, measure)
    return abs(r - 1) if r == r else 0.0


def rounds_to_resolve(noise: float, effect: float = 0.01) -> int:
    """Rounds for the median of per-round ratios to resolve ``effect`` when one round's ratio strays by ``noise``:
    the standard error of a median is about 1.25 sigma / sqrt(n); two of them inside the effect."""
    if noise <= 0:
        return 1
    return max(1, int((2 * 1.25 * noise / effect) ** 2 + 0.999))


def print_side_by_side(results: Results, calls: Sequence[str], width: int, baseline: str = "plain",
                       arm: str = "traced") -> None:  # fmt: skip
    """One row per call (a measure in seconds): the two arms' medians in microseconds, what ``arm`` added, and
    their ratio (of the medians printed beside it, so that a reader can check it)."""
    print(f"{'call':<{width}} {baseline + ' us':>10} {arm + ' us':>10} {'added us':>10} {'ratio':>7}")
    for call in calls:
        plain, traced = median(results, baseline, call) * 1e6, median(results, arm, call) * 1e6
        print(f"{call:<{width}} {plain:>10.1f} {traced:>10.1f} {traced - plain:>10.1f} {traced / plain:>7.3f}")
