"""A rank of a 2-rank torchrun job that saves, saves asynchronously and loads, with no dcp-otel code of its own.

Usage (under ``torchrun --nproc-per-node 2``, plain or under ``opentelemetry-instrument``)::

    node_rank.py OUT

It adds a span processor of its own to the global tracer provider (where one is set) and writes to
``OUT/rank-N.txt`` what it did, then how many ``dcp.*`` spans passed through its own provider: under
``DCP_OTEL_SPAN_EXPORT=node`` none may (the agent sends them), under the default all of them do.
"""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry import trace

warnings.simplefilter("ignore")


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    seen: list[str] = []
    add = getattr(trace.get_tracer_provider(), "add_span_processor", None)
    if add is not None:  # (under opentelemetry-instrument: the SDK's provider)
        from opentelemetry.sdk.trace import SpanProcessor

        class Seen(SpanProcessor):
            def on_end(self, span) -> None:  # type: ignore[no-untyped-def,override]
                seen.append(span.name)

        add(Seen())
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    said = out / f"rank-{rank}.txt"
    state = {"w": torch.arange(64.0) + rank, "b": torch.ones(8)}
    ckpt = out / "ckpt"
    dcp.save(state, checkpoint_id=str(ckpt / "step-1"))
    dcp.async_save(state, checkpoint_id=str(ckpt / "step-2")).result()
    loaded = {"w": torch.zeros(64), "b": torch.zeros(8)}
    dcp.load(loaded, checkpoint_id=str(ckpt / "step-2"))
    with said.open("a") as note:
        note.write(f"saved step-1 step-2, loaded {float(loaded['w'].sum())}\npid {os.getpid()}\n")
    dist.destroy_process_group()
    with said.open("a") as note:  # (the spans of the last call are built after it returns: flushed first)
        if add is not None:
            import dcp_otel

            dcp_otel.flush()
        note.write(f"own dcp spans {sum(name.startswith('dcp.') for name in seen)}\n")


if __name__ == "__main__":
    main()
