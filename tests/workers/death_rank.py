"""A rank of a 2-rank torchrun job that dies inside ``write_data`` of its second save, the way ranks die.

Usage (under ``torchrun --nproc-per-node 2``, or ``dcp-otel-run``, with or without ``opentelemetry-instrument``)::

    death_rank.py OUT --death {SIGKILL,SIGABRT,SEGV,SIGTERM} [--instrument] [--otlp]

Each rank saves ``OUT/ckpt/step-1`` (it completes), then ``OUT/ckpt/step-2``; rank 1's ``write_data``
of that save dies: SIGKILL (the OOM killer), SIGABRT (``os.abort()``: NCCL's watchdog), SEGV (a segfault in
a storage plugin: ``ctypes.string_at(0)``) or SIGTERM (the scheduler's). Rank 0 writes its part and waits
for rank 1 in DCP's collective until torchrun stops it. ``--instrument`` calls ``dcp_otel.instrument()``
with a provider of its own (``--otlp``: an OTLP/HTTP exporter to ``$OTEL_EXPORTER_OTLP_ENDPOINT``; else
spans to ``OUT/traces/rank-N.jsonl``); without it the job is plain, or instrumented by
``opentelemetry-instrument``. Each rank says in ``OUT/rank-N.txt`` what it did, the test compares those,
the exit statuses and the checkpoint files plain vs instrumented. A restart (``TORCHELASTIC_RESTART_COUNT``
above 0) loads ``step-1`` and saves ``step-3``, and nobody dies; with ``DEATH_WAIT_REPORTED`` set it then runs
on until the spool shows a record reported (a real job trains on for longer), at most 30 s.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

warnings.simplefilter("ignore")


class Dying(dcp.FileSystemWriter):
    """``write_data`` of the dying rank: says it is there, then dies by ``death``."""

    def __init__(self, path: str, death: str, marker: Path) -> None:
        super().__init__(path)
        self.death, self.marker = death, marker

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        self.marker.write_text(str(os.getpid()))
        if self.death == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.death == "SIGABRT":
            os.abort()
        elif self.death == "SEGV":
            ctypes.string_at(0)
        elif self.death == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(60)  # (a signal's death is asynchronous: it lands here)
        return super().write_data(plan, planner)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--death", default="SIGKILL")
    parser.add_argument("--instrument", action="store_true")
    parser.add_argument("--otlp", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.instrument:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        import dcp_otel

        provider = TracerProvider(resource=Resource.create({"service.name": "death-rank", "rank": rank}))
        if args.otlp:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            from dcp_otel.otlp_file import OTLPJsonFileExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(out / "traces" / f"rank-{rank}.jsonl")))
        dcp_otel.instrument(tracer_provider=provider)
        dcp_otel.set_training_step(1)
    # Keys of this generation's own (as tests/workers/life_rank.py): the agent's store keeps the first generation's
    # gloo addresses, and a restarted rank that reads them fails or hangs connecting (plain torch the same).
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=timedelta(seconds=60))  # fmt: skip
    dist.init_process_group("gloo", store=dist.PrefixStore(f"generation-{restart}", agent_store), rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=60))  # fmt: skip
    said = out / f"rank-{rank}.txt"
    state = {"w": torch.arange(64.0) + rank}
    ckpt = out / "ckpt"
    if restart:
        dcp.load(state, checkpoint_id=str(ckpt / "step-1"))
        dcp.save(state, checkpoint_id=str(ckpt / "step-3"))
        with said.open("a") as note:
            note.write("saved step-3\n")
        if os.environ.get("DEATH_WAIT_REPORTED"):  # (a training job runs on: this one waits for its survivor)
            spool, pause = Path(os.environ["DCP_OTEL_SPOOL_DIR"]), threading.Event()
            for _ in range(300):
                if any(name.endswith(".reported") for name in os.listdir(spool)):
                    break
                pause.wait(0.1)
        dist.destroy_process_group()
        return
    dcp.save(state, checkpoint_id=str(ckpt / "step-1"))
    with said.open("a") as note:
        note.write("saved step-1\n")
    if args.instrument:
        import dcp_otel

        dcp_otel.set_training_step(2)
    writer = Dying(str(ckpt / "step-2"), args.death, out / f"dying-{rank}") if rank == 1 else \
        dcp.FileSystemWriter(str(ckpt / "step-2"))  # fmt: skip
    dcp.save(state, storage_writer=writer)
    with said.open("a") as note:
        note.write("saved step-2\n")  # (never: rank 1 dies in it, rank 0 waits for it)
    sys.exit(0)


if __name__ == "__main__":
    main()
