"""One of 4 gloo ranks where one rank is slow in every save, for tests/test_straggler_named.py.

Rank ``--slow-rank`` spends 0.6 s more in each ``write_data`` (a slow disk or node). In order:

1. one save before instrumenting: what DCP's coordinator received from the ranks, plain;
2. unless this rank is in ``--plain-ranks``, ``dcp_otel.instrument(detail="auto", span_budget=16)``;
3. ``--saves`` saves, then a load of the last one.

The coordinator's storage writer keeps a digest of the write results its ``finish`` was given (pickled),
for every save: with and without dcp-otel they must be the same bytes. Spans go to ``OUT/spans-R.jsonl``,
what the rank saw to ``OUT/result-R.json``.
"""

from __future__ import annotations

import hashlib
import pickle
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcp_otel
from tests.workers import file_provider, finish_rank, rank_parser

SLOW_S = 0.6


class SlowOnOneRank(dcp.FileSystemWriter):
    slow_rank = -1
    digests: list[str] = []

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if dist.get_rank() == SlowOnOneRank.slow_rank:
            time.sleep(SLOW_S)  # the slow disk itself, not a wait for anything
        return super().write_data(plan, planner)

    def finish(self, metadata, results):  # type: ignore[no-untyped-def]
        SlowOnOneRank.digests.append(hashlib.sha256(pickle.dumps(results)).hexdigest())
        return super().finish(metadata, results)


def main() -> None:
    parser = rank_parser()
    parser.add_argument("--slow-rank", type=int, required=True)
    parser.add_argument("--plain-ranks", default="")
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rank = args.rank
    SlowOnOneRank.slow_rank = args.slow_rank
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=args.world)
    provider, spans_file = file_provider(args.out, rank, "straggler")
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.full((64,), 7.0)}  # replicated, as DCP reads it
    dcp.save(state, storage_writer=SlowOnOneRank(str(args.ckpt / "plain")))
    if str(rank) not in args.plain_ranks.split(","):
        dcp_otel.instrument(tracer_provider=provider, run_id="straggler", detail="auto", span_budget=16)
    for n in range(args.saves):
        dcp.save(state, storage_writer=SlowOnOneRank(str(args.ckpt / f"step-{n}")))
    loaded = {"w": torch.zeros(4096), "b": torch.zeros(64)}
    dcp.load(loaded, checkpoint_id=str(args.ckpt / f"step-{args.saves - 1}"))
    same = all(torch.equal(loaded[k], state[k]) for k in state)
    finish_rank(provider, spans_file, args.out, rank, {"digests": SlowOnOneRank.digests, "loaded_same": same})


if __name__ == "__main__":
    main()
