"""One rank of a job with one slow rank and one rank that fails once (gloo on CPU).

Run as ``python detail_rank.py --rank R --world N ... --slow-rank S --fail-rank F --saves K``:
``K`` saves of a small state dict; every rank's ``write_data`` takes ``--io-s``
seconds (storage that takes its time, as a network filesystem does: an
I/O-bound job); on rank ``S`` it takes ``--slow-s`` seconds longer, in every
save or only in those ``--slow-saves`` lists; on rank ``F`` the second save's
``write_data`` raises ENOSPC. Spans go to ``DIR/spans-R.jsonl`` in OTLP JSON (what ``dcp-otel report``
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
    io_s = 0.0
    slow_rank = -1
    slow_s = 0.0
    slow = True
    fail_rank = -1
    fail = False

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        # The storage's and the straggler's time being simulated, not synchronisation.
        time.sleep(self.io_s + (self.slow_s if self.slow and dist.get_rank() == self.slow_rank else 0.0))
        if self.fail and dist.get_rank() == self.fail_rank:
            raise OSError(errno.ENOSPC, "No space left on device (injected by the test)")
        return super().write_data(plan, planner)


def main() -> None:
    parser = rank_parser()
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--slow-saves", type=int, nargs="*", default=None, help="default: every save")
    parser.add_argument("--io-s", type=float, default=0.0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(os.path.join(args.out, f"spans-{args.rank}.jsonl"))))
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world)
    dcp_otel.instrument(tracer_provider=provider)
    UnevenWriter.slow_rank, UnevenWriter.slow_s, UnevenWriter.fail_rank = args.slow_rank, args.slow_s, args.fail_rank
    UnevenWriter.io_s = args.io_s
    state = {f"rank{args.rank}": torch.full((256,), float(args.rank))}  # a key of its own: every rank writes
    for i in range(args.saves):
        UnevenWriter.fail = i == 1
        UnevenWriter.slow = args.slow_saves is None or i in args.slow_saves
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
