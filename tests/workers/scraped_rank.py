"""One rank of a run that a real Prometheus scrapes while it checkpoints (gloo on CPU).

Zero code for metrics and discovery: the test sets ``DCP_OTEL_METRICS_PORT``,
``DCP_OTEL_METRICS_ADDR``, ``DCP_OTEL_FILE_SD_DIR`` and the run's id. The rank
waits until Prometheus has scraped it once, then twice saves, loads and
async-saves and waits for another scrape (Prometheus has the results), prints ``READY <url>``
and stays up until a line arrives on stdin.
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

SCRAPE_TIMEOUT_S = 120


def main() -> None:
    args = rank_parser().parse_args()
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world)
    dcp_otel.instrument(tracer_provider=TracerProvider())
    endpoint = dcp_otel.DCPInstrumentor().metrics_endpoint
    assert endpoint is not None and endpoint.wait_for_scrape(SCRAPE_TIMEOUT_S), "never scraped"
    state = {f"rank{args.rank}": torch.full((1000 * (args.rank + 1),), float(args.rank))}
    for n in range(2):  # a scrape between the two rounds and after them: the rates see both
        dcp.save(state, checkpoint_id=os.path.join(args.ckpt, f"c{n}"))
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt, f"c{n}"))
        dcp.async_save(state, checkpoint_id=os.path.join(args.ckpt, f"a{n}")).result()
        dcp_otel.flush(timeout_s=30)
        dist.barrier()
        assert endpoint.wait_for_scrape(SCRAPE_TIMEOUT_S), "never scraped after the checkpoints"
    print(f"READY {endpoint.url}", flush=True)
    sys.stdin.readline()  # the test has queried Prometheus
    dist.barrier()
    dcp_otel.uninstrument()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
