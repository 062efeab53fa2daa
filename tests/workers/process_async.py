"""async_save with AsyncCheckpointerType.PROCESS, instrumented, in a real process.

torch starts the checkpoint daemon with ``spawn``, which re-imports this file:
hence the ``__main__`` guard. Prints one JSON line with what the caller saw.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import dcp_otel

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("cpu:gloo")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    dcp_otel.instrument(tracer_provider=provider)
    folder = tempfile.mkdtemp()
    response = dcp.async_save({"w": torch.arange(10.0)}, checkpoint_id=folder,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)  # fmt: skip
    future = getattr(response, "upload_completion", response)
    future.result(timeout=120)
    loaded = {"w": torch.zeros(10)}
    dcp.load(loaded, checkpoint_id=folder)
    dcp_otel.flush(timeout_s=30)
    print(json.dumps({
        "loaded": loaded["w"].tolist(),
        "spans": sorted({s.name for s in exporter.get_finished_spans()}),
        "diagnostics": dcp_otel.diagnostics(),
    }), flush=True)  # fmt: skip
    dcp_otel.uninstrument()
    dist.destroy_process_group()
