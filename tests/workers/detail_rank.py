"""One rank of a job with one slow rank and one rank that fails once (gloo on CPU).

Run as ``python detail_rank.py --rank R --world N ... --slow-rank S --fail-rank F --saves K``:
``K`` saves of a small state dict; on rank ``S`` every ``write_data`` takes
``--slow-s`` seconds longer; on rank ``F`` the second save's ``write_data`` raises
ENOSPC. Spans go to ``DIR/spans-R.jsonl`` in OTLP JSON (what ``dcp-otel report``
reads), with whatever ``DCP_OTEL_DETAIL`` / ``DCP_OTEL_SPAN_BUDGET`` say.
"""

from __future__ import annotations

import errno
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import dcp_otel
from dcp_otel.otlp_file import OTLPJsonFileExporter
from tests.workers import rank_parser


class UnevenWriter(dcp.FileSystemWriter):
    slow_rank = -1
    slow_s = 0.0
    fail_rank = -1
    fail = False

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if dist.get_rank() == self.slow_rank:
            time.sleep(self.slow_s)  # the straggler being simulated, not synchronisation
        if self.fail and dist.get_rank() == self.fail_rank:
            raise OSError(errno.ENOSPC, "No space left on device (injected by the test)")
        return super().write_data(plan, planner)


def main() -> None:
    parser = rank_parser()
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(os.path.join(args.out, f"spans-{args.rank}.jsonl"))))
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world)
    dcp_otel.instrument(tracer_provider=provider)
    UnevenWriter.slow_rank, UnevenWriter.slow_s, UnevenWriter.fail_rank = args.slow_rank, args.slow_s, args.fail_rank
    state = {f"rank{args.rank}": torch.full((256,), float(args.rank))}  # a key of its own: every rank writes
    for i in range(args.saves):
        UnevenWriter.fail = i == 1
        try:
            dcp.save(state, storage_writer=UnevenWriter(os.path.join(args.ckpt, f"step-{i}")))
        except BaseException:  # noqa: BLE001 - CheckpointException: every rank learns of rank F's failure
            pass
    dcp_otel.flush(timeout_s=60)
    dcp_otel.uninstrument()
    provider.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
