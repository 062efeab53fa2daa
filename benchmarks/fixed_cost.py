"""What dcp-otel adds to the fixed cost of a save, on the training thread: a tiny save, traced / plain.

    .venv/bin/python benchmarks/fixed_cost.py [--blocks 15] [--saves 40]

One process in a gloo world of its own (so DCP's collectives run, as on every rank of a job) saves a
one-tensor state dict to /dev/shm over and over: the save is nearly all fixed cost (the plan, the
collectives, the metadata), which is what dcp-otel's per-save work is measured against. Blocks of
saves alternate three arms, and their medians are compared: plain (``uninstrument()``); traced
(``instrument()``, spans to an in-memory exporter through the batch processor, metrics on) with the
builder and the exporter finishing between saves, untimed (the training thread's own cost); and
traced back to back, where the builder and the exporter thread of one save hold the interpreter
while the next save runs (what a job checkpointing this often would pay). A save logs about
20 records: the operation, its steps and the per-key records, and 4 of DCP's collectives (each a
span, with its pickled bytes).

What it leaves out: one process has no peer to wait for, so the collectives cost their local work
only; a real save's data (its write) is what makes the fixed cost small beside it (``overhead.py``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

import dcp_otel  # noqa: E402


def _block(saves: int, root: str, state: dict[str, torch.Tensor], settle: bool = False) -> list[float]:
    took = []
    for i in range(saves):
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=os.path.join(root, f"c{i % 4}"))
        took.append(time.perf_counter() - start)
        if settle:  # untimed: the builder and the exporter finish before the next save
            dcp_otel.flush(timeout_s=30)
    return took


ARMS = ("plain", "settled", "back-to-back")


def measure(blocks: int = 15, saves: int = 40) -> dict[str, float]:
    """Median seconds per save of each arm (:data:`ARMS`), in a gloo world of one made and ended here."""
    warnings.simplefilter("ignore")
    store = tempfile.mktemp(prefix="dcp-otel-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    registry = CollectorRegistry()
    state = {"w": torch.zeros(16)}
    arms: dict[str, list[float]] = {arm: [] for arm in ARMS}
    # plain, settled, back-to-back, back-to-back, settled, plain, ...: drift falls on every arm alike
    order = [*ARMS, *reversed(ARMS)]
    try:
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
            for block in range(len(ARMS) * blocks):
                arm = order[block % len(order)]
                on = arm != "plain"
                if on:
                    dcp_otel.instrument(tracer_provider=provider, registry=registry, detail="full")
                _block(1, root, state, settle=on)  # untimed: the first save after a switch
                gc.collect()
                arms[arm].extend(_block(saves, root, state, settle=arm == "settled"))
                if on:
                    dcp_otel.flush(timeout_s=30)
                    exporter.clear()
                    dcp_otel.uninstrument()
    finally:
        dist.destroy_process_group()
        provider.shutdown()
        if os.path.exists(store):
            os.unlink(store)
    return {arm: statistics.median(took) for arm, took in arms.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=15, help="blocks per arm")
    parser.add_argument("--saves", type=int, default=40, help="saves per block")
    args = parser.parse_args()
    found = measure(args.blocks, args.saves)
    p = found["plain"]
    print(f"fixed cost of a tiny save, 1 gloo rank (torch {torch.__version__}; medians of {args.blocks * args.saves} "
          "saves per arm)")  # fmt: skip
    print(f"  {'plain':<42} {p * 1e6:9.1f} us")
    for arm, said in (("settled", "traced, builder idle (training thread only)"),
                      ("back-to-back", "traced, back to back (+ builder, exporter)")):  # fmt: skip
        t = found[arm]
        print(f"  {said:<42} {t * 1e6:9.1f} us   ratio {t / p:.3f}   added {(t - p) * 1e6:+8.1f} us per save")


if __name__ == "__main__":
    main()
