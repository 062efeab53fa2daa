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
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CollectorRegistry
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ab import Measures, Results, interleave, per_call, print_side_by_side  # noqa: E402
from overhead import DiscardingExporter  # noqa: E402

import dcp_otel  # noqa: E402


def measure(repeats: int, calls: int) -> Results:
    """Per function, the seconds per call ``plain`` and ``traced`` (interleaved blocks)."""
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


def traced_vs_plain(calls: dict[str, Callable[[], object]], provider: TracerProvider, repeats: int, n: int) -> Results:
    """Per call, its seconds per call in blocks of ``n``, instrumented (``traced``) and not (``plain``) in turn,
    each block after one warm call."""

    def block(traced: bool) -> Measures:
        if traced:
            dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
        found = {}
        for name, call in calls.items():
            call()  # warm: the first call after instrument() creates the tracer and series
            found[name] = per_call(call, n)
        if traced:
            dcp_otel.uninstrument()
        return found

    return interleave({"plain": lambda: block(False), "traced": lambda: block(True)}, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    calls = ("get_state_dict", "set_state_dict")
    print_side_by_side(measure(repeats=6 if args.quick else 20, calls=50 if args.quick else 200), calls, width=16)


if __name__ == "__main__":
    main()
