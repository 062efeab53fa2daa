"""One of 4 gloo ranks that checkpoint in two process groups, [0, 1] and [2, 3], for tests/test_failures_at_scale.py.

1. Each group saves its own checkpoint (``DIR/group-G``) with ``process_group=`` its
   group; global rank 3 (rank 1 of its group) runs out of disk in ``write_data``.
2. All 4 save one checkpoint (``DIR/world``); global rank 1 runs out of disk.

With ``detail="auto"`` and a small span budget, as at scale. Spans go to
``DIR/traces/rank-R.jsonl`` (OTLP JSON); ``DIR/result-R.json`` has what the caller got
and the rank's metrics.
"""

from __future__ import annotations

import errno
import json
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CollectorRegistry

import dcp_otel
from dcp_otel.otlp_file import OTLPJsonFileExporter
from tests.workers import rank_parser

IN_GROUP, IN_WORLD = 3, 1  # the global rank that fails in each save


class FullDisk(dcp.FileSystemWriter):
    failing = -1

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if dist.get_rank() == FullDisk.failing:
            raise OSError(errno.ENOSPC, f"No space left on device (injected on global rank {FullDisk.failing})")
        return super().write_data(plan, planner)


def save(path: str, group: object | None) -> dict[str, object]:
    try:
        dcp.save({"w": torch.full((64,), float(dist.get_rank()))}, storage_writer=FullDisk(path), process_group=group)
        return {"raised": None}
    except BaseException as exc:  # noqa: BLE001 - CheckpointException derives from BaseException
        return {"raised": type(exc).__name__, "failure_keys": sorted(getattr(exc, "failures", {}))}


def main() -> None:
    args = rank_parser().parse_args()
    warnings.simplefilter("ignore")
    rank = args.rank
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=args.world)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in the same order
    mine = rank // 2
    provider = TracerProvider(resource=Resource.create({"service.name": "subgroups", "test.rank": rank}))
    provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(args.out / "traces" / f"rank-{rank}.jsonl")))
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=provider, registry=registry, detail="auto", span_budget=16)
    FullDisk.failing = IN_GROUP
    result: dict[str, object] = {"group": save(str(args.ckpt / f"group-{mine}"), groups[mine])}
    FullDisk.failing = IN_WORLD
    result["world"] = save(str(args.ckpt / "world"), None)
    assert dcp_otel.flush(timeout_s=60, tracer_provider=provider)
    result["samples"] = [(s.name, s.labels, s.value) for m in registry.collect() for s in m.samples
                         if s.name.startswith(("dcp_failures", "dcp_operations"))]  # fmt: skip
    dcp_otel.uninstrument()
    provider.shutdown()
    dist.destroy_process_group()
    with open(os.path.join(args.out, f"result-{rank}.json"), "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
