"""Process-based async_save whose daemon exports spans to a hung collector.

Usage: ``daemon_hung_exporter.py MASTER_PORT``, with ``OTEL_EXPORTER_OTLP_ENDPOINT``
naming an endpoint that accepts connections and never answers. The rank keeps its
spans in memory; the daemon builds its SDK from the inherited ``OTEL_*``
variables, so only the daemon talks to the hung collector. The first save starts
the daemon; the second is the one measured. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import warnings
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import dcp_otel

#: Far below the flush timeout (60 s) and the exporter's own timeout (60 s) the test sets.
UPLOAD_BOUND_S = 30.0

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("cpu:gloo")
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
    folder = tempfile.mkdtemp()
    outcomes = []
    for step in (1, 2):
        started = time.monotonic()
        response = dcp.async_save({"w": torch.arange(10.0) * step}, checkpoint_id=f"{folder}/step-{step}",
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS)  # fmt: skip
        future = getattr(response, "upload_completion", response)
        try:
            result = type(future.result(timeout=600 if step == 1 else UPLOAD_BOUND_S)).__name__
        except FutureTimeout:
            result = "timed out"
        outcomes.append({"result": result, "seconds": round(time.monotonic() - started, 2)})
    loaded = {"w": torch.zeros(10)}
    if outcomes[-1]["result"] != "timed out":
        dcp.load(loaded, checkpoint_id=f"{folder}/step-2")
    dcp_otel.flush(timeout_s=5)
    print(json.dumps({"outcomes": outcomes, "loaded": loaded["w"].tolist(),
                      "spans": sorted({s.name for s in exporter.get_finished_spans()})}), flush=True)  # fmt: skip
    dist.destroy_process_group()
