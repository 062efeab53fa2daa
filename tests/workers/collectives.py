"""Counts torch.distributed calls during a save and a load, plain and instrumented (2 ranks).

Every collective and point-to-point function of ``torch.distributed`` is wrapped
with a counter before anything runs; the rank runs the same save and load
without dcp-otel, then with it, and writes both counts to ``DIR/calls-R.json``.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider

import dcp_otel
from tests.workers import rank_parser

COLLECTIVES = ("all_gather", "all_gather_object", "all_reduce", "barrier", "broadcast", "broadcast_object_list",
               "gather", "gather_object", "reduce", "reduce_scatter", "scatter", "scatter_object_list", "send",
               "recv", "isend", "irecv", "all_to_all", "monitored_barrier")  # fmt: skip
calls: Counter[str] = Counter()


def counting(name: str, fn):  # type: ignore[no-untyped-def]
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def main() -> None:
    args = rank_parser().parse_args()
    warnings.simplefilter("ignore")
    import torch.distributed.distributed_c10d as c10d

    for name in COLLECTIVES:  # DCP calls them as dist.<name>, which resolves through the module
        if hasattr(c10d, name):
            setattr(dist, name, counting(name, getattr(c10d, name)))
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world)
    state = {"w": torch.ones(256) * args.rank}
    counts = {}
    for arm in ("plain", "traced"):
        if arm == "traced":
            dcp_otel.instrument(tracer_provider=TracerProvider())
        calls.clear()
        dcp.save(state, checkpoint_id=str(args.ckpt / arm))
        dcp.load(state, checkpoint_id=str(args.ckpt / arm))
        counts[arm] = dict(calls)
    dcp_otel.uninstrument()
    (args.out / f"calls-{args.rank}.json").write_text(json.dumps(counts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
