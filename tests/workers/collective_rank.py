"""One of 3 gloo ranks whose checkpoints spend their time in DCP's collectives, for tests/test_dcp_collectives.py.

1. ``DIR/ckpt/slow-plan``: a save in which rank 2's local plan takes ``PLAN_S`` (a planner with
   much to do): ranks 0 and 1 wait for it in the plan's collectives.
2. A load of it (each rank reads its own key).
3. ``DIR/ckpt/gone``: a save in which rank 2's process ends in ``write_data`` (killed, as by the
   kernel's OOM killer) after its spans of 1 and 2 were exported: ranks 0 and 1 fail in the write's
   collectives, not in their own code.

``detail="full"``. Spans go to ``DIR/traces/rank-R.jsonl`` (OTLP JSON); ``DIR/result-R.json`` has
what each call returned or raised and the rank's failure counts.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CollectorRegistry

import dcp_otel
from dcp_otel import semconv
from dcp_otel.otlp_file import OTLPJsonFileExporter
from tests.workers import rank_parser

SLOW, PLAN_S, GONE = 2, 0.6, 2


class SlowPlanner(dcp.DefaultSavePlanner):
    def create_local_plan(self):  # type: ignore[no-untyped-def]
        if dist.get_rank() == SLOW:
            time.sleep(PLAN_S)  # the planner's work being simulated, not synchronisation
        return super().create_local_plan()


class DyingWriter(dcp.FileSystemWriter):
    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if dist.get_rank() == GONE:
            os._exit(9)  # the process ends here, as a killed one does: nothing is flushed
        return super().write_data(plan, planner)


def main() -> None:
    args = rank_parser().parse_args()
    warnings.simplefilter("ignore")
    rank = args.rank
    # A bounded timeout: a rank whose peer is gone must not wait for gloo's default 30 minutes.
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    provider = TracerProvider()
    (args.out / "traces").mkdir(exist_ok=True)
    provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(args.out / "traces" / f"rank-{rank}.jsonl")))
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=provider, registry=registry, detail="full")
    result: dict[str, object] = {}
    state = {f"rank{rank}": torch.full((1024,), float(rank))}
    # The ranks start the save together: how long a rank waits must be rank 2's plan, not a slower start-up of
    # its own (the test worker's barrier; dcp_otel adds none).
    dist.barrier()
    dcp.save(state, checkpoint_id=str(args.ckpt / "slow-plan"), planner=SlowPlanner())
    target = {f"rank{rank}": torch.zeros(1024)}
    dcp.load(target, checkpoint_id=str(args.ckpt / "slow-plan"))
    result["loaded"] = float(target[f"rank{rank}"][0])
    dcp_otel.flush(timeout_s=60)  # what rank 2 exported before it is killed stays in its file
    try:
        dcp.save(state, storage_writer=DyingWriter(str(args.ckpt / "gone")))
        result["raised"] = None
    except BaseException as exc:  # noqa: BLE001 - what a peer's end raises in gloo
        result["raised"] = type(exc).__name__
    dcp_otel.flush(timeout_s=60)
    result["failures"] = sum(
        s.value for m in registry.collect() if m.name == semconv.METRIC_FAILURES for s in m.samples
        if s.name.endswith("_total")
    )  # fmt: skip
    result["failed_saves"] = sum(
        s.value for m in registry.collect() if m.name == semconv.METRIC_OPERATIONS for s in m.samples
        if s.name.endswith("_total") and s.labels.get("status") == "failure"
    )  # fmt: skip
    (args.out / f"result-{rank}.json").write_text(json.dumps(result))
    dcp_otel.uninstrument()
    provider.shutdown()
    # No destroy_process_group: the group lost a rank. Leave as a job whose peer died does.
    os._exit(0)


if __name__ == "__main__":
    main()
