"""Ranks started by ``torch.multiprocessing.spawn`` (Lightning's ``ddp_spawn``), and a helper spawned beside them.

Usage: ``spawned_ranks.py OUT`` with ``DCP_OTEL_METRICS_PORT`` (and ``DCP_OTEL_METRICS_ADDR``) set. Each of two
gloo ranks instruments itself, says in ``OUT/rank-N.json`` whether it served metrics before its first checkpoint
and where it serves them after it; a helper process (``multiprocessing``'s spawn, as a DataLoader worker) that
instruments and never checkpoints says the same in ``OUT/helper.json``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp


def served() -> str | None:
    import dcp_otel

    endpoint = dcp_otel.DCPInstrumentor().metrics_endpoint
    return endpoint.url if endpoint is not None else None


def rank(index: int, out: Path, store: str) -> None:
    warnings.simplefilter("ignore")
    import dcp_otel

    dcp_otel.instrument()
    before = served()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=index, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(out / "ckpt"))
    (out / f"rank-{index}.json").write_text(json.dumps({"before": before, "after": served()}))
    dist.destroy_process_group()


def helper(out: Path) -> None:
    import dcp_otel

    dcp_otel.instrument()
    (out / "helper.json").write_text(json.dumps({"before": served(), "after": served()}))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    child = multiprocessing.get_context("spawn").Process(target=helper, args=(out,))
    child.start()
    child.join(60)
    mp.spawn(rank, args=(out, os.path.join(tempfile.mkdtemp(), "store")), nprocs=2)
