"""One of 2 gloo ranks where rank 0 alone uses more checkpoint ids than a sequence table holds, for
tests/test_sequence_tables.py.

The table bound is lowered to 4 before instrumenting. In order:

1. both ranks save ``CKPT/best``;
2. rank 0 alone saves 6 ids of its own with ``no_dist=True``, then 6 more on a process group of its own
   (``new_group([0])``: every rank creates both one-rank groups, in the same order);
3. both ranks save ``CKPT/best`` again, then load it.

With one table per process, rank 0 would have forgotten ``best`` in step 2 and rank 1 not: the second
save would be two traces. Spans go to ``OUT/spans-R.jsonl``.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcp_otel
from dcp_otel.tracing import trace_ids
from tests.workers import file_provider, finish_rank, rank_parser

BOUND, OWN_IDS = 4, 6


def main() -> None:
    args = rank_parser().parse_args()
    warnings.simplefilter("ignore")
    rank = args.rank
    trace_ids.MAX_KEYS = BOUND
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=args.world)
    alone = [dist.new_group([member]) for member in range(args.world)]
    provider, spans_file = file_provider(args.out, rank, "asymmetric")
    dcp_otel.instrument(tracer_provider=provider, run_id="asymmetric")
    state = {"w": torch.full((8,), float(rank))}
    best = str(args.ckpt / "best")
    dcp.save(state, checkpoint_id=best)
    if rank == 0:
        for n in range(OWN_IDS):
            dcp.save(state, checkpoint_id=str(args.ckpt / f"rank0-only-{n}"), no_dist=True)
        for n in range(OWN_IDS):
            dcp.save(state, checkpoint_id=str(args.ckpt / f"group0-only-{n}"), process_group=alone[0])
    dcp.save(state, checkpoint_id=best)
    dcp.load(state, checkpoint_id=best)
    finish_rank(provider, spans_file, args.out, rank, {"loaded": state["w"].tolist()})


if __name__ == "__main__":
    main()
