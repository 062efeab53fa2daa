"""What tracing torch's ``_experimental`` checkpointer costs the caller: save and load, traced vs plain.

    .venv/bin/python benchmarks/checkpointer_calls.py            # ~1 min on 2 cores
    .venv/bin/python benchmarks/checkpointer_calls.py --quick

dcp-otel records ``SyncCheckpointer``/``AsyncCheckpointer`` calls on the
caller's thread (an operation's start, a record per step; see
``dcp_otel/attach/checkpointer.py``). One process, no process group, a small state
dict (the added cost is fixed per call, so a small one shows it at its largest
relative size), instrumented and not, interleaved (medians):

* ``SyncCheckpointer.save`` and ``.load`` (a file write or read each);
* ``AsyncCheckpointer.save``: the time until it returns (what the training loop
  waits for), and until its write future is done (the checkpoint is durable),
  with the checkpoint process exporting its spans to a discarding exporter.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry
from torch.distributed.checkpoint._experimental import (
    CheckpointerConfig,
    CheckpointStagerConfig,
    RankInfo,
    make_async_checkpointer,
    make_sync_checkpointer,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ab import Measures, Results, interleave, print_side_by_side  # noqa: E402
from overhead import discarding_provider, init_process  # noqa: E402
from state_dict_calls import traced_vs_plain  # noqa: E402

import dcp_otel  # noqa: E402

RANK = RankInfo(global_world_size=1, global_rank=0)
STAGING = CheckpointStagerConfig(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                 use_non_blocking_copy=False)  # fmt: skip


def state() -> dict[str, object]:
    return {"w": torch.ones(256, 256), "b": torch.zeros(256), "step": 1}


def measure_sync(folder: str, repeats: int, calls: int) -> Results:
    checkpointer, sd, path = make_sync_checkpointer(rank_info=RANK), state(), os.path.join(folder, "sync")
    provider = discarding_provider()
    arms: dict[str, Callable[[], object]] = {
        "sync save": lambda: checkpointer.save(path, sd),
        "sync load": lambda: checkpointer.load(path),
    }
    found = traced_vs_plain(arms, provider, repeats, calls)
    provider.shutdown()
    return found


def measure_async(folder: str, repeats: int, saves: int) -> Results:
    """Each block makes its own AsyncCheckpointer (its process is traced only if made while instrumented)."""
    provider, sd = discarding_provider(), state()

    def block(traced: bool) -> list[Measures]:
        if traced:
            dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
        checkpointer = make_async_checkpointer(CheckpointerConfig(staging_config=STAGING), rank_info=RANK,
                                               subprocess_init_fn=init_process)  # fmt: skip
        futures = checkpointer.save(os.path.join(folder, "warm"), sd)  # starts the process
        assert futures is not None
        futures[1].result()
        found = []
        for n in range(saves):
            start = time.perf_counter()
            futures = checkpointer.save(os.path.join(folder, f"async-{n % 2}"), sd)
            returned = time.perf_counter()
            assert futures is not None
            futures[1].result()
            durable = time.perf_counter()
            found.append({"async save (returns)": returned - start, "async save (durable)": durable - start})
        checkpointer.close()
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
    with tempfile.TemporaryDirectory() as folder:
        found = measure_sync(folder, repeats=6 if args.quick else 20, calls=20 if args.quick else 50)
        timed = measure_async(folder, repeats=2 if args.quick else 4, saves=10 if args.quick else 30)
        for arm, samples in timed.items():
            found[arm] += samples
    print_side_by_side(found, ("sync save", "sync load", "async save (returns)", "async save (durable)"), width=22)


if __name__ == "__main__":
    main()
