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
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: E402
from torch.distributed.checkpoint.storage import WriteResult  # noqa: E402

from dcp_otel.attach import arrivals  # noqa: E402
from dcp_otel.tracing.detail import named_straggler  # noqa: E402


def results_of(rank: int, items: int) -> list[WriteResult]:
    return [WriteResult(MetadataIndex(f"model.layers.{rank}.{i}.weight", None, None), 1 << 20,
                        _StorageInfo(Path(f"__{rank}_0.distcp"), i << 20, 1 << 20)) for i in range(items)]  # fmt: skip


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
    chunk = 250
    per_rank: dict[str, list[float]] = {"plain": [], "marked": []}
    other: dict[str, list[float]] = {"named": [], "pickle plain": [], "pickle marked": []}
    # The collector off while timing: its pauses scale with this script's results held for the comparison, not
    # with either arm.
    gc.collect()
    gc.disable()
    ranks = args.ranks
    for block in range(args.blocks):
        for start in range(0, args.ranks, chunk):
            bufs = {"plain": plain[start:start + chunk], "marked": marked[start:start + chunk]}
            got: dict[str, list[object]] = {}
            for arm in ("plain", "marked") if (block + start // chunk) % 2 == 0 else ("marked", "plain"):
                t0 = time.perf_counter()
                if arm == "plain":
                    got[arm] = [pickle.Unpickler(io.BytesIO(buf)).load() for buf in bufs[arm]]
                else:
                    with arrivals.receiving() as marks:
                        got[arm] = [arrivals.RecordingUnpickler(io.BytesIO(buf)).load() for buf in bufs[arm]]
                per_rank[arm].append((time.perf_counter() - t0) / len(bufs[arm]))
            assert got["marked"] == got["plain"] and len(marks) == len(got["plain"])  # the same results, all noted
        every_mark = [(rank, 1_000_000 + rank) for rank in range(args.ranks)]
        t2 = time.perf_counter()
        named_straggler(every_mark)
        t3 = time.perf_counter()
        other["named"].append(t3 - t2)
        for start in range(0, min(ranks, 2000), 100):  # each rank's side, the same way
            for arm in ("pickle plain", "pickle marked") if (block + start // 100) % 2 == 0 else \
                    ("pickle marked", "pickle plain"):  # fmt: skip
                t0 = time.perf_counter()
                for rank in range(start, start + 100):
                    pickle.dumps(every[rank] if arm == "pickle plain" else arrivals.tag(every[rank], rank, 1))
                other[arm].append((time.perf_counter() - t0) / 100)
        gc.collect()  # (between blocks, untimed)
    med = {name: statistics.median(values) for name, values in (*per_rank.items(), *other.items())}
    extra = statistics.mean(len(m) - len(p) for m, p in zip(marked, plain, strict=True))
    print(f"the coordinator's write gather at {ranks:,} ranks of {args.items} write results each "
          f"(medians over {args.blocks} blocks of chunks of {chunk} ranks, arms interleaved)")  # fmt: skip
    print(f"  unpickling, plain / marked       {med['plain'] * ranks * 1e3:8.1f} / {med['marked'] * ranks * 1e3:8.1f} ms   "
          f"ratio {med['marked'] / med['plain']:.3f}   added {(med['marked'] - med['plain']) * ranks * 1e3:+.1f} ms")  # fmt: skip
    print(f"  naming from the marks (builder)  {med['named'] * 1e3:8.1f} ms")
    print(f"  one rank's pickling, plain / marked  {med['pickle plain'] * 1e6:.1f} / {med['pickle marked'] * 1e6:.1f} us"
          f"   added {(med['pickle marked'] - med['pickle plain']) * 1e6:+.1f} us")  # fmt: skip
    print(f"  bytes a mark adds per rank       {extra:.0f} B (of {statistics.mean(map(len, plain)):.0f} B)")


if __name__ == "__main__":
    main()
