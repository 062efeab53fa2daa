"""What the metrics cost, as figures measured side by side in one run.

    .venv/bin/python benchmarks/metrics_overhead.py          # ~1 min
    .venv/bin/python benchmarks/metrics_overhead.py --quick

Prints:

* ``put_metric`` through ``OTelMetricHandler`` against torch's
  ``ConsoleMetricHandler`` (printing to /dev/null) and ``NullMetricHandler``,
  for the counter path (``x.success``), the duration path (``x.duration.ms``,
  a histogram and a span) and the event path; interleaved repetitions,
  medians. Goal: the counter path costs no more than ConsoleMetricHandler;
* the number of series one rank exports (sample lines of the exposition)
  after 10 checkpoints, after 1,000 checkpoints with distinct checkpoint ids,
  and after saves of 10,000-key state dicts. Goal: constant, at most 300.
  Keys never become labels, so a few 10,000-key saves show that as well as
  1,000 would (each takes seconds here).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, generate_latest
from torch.distributed.elastic.metrics import api as elastic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import Measures, interleave, median, per_call  # noqa: E402

import dcp_otel  # noqa: E402


def put_metric_costs(calls: int, repeats: int) -> dict[str, dict[str, float]]:
    """Seconds per put_metric call, by handler and path (medians of interleaved runs)."""
    handlers = {
        "OTelMetricHandler": dcp_otel.OTelMetricHandler(registry=CollectorRegistry(), tracer_provider=TracerProvider()),
        "ConsoleMetricHandler": elastic.ConsoleMetricHandler(),
        "NullMetricHandler": elastic.NullMetricHandler(),
    }
    paths = {"counter": "agent.step.success", "duration": "agent.step.duration.ms", "event": "agent.restarts"}

    def calls_through(handler: elastic.MetricHandler) -> Measures:
        elastic.configure(handler, group="bench")
        return {path: per_call(functools.partial(elastic.put_metric, name, 1, "bench"), calls)
                for path, name in paths.items()}  # fmt: skip

    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        found = interleave({name: functools.partial(calls_through, h) for name, h in handlers.items()}, repeats)
    elastic._metrics_map.pop("bench", None)
    return {path: {name: median(found, name, path) for name in handlers} for path in paths}


def series(registry: CollectorRegistry) -> int:
    return sum(1 for line in generate_latest(registry).decode().splitlines() if line and not line.startswith("#"))


def series_growth(checkpoints: int, big_saves: int) -> list[tuple[str, int]]:
    """Series one rank exports as checkpoints accumulate."""
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=TracerProvider(), registry=registry)
    root = tempfile.mkdtemp(prefix="dcp-otel-series-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    counts = []
    try:
        small = {"w": torch.ones(4)}

        def save(i: int, state: dict) -> None:
            path = os.path.join(root, f"step-{i}")
            dcp.save(state, checkpoint_id=path)
            dcp.load(state, checkpoint_id=path)
            shutil.rmtree(path)

        for i in range(10):
            save(i, small)
        counts.append(("after 10 checkpoints (save + load)", series(registry)))
        for i in range(10, checkpoints):
            save(i, small)
        counts.append((f"after {checkpoints} checkpoints, distinct ids", series(registry)))
        big = {f"k{i:05d}": torch.ones(1) for i in range(10_000)}
        for i in range(big_saves):
            save(checkpoints + i, big)
        counts.append((f"after {big_saves} more with 10,000-key state dicts", series(registry)))
    finally:
        dcp_otel.uninstrument()
        shutil.rmtree(root, ignore_errors=True)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    costs = put_metric_costs(calls=2_000 if args.quick else 10_000, repeats=3 if args.quick else 9)
    growth = series_growth(checkpoints=200 if args.quick else 1_000, big_saves=1 if args.quick else 3)

    print(f"\nput_metric cost per call (torch {torch.__version__}; medians of interleaved runs)")
    print(f"{'path':<10} {'OTelMetricHandler':>18} {'Console':>10} {'Null':>10} {'OTel/Console':>13} {'goal':>6}")
    for path, by in costs.items():
        ratio = by["OTelMetricHandler"] / by["ConsoleMetricHandler"]
        goal = "<=1.0" if path == "counter" else ""
        verdict = ("ok" if ratio <= 1.0 else "OVER") if goal else ""
        print(f"{path:<10} {by['OTelMetricHandler'] * 1e6:>16.2f}us {by['ConsoleMetricHandler'] * 1e6:>8.2f}us "
              f"{by['NullMetricHandler'] * 1e6:>8.2f}us {ratio:>13.2f} {goal:>6} {verdict}")  # fmt: skip
    print("\nseries exported by one rank (goal: constant, <= 300)")
    for label, count in growth:
        print(f"  {label:<48} {count:>5}")
    constant = len({count for _, count in growth}) == 1
    print(f"  constant: {'yes' if constant else 'NO'}; at most 300: {'yes' if max(c for _, c in growth) <= 300 else 'NO'}")


if __name__ == "__main__":
    main()
