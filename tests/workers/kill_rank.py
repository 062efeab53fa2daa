"""A 2-rank save during which rank 1 is killed with SIGKILL (run by tests/test_faults.py).

Rank 1 kills itself inside ``write_data``, as the OOM killer or a node failure
would. Rank 0's save then fails once torch notices (gloo: the peer's connection
closes). Each rank exports every span as it ends (OTLP JSON, ``DIR/rank-R.jsonl``);
rank 0 writes what its caller saw to ``DIR/result-0.json``.
"""

from __future__ import annotations

import json
import os
import signal
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import dcp_otel
from dcp_otel.otlp_file import OTLPJsonFileExporter
from tests.workers import rank_parser


class DyingWriter(dcp.FileSystemWriter):
    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().write_data(plan, planner)


def main() -> None:
    args = rank_parser().parse_args()
    warnings.simplefilter("ignore")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPJsonFileExporter(args.out / f"rank-{args.rank}.jsonl")))
    dcp_otel.instrument(tracer_provider=provider)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=30))  # fmt: skip
    caught = None
    try:
        dcp.save({"w": torch.ones(1024)}, storage_writer=DyingWriter(str(args.ckpt)))
    except BaseException as exc:  # noqa: BLE001 - what the caller sees is the point
        caught = {"type": type(exc).__name__, "message": str(exc)[:300]}
    dcp_otel.flush(timeout_s=10)
    result = {"caught": caught, "open_spans": dcp_otel.DCPInstrumentor().recorder.open_count()}
    (args.out / f"result-{args.rank}.json").write_text(json.dumps(result))
    os._exit(0)  # the process group cannot be destroyed cleanly with a dead peer


if __name__ == "__main__":
    main()
