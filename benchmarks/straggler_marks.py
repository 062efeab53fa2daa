"""What naming the straggler costs the coordinator of a save at 10,000 ranks: its write gather's unpickling.

Every instrumented rank's write results travel with a mark (``dcp_otel/attach/arrivals.py``), and the
coordinator unpickles them with the recording unpickler. This times, side by side in interleaved blocks,
the coordinator's unpickling of ``--ranks`` ranks' write results (``--items`` ``WriteResult`` each, as
``FileSystemWriter`` makes them) plain and marked, the builder's naming from the marks (its own thread),
and each rank's pickling of its results, and prints the bytes a mark adds per rank.

What it leaves out: the gather itself (the marked results are about 50 bytes longer per rank, which gloo
and NCCL move with the rest) and everything else of the save; so it is the part that grows with the world,
measured alone. The coordinator unpickles while every other rank waits for its broadcast, so what it adds
here is added to the save on every rank.

Usage::

    .venv/bin/python benchmarks/straggler_marks.py [--ranks 10000] [--items 16] [--blocks 5]
"""

from __future__ import annotations

import argparse
import gc
import io
import itertools
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab import Measures, Results, interleave, median, per_call  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: E402
from torch.distributed.checkpoint.storage import WriteResult  # noqa: E402

from dcp_otel.attach import arrivals  # noqa: E402
from dcp_otel.tracing.detail import named_straggler  # noqa: E402


def results_of(rank: int, items: int) -> list[WriteResult]:
    return [WriteResult(MetadataIndex(f"model.layers.{rank}.{i}.weight", None, None), 1 << 20,
                        _StorageInfo(Path(f"__{rank}_0.distcp"), i << 20, 1 << 20)) for i in range(items)]  # fmt: skip


def unpickled(bufs: list[bytes], every: list[list[WriteResult]], chunks: range, marks: bool) -> Callable[[], Measures]:
    """An arm: the coordinator's unpickling of the next of ``chunks`` of ranks' results (plain, or marked and noted),
    in seconds per rank; it stops when what it unpickled is not what the ranks wrote."""
    starts = itertools.cycle(chunks)

    def arm() -> Measures:
        start = next(starts)
        part = bufs[start:start + chunks.step]
        t0 = time.perf_counter()
        if marks:
            with arrivals.receiving() as noted:
                got = [arrivals.RecordingUnpickler(io.BytesIO(buf)).load() for buf in part]
        else:
            got = [pickle.Unpickler(io.BytesIO(buf)).load() for buf in part]
        took = (time.perf_counter() - t0) / len(part)
        # the same results, all noted
        assert got == every[start:start + chunks.step] and (not marks or len(noted) == len(part))
        return {"s": took}

    return arm


def pickled(every: list[list[WriteResult]], chunks: range, mark: bool) -> Callable[[], Measures]:
    """An arm: each rank's side, its pickling of its results (plain, or marked), in seconds per rank, over the next
    of ``chunks`` of ranks."""
    starts = itertools.cycle(chunks)

    def arm() -> Measures:
        start = next(starts)
        t0 = time.perf_counter()
        for rank in range(start, start + chunks.step):
            pickle.dumps(arrivals.tag(every[rank], rank, 1) if mark else every[rank])
        return {"s": (time.perf_counter() - t0) / chunks.step}

    return arm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=10_000)
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    every = [results_of(rank, args.items) for rank in range(args.ranks)]
    plain = [pickle.dumps(results) for results in every]
    marked = [pickle.dumps(arrivals.tag(results, rank, 1_000_000 + rank)) for rank, results in enumerate(every)]
    # Per chunk of ranks, each arm's seconds per rank; the arms alternate chunk by chunk (and which goes first),
    # and the medians over every chunk of every block are taken: this 2-core VM has pauses of its own (up to 20 us
    # in a 55 us unpickling), which a sum would charge to whichever arm they hit.
    ranks = args.ranks
    gathered, sent = range(0, ranks, 250), range(0, min(ranks, 2000), 100)  # (each rank's side: the same way)
    unpickling = {"plain": unpickled(plain, every, gathered, marks=False),
                  "marked": unpickled(marked, every, gathered, marks=True)}  # fmt: skip
    pickling = {"pickle plain": pickled(every, sent, mark=False), "pickle marked": pickled(every, sent, mark=True)}
    every_mark = [(rank, 1_000_000 + rank) for rank in range(ranks)]
    found: Results = {"named": []}
    # The collector off while timing: its pauses scale with this script's results held for the comparison, not
    # with either arm.
    gc.collect()
    gc.disable()
    for _ in range(args.blocks):
        for arms, rounds in ((unpickling, len(gathered)), (pickling, len(sent))):
            for arm, samples in interleave(arms, rounds).items():
                found.setdefault(arm, []).extend(samples)
        found["named"].append({"s": per_call(lambda: named_straggler(every_mark))})
        gc.collect()  # (between blocks, untimed)
    med = {name: median(found, name, "s") for name in found}
    extra = statistics.mean(len(m) - len(p) for m, p in zip(marked, plain, strict=True))
    print(f"the coordinator's write gather at {ranks:,} ranks of {args.items} write results each "
          f"(medians over {args.blocks} blocks of chunks of {gathered.step} ranks, arms interleaved)")  # fmt: skip
    print(f"  unpickling, plain / marked       {med['plain'] * ranks * 1e3:8.1f} / {med['marked'] * ranks * 1e3:8.1f} ms   "
          f"ratio {med['marked'] / med['plain']:.3f}   added {(med['marked'] - med['plain']) * ranks * 1e3:+.1f} ms")  # fmt: skip
    print(f"  naming from the marks (builder)  {med['named'] * 1e3:8.1f} ms")
    print(f"  one rank's pickling, plain / marked  {med['pickle plain'] * 1e6:.1f} / {med['pickle marked'] * 1e6:.1f} us"
          f"   added {(med['pickle marked'] - med['pickle plain']) * 1e6:+.1f} us")  # fmt: skip
    print(f"  bytes a mark adds per rank       {extra:.0f} B (of {statistics.mean(map(len, plain)):.0f} B)")


if __name__ == "__main__":
    main()
