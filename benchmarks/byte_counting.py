"""Counting a load's bytes: what the caller's thread pays, side by side with the count itself.

A load's local plan can hold hundreds of thousands of read items. Summing their
lengths (what dcp-otel did on the caller's thread, right before DCP's
collective) is now the builder's job; the caller only keeps a reference to the
plan (``SpanRecorder.on_gathered``). This prints both, for 100k and 500k items.

Usage::

    .venv/bin/python benchmarks/byte_counting.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: E402
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem  # noqa: E402

from dcp_otel.config import InstrumentOptions  # noqa: E402
from dcp_otel.tracing.measure import planned_read_bytes  # noqa: E402
from dcp_otel.tracing.records import Call, Operation  # noqa: E402
from dcp_otel.tracing.tracker import SpanRecorder  # noqa: E402


def plan_of(items: int) -> tuple[LoadPlan, dict[MetadataIndex, SimpleNamespace]]:
    reads, storage = [], {}
    for i in range(items):
        index = MetadataIndex(f"t{i}", torch.Size([0]))
        reads.append(ReadItem(LoadItemType.TENSOR, index, torch.Size([0]), index, torch.Size([0]), torch.Size([4])))
        storage[index] = SimpleNamespace(length=16, offset=16 * i)
    return LoadPlan(reads), storage


def best_of(repeats: int, fn) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    recorder = SpanRecorder(InstrumentOptions())
    op = Operation("load", 0, None, {}, 1, None)  # type: ignore[arg-type]
    call = Call("u", "load", 1, 1, None, op, {})
    print(f"{'read items':>10}  {'summed (builder)':>16}  {'caller thread':>13}  {'ratio':>9}")
    for items in (100_000, 500_000):
        plan, storage = plan_of(items)
        summed = best_of(3, lambda: planned_read_bytes(plan, SimpleNamespace(storage_data=storage)))  # noqa: B023
        recorder._stack().append(call)

        def keep() -> None:
            recorder.on_gathered(plan)  # noqa: B023
            op.gathered.clear()

        caller = best_of(3, keep)
        recorder._stack().pop()
        print(f"{items:>10}  {summed * 1e3:>14.1f}ms  {caller * 1e6:>11.1f}us  {caller / summed:>9.6f}")
    recorder.close()


if __name__ == "__main__":
    main()
