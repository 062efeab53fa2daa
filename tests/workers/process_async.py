"""async_save with AsyncCheckpointerType.PROCESS, instrumented, in a real process.

Usage: ``process_async.py MASTER_PORT MODE OTLP_ENDPOINT``

MODE ``env``: the rank's SDK sends spans over OTLP/HTTP configured by the
``OTEL_*`` variables, which the daemon inherits. MODE ``setup``: the rank
configures its exporter in code (the endpoint is an argument, no ``OTEL_*``
variable names it), so the daemon learns it only from
``DCP_OTEL_PROCESS_SETUP`` (``daemon_setup:provider``).

torch starts the daemon with ``spawn``, which re-imports this file: hence the
``__main__`` guard. Two async saves: the first starts the daemon, the second
reuses it. Prints one JSON line with what the rank saw.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client import CollectorRegistry
from torch.distributed.checkpoint import _async_process_executor
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import dcp_otel

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    port, mode, endpoint = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
    dist.init_process_group("cpu:gloo")
    exporter = OTLPSpanExporter() if mode == "env" else OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")
    provider = TracerProvider(resource=Resource.create({"service.name": "process-async-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=provider, registry=registry)
    folder = tempfile.mkdtemp()
    results = []
    for step in (1, 2):
        response = dcp.async_save({"w": torch.arange(10.0) * step}, checkpoint_id=f"{folder}/step-{step}",
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS)  # fmt: skip
        future = getattr(response, "upload_completion", response)
        results.append(type(future.result(timeout=120)).__name__)
    loaded = {"w": torch.zeros(10)}
    dcp.load(loaded, checkpoint_id=f"{folder}/step-2")
    flushed = dcp_otel.flush(timeout_s=30)
    diagnostics = dcp_otel.diagnostics()
    samples = [[s.name, s.labels, s.value] for metric in registry.collect() for s in metric.samples]
    dcp_otel.uninstrument()  # (which unregisters the metrics: read above)
    daemon = _async_process_executor._CHECKPOINT_PROCESS
    print(json.dumps({
        "results": results,
        "loaded": loaded["w"].tolist(),
        "flushed": flushed,
        "diagnostics": diagnostics,
        "daemon_pid": daemon._save_process.pid if daemon is not None else None,
        "pid": os.getpid(),
        "threads": sorted(t.name for t in threading.enumerate()),
        "samples": samples,
    }), flush=True)  # fmt: skip
    provider.shutdown()
    dist.destroy_process_group()
