"""Quickstart: a tiny training job that checkpoints with DCP, traced by dcp-otel.

Run on 2 ranks (gloo on CPU)::

    torchrun --standalone --nproc-per-node 2 examples/quickstart.py --out out/quickstart

Each rank trains a small model for a few steps, ``save``s at step 2, ``async_save``s
at step 4 (training goes on while it uploads), then ``load``s the last checkpoint.
Spans go to ``<out>/traces/rank-<rank>.jsonl`` (OTLP JSON), or over OTLP/HTTP
to ``$OTEL_EXPORTER_OTLP_ENDPOINT`` when that is set (all standard ``OTEL_*``
variables apply). ``dcp-otel report <out>/traces`` reports the file output.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

import dcp_otel
from dcp_otel.otlp_file import OTLPJsonFileExporter
from dcp_otel.resource import TorchDistributedResourceDetector


def make_exporter(out: Path, rank: int) -> SpanExporter:
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )

        return OTLPSpanExporter()  # endpoint, headers, timeout from OTEL_* variables
    return OTLPJsonFileExporter(out / "traces" / f"rank-{rank}.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/quickstart"))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))

    # 1. An OpenTelemetry SDK, as any traced application has (OTEL_SERVICE_NAME etc. apply);
    #    dcp-otel's detector adds host, rank and run id to the resource.
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "dcp-otel-quickstart")})
    resource = resource.merge(TorchDistributedResourceDetector().detect())
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(make_exporter(args.out, rank)))
    trace.set_tracer_provider(provider)

    # 2. The one line dcp-otel needs.
    dcp_otel.instrument()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracer = trace.get_tracer("quickstart")
    ckpt_root = args.out / "checkpoints"
    pending = None

    for step in range(1, args.steps + 1):
        with tracer.start_as_current_span("train_step") as span:
            span.set_attribute("step", step)
            x, y = torch.randn(16, 32), torch.randn(16, 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": torch.tensor(step)}
            if step == 2:
                dcp.save(state, checkpoint_id=str(ckpt_root / f"step-{step}"))
            if step == 4:
                pending = dcp.async_save(state, checkpoint_id=str(ckpt_root / f"step-{step}"))
    if pending is not None:
        pending.result()

    restored = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": torch.tensor(0)}
    dcp.load(restored, checkpoint_id=str(ckpt_root / "step-4"))
    if rank == 0:
        print(f"rank 0: resumed from step {int(restored['step'])}", flush=True)

    dcp_otel.flush(timeout_s=30)  # the async upload's span ends just after result() returns
    dist.destroy_process_group()
    provider.shutdown()


if __name__ == "__main__":
    main()
