"""One A/B harness for benchmarks: arms run in fresh processes, interleaved, with a plain-vs-plain noise row.

A benchmark is a scenario: a Python job (a script text run with ``python -c``)
that prints one JSON object of measures on its last line, and a set of arms
(the same job with different arguments: plain, instrumented). The harness runs
every arm once per round, in an order that rotates each round (so neither arm
always runs first on a warm machine), and reports per measure the median over
rounds of each arm's value and the median of the per-round ratios against the
baseline arm. A second baseline arm run in the same rounds gives the noise row:
its ratio to the first is what the machine alone does.

Usage::

    from ab import Arm, run_rounds, ratio_rows

    arms = [Arm("plain", ["0"]), Arm("plain again", ["0"]), Arm("instrumented", ["1"])]
    results = run_rounds(JOB, arms, rounds=3)
    for row in ratio_rows(results, "plain", ["step_ms", "return_ms"]):
        print(row)
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Arm:
    name: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def run_job(job: str, arm: Arm, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run ``job`` once as ``arm`` in a fresh interpreter; its last stdout line, parsed."""
    import os

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **arm.env}
    done = subprocess.run([sys.executable, "-c", job, *arm.args], capture_output=True, text=True, env=env,
                          timeout=timeout_s, cwd=REPO)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{arm.name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_rounds(job: str, arms: list[Arm], rounds: int, say: bool = True) -> dict[str, list[dict[str, float]]]:
    """Every arm once per round, the order rotating; ``{arm: [its measures, per round]}``."""
    results: dict[str, list[dict[str, float]]] = {arm.name: [] for arm in arms}
    for r in range(rounds):
        order = arms[r % len(arms):] + arms[: r % len(arms)]
        for arm in order:
            results[arm.name].append(run_job(job, arm))
        if say:
            print(f"  round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return results


def ratio(results: dict[str, list[dict[str, float]]], arm: str, baseline: str, measure: str) -> float:
    """The median over rounds of ``arm``'s measure over ``baseline``'s in the same round."""
    pairs = zip(results[arm], results[baseline], strict=True)
    ratios = [a[measure] / b[measure] for a, b in pairs if b[measure] > 0 and a[measure] == a[measure]]
    return statistics.median(ratios) if ratios else math.nan  # (nan: a round with nothing to measure)


def median(results: dict[str, list[dict[str, float]]], arm: str, measure: str) -> float:
    values = [r[measure] for r in results[arm] if r[measure] == r[measure]]
    return statistics.median(values) if values else math.nan


def ratio_rows(results: dict[str, list[dict[str, float]]], baseline: str,
               measures: list[str]) -> list[tuple[str, str, float, float, float]]:  # fmt: skip
    """``(arm, measure, arm's median, baseline's median, ratio)`` for every other arm and measure."""
    return [(arm, measure, median(results, arm, measure), median(results, baseline, measure),
             ratio(results, arm, baseline, measure))
            for arm in results if arm != baseline for measure in measures]  # fmt: skip


def rounds_to_resolve(noise: float, effect: float = 0.01) -> int:
    """Rounds for the median of per-round ratios to resolve ``effect`` when one round's ratio strays by ``noise``:
    the standard error of a median is about 1.25 sigma / sqrt(n); two of them inside the effect."""
    if noise <= 0:
        return 1
    return max(1, int((2 * 1.25 * noise / effect) ** 2 + 0.999))
