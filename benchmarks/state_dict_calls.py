"""What the state-dict API's spans cost the caller: ``get_state_dict`` / ``set_state_dict``, traced vs plain.

    .venv/bin/python benchmarks/state_dict_calls.py            # ~30 s on 2 cores
    .venv/bin/python benchmarks/state_dict_calls.py --quick

dcp-otel records ``get_state_dict`` and ``set_state_dict`` (and their model and
optimizer halves) on the caller's thread, as torch's own DCP calls are: a call
id, a start and an end record each (see ``dcp_otel/attach/unlogged_calls.py``). This
times both functions on a small model and an Adam optimizer in one process,
instrumented and not, interleaved (medians), and prints the time added per call
beside the call's own time. The model is small on purpose: the added cost is
fixed per call, so a small model shows it at its largest relative size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CollectorRegistry
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from overhead import DiscardingExporter  # noqa: E402

import dcp_otel  # noqa: E402


def measure(repeats: int, calls: int) -> dict[str, dict[str, float]]:
    """Per function: the seconds per call ``plain`` and ``traced`` (medians over interleaved blocks)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(4, 64)).sum().backward()
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(DiscardingExporter()))
    arms: dict[str, Callable[[], object]] = {
        "get_state_dict": lambda: get_state_dict(model, optim),
        "set_state_dict": lambda: set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd),
    }
    found = traced_vs_plain(arms, provider, repeats, calls)
    provider.shutdown()
    return found


def traced_vs_plain(
    arms: dict[str, Callable[[], object]], provider: TracerProvider, repeats: int, calls: int
) -> dict[str, dict[str, float]]:
    """Per arm, the seconds per call ``plain`` and ``traced``: medians over blocks of ``calls``,
    instrumented and not in turn (the order alternating), each block after one warm call."""
    times: dict[tuple[str, str], list[float]] = {}
    for i in range(repeats):
        for traced in ((False, True) if i % 2 == 0 else (True, False)):
            if traced:
                dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
            for name, call in arms.items():
                call()  # warm: the first call after instrument() creates the tracer and series
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                times.setdefault((name, "traced" if traced else "plain"), []).append((time.perf_counter() - start) / calls)
            if traced:
                dcp_otel.uninstrument()
    return medians(times, arms)


def medians(times: dict[tuple[str, str], list[float]], names: Iterable[str]) -> dict[str, dict[str, float]]:
    """Per name, the median of its ``plain`` and its ``traced`` times."""
    return {name: {kind: statistics.median(times[(name, kind)]) for kind in ("plain", "traced")} for name in names}


def print_side_by_side(found: dict[str, dict[str, float]], width: int) -> None:
    """One row per call: plain and traced microseconds, what tracing added, and their ratio."""
    print(f"{'call':<{width}} {'plain us':>10} {'traced us':>10} {'added us':>10} {'ratio':>7}")
    for name, row in found.items():
        plain, traced = row["plain"] * 1e6, row["traced"] * 1e6
        print(f"{name:<{width}} {plain:>10.1f} {traced:>10.1f} {traced - plain:>10.1f} {traced / plain:>7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print_side_by_side(measure(repeats=6 if args.quick else 20, calls=50 if args.quick else 200), width=16)


if __name__ == "__main__":
    main()
