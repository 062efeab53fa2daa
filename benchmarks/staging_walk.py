"""What reading an async save's staged bytes costs the caller: the walk alone, and whole async saves.

    .venv/bin/python benchmarks/staging_walk.py [--tensors 10000] [--rounds 5]

dcp-otel reads each tensor's ``nbytes`` and device as the stager is called, on the caller's thread
(``dcp_otel.tracing.staged``). One process in a gloo world of its own, a state dict of ``--tensors``
small tensors (the walk's worst case: the most tensors for the fewest bytes):

* the walk alone, per call and per tensor (median of ``--rounds``);
* ``dcp.async_save``'s time to return, plain and instrumented, in interleaved rounds (each arm first
  in turn; the upload awaited and the builder flushed between saves, untimed): the medians and their
  ratio, so the walk is seen inside the work a user runs, beside all else dcp-otel adds there.

What it leaves out: big tensors (the copy then dwarfs the walk) and a GPU (scripts/gpu-check.sh).
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from ab import Measures, interleave, median  # noqa: E402
from fixed_cost import gloo_world_of_one  # noqa: E402
from torch.distributed.checkpoint.staging import BlockingAsyncStager  # noqa: E402

import dcp_otel  # noqa: E402
from dcp_otel.tracing.staged import staged  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    state = {f"layer{i}.weight": torch.ones(4) for i in range(args.tensors)}
    walks = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        staged(BlockingAsyncStager(), state)
        walks.append(time.perf_counter() - start)
    walk = statistics.median(walks)
    root = Path(tempfile.mkdtemp(prefix="dcp-otel-staging-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    saves = itertools.count()
    with gloo_world_of_one() as (provider, _):

        def arm(instrumented: bool) -> Measures:
            if instrumented:
                dcp_otel.instrument(tracer_provider=provider)
            path = root / str(next(saves))
            start = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=str(path))
            took = time.perf_counter() - start
            future.result()
            if instrumented:
                dcp_otel.flush()
                dcp_otel.uninstrument()
            shutil.rmtree(path, ignore_errors=True)
            return {"s": took}

        # (the first round warms up, uncounted)
        times = interleave({"plain": lambda: arm(False), "instrumented": lambda: arm(True)}, args.rounds, warm=1)
    shutil.rmtree(root, ignore_errors=True)
    plain, traced = median(times, "plain", "s"), median(times, "instrumented", "s")
    print(f"the walk alone: {walk * 1000:.2f} ms for {args.tensors} tensors ({walk / args.tensors * 1e6:.2f} us each)")
    print(f"async_save time to return, {args.tensors} tensors, medians of {args.rounds} interleaved rounds: "
          f"plain {plain * 1000:.1f} ms, instrumented {traced * 1000:.1f} ms, ratio {traced / plain:.3f} "
          f"(added {(traced - plain) * 1000:+.1f} ms, the walk {walk * 1000:.1f} ms of it at most)")  # fmt: skip


if __name__ == "__main__":
    main()
