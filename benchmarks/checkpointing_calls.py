"""What tracing ``torch_checkpointing`` costs the caller: its saves and loads, traced vs plain, and the bill.

    .venv/bin/python benchmarks/checkpointing_calls.py            # ~1.5 min on 2 cores
    .venv/bin/python benchmarks/checkpointing_calls.py --quick

dcp-otel records a ``CheckpointManager``'s calls on the caller's thread (an operation's start and end, a
record per step there, each ``EventLogger`` event it logs; see ``dcp_otel/attach/torch_checkpointing.py``).
One process in a gloo world of its own (its writer's default barrier uses the process group's store), the
manager's defaults but for ``O_DIRECT`` (refused on /dev/shm, where the files go), a small state dict (the
added cost is fixed per call, so a small one shows it at its largest relative size):

* **the bill**: the Python bytecode the caller's thread runs per call, plain and traced, counted
  deterministically (``sys.settrace``), against a bare SDK span's (``start_span`` with four attributes,
  made current, ended): the same unit as ``fixed_cost.py``'s bill of a ``dcp.save``;
* **the time**: instrumented and not, interleaved blocks, medians: a sync save and a load (in the caller),
  an async save until it returns (what the training loop waits for; and the calling thread's CPU time until
  then, which a wait for the interpreter lock does not count) and until its write future is done
  (durable: staged on the ``ckpt-staging`` thread, written in the writer process, whose spans are exported
  to a discarding exporter).

What it leaves out: one rank has no peer to wait for at the barrier; the writer process's own tracing (it
is off the caller's thread, and its time is inside "durable"); the exporter's network work.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from opentelemetry import trace
from prometheus_client import CollectorRegistry
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ab import Measures, Results, interleave, median, per_call, print_side_by_side  # noqa: E402
from overhead import bytecode, discarding_provider, init_process  # noqa: E402

import dcp_otel  # noqa: E402

STORAGE = LocalFileSystemStorageConfig(use_direct_io=False)
KEYS = ("model", "optimizer", "step")
#: The calls timed, as printed (the last three an async save's: a sample each).
TIMED = ("sync save", "load", "async save (returns)", "  its caller's CPU", "async save (durable)")


def state() -> dict[str, object]:
    return {"model": {"w": torch.ones(256, 256), "b": torch.zeros(256)}, "optimizer": {"lr": 0.1}, "step": 1}


def bare_span(tracer: trace.Tracer) -> None:
    """The unit of the bill, as ``fixed_cost.py`` makes it: four attributes, made current, ended."""
    span = tracer.start_span("dcp.write_data", attributes={"dcp.rank": 0, "dcp.world_size": 1,
                                                           "dcp.operation": "save", "dcp.checkpoint_id": "/c"})  # fmt: skip
    token = trace.context_api.attach(trace.set_span_in_context(span))
    trace.context_api.detach(token)
    span.end()


class Arms:
    """The managers and calls of one block (made while instrumented or not: the writer process is traced only
    when it was started instrumented)."""

    def __init__(self, folder: str) -> None:
        self.folder, self.sd, self.n = folder, state(), 0
        self.sync = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=STORAGE))
        self.manager = CheckpointManager(CheckpointManager.Config(storage_config=STORAGE, subprocess_init_fn=init_process))
        self.sync.save(self.path("sync"), self.sd)
        written = self.manager.save(self.path("warm"), self.sd)  # starts the writer process
        assert written is not None
        written.result()

    def path(self, name: str) -> str:
        self.n += 1
        return os.path.join(self.folder, f"{name}-{self.n}")

    def sync_save(self) -> None:
        self.sync.save(self.path("sync"), self.sd)

    def load(self) -> None:
        self.sync.load(os.path.join(self.folder, "sync-1"), into={key: None for key in KEYS})

    def async_save(self) -> tuple[float, float, float]:
        """Seconds until it returned, the calling thread's CPU seconds until then, and until its write future was
        done."""
        start, cpu = time.perf_counter(), time.thread_time()
        written = self.manager.save(self.path("async"), self.sd)
        returned, cpu = time.perf_counter(), time.thread_time() - cpu
        assert written is not None
        written.result()
        return returned - start, cpu, time.perf_counter() - start

    def close(self) -> None:
        self.manager.close()
        self.sync.close()


def measure_bill(folder: str) -> dict[str, float]:
    """Bytecode per call on the caller's thread, plain and traced (warm, the least of three), and a bare span's."""
    provider = discarding_provider()
    found: dict[str, float] = {}
    for traced in (False, True):
        if traced:
            dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
        arms = Arms(os.path.join(folder, f"bill-{traced}"))
        kind = "traced" if traced else "plain"
        calls: dict[str, Callable[[], object]] = {"sync save": arms.sync_save, "load": arms.load,
                                                  "async save (returns)": arms.async_save}  # fmt: skip
        for name, call in calls.items():
            call()
            found[f"{name} {kind}"] = min(bytecode(call) for _ in range(3))  # (the async write is awaited inside)
        arms.close()
        if traced:
            dcp_otel.uninstrument()
    tracer = provider.get_tracer("bench")
    bare_span(tracer)
    found["bare span"] = min(bytecode(lambda: bare_span(tracer)) for _ in range(5))
    provider.shutdown()
    return found


def measure_time(folder: str, repeats: int, calls: int) -> Results:
    """Per block (its own managers): the sync save's and the load's seconds per call over ``calls``, then each of
    ``calls`` async saves' times (a sample each)."""
    provider = discarding_provider()
    blocks = itertools.count()

    def block(traced: bool) -> list[Measures]:
        if traced:
            dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
        arms = Arms(os.path.join(folder, f"time-{next(blocks)}"))
        found = [{"sync save": per_call(arms.sync_save, calls), "load": per_call(arms.load, calls)}]
        for _ in range(calls):
            found.append(dict(zip(TIMED[2:], arms.async_save(), strict=True)))
        arms.close()
        if traced:
            dcp_otel.uninstrument()
        return found

    found = interleave({"plain": lambda: block(False), "traced": lambda: block(True)}, repeats)
    provider.shutdown()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1,
                                timeout=timedelta(seconds=60))  # fmt: skip
        try:
            bill = measure_bill(folder)
            found = measure_time(folder, repeats=2 if args.quick else 4, calls=10 if args.quick else 25)
        finally:
            dist.destroy_process_group()
    bare = bill["bare span"]
    print(f"the caller's bill (Python bytecode on the calling thread; a bare span: {bare:.0f})")
    print(f"{'call':<24} {'plain op':>9} {'traced op':>10} {'added op':>9} {'bare spans':>11}")
    for name in ("sync save", "load", "async save (returns)"):
        plain, traced = bill[f"{name} plain"], bill[f"{name} traced"]
        print(f"{name:<24} {plain:>9.0f} {traced:>10.0f} {traced - plain:>9.0f} {(traced - plain) / bare:>11.2f}")
    print()
    print_side_by_side(found, TIMED, width=24)
    spread = statistics.median(median(found, "traced", name) / median(found, "plain", name) for name in TIMED)
    print(f"median traced/plain over the calls: {spread:.3f}")


if __name__ == "__main__":
    main()
