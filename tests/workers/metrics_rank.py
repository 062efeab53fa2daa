"""One rank of a real job whose metrics the test scrapes over HTTP (gloo on CPU).

Zero code for metrics: the test sets ``DCP_OTEL_METRICS_PORT`` (base port),
``DCP_OTEL_METRICS_ADDR=127.0.0.1`` and ``LOCAL_RANK``; ``instrument()`` serves.
The rank saves, loads and async-saves, prints ``READY <url> <written bytes>``
(url ``none`` when another rank serves it, as in Prometheus multiprocess
mode), and stays up until a line arrives on stdin (the test has scraped by then).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider

import dcp_otel
from tests.workers import rank_parser


def main() -> None:
    args = rank_parser().parse_args()
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world)
    dcp_otel.instrument(tracer_provider=TracerProvider())
    state = {"w": torch.full((1000 * (args.rank + 1),), float(args.rank))}  # ranks write different amounts
    sharded = {f"rank{args.rank}": state["w"]}  # each rank's own key: no de-duplication across ranks
    dcp.save(sharded, checkpoint_id=os.path.join(args.ckpt, "c"))
    dcp.load(sharded, checkpoint_id=os.path.join(args.ckpt, "c"))
    dcp.async_save(sharded, checkpoint_id=os.path.join(args.ckpt, "a")).result()
    dcp_otel.flush(timeout_s=30)
    endpoint = dcp_otel.DCPInstrumentor().metrics_endpoint  # None: another rank serves (multiprocess mode)
    dist.barrier()  # every rank has recorded before anyone is scraped
    url = endpoint.url if endpoint is not None else "none"
    print(f"READY {url} {sharded[f'rank{args.rank}'].numel() * 4}", flush=True)
    sys.stdin.readline()  # the test scraped us
    dist.barrier()
    dcp_otel.uninstrument()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
