"""async_save with AsyncCheckpointerType.PROCESS whose checkpoint daemon cannot start.

Usage: ``daemon_start_fails.py MASTER_PORT SPANS_FILE``. The daemon is told to
join its process group through a prefix store on port 70000, which does not
exist: it fails at once and torch's ``create_checkpoint_daemon_process`` raises
without logging an end or an exception. Prints one JSON line with what the
rank saw. torch spawns the daemon, which re-imports this file: hence the guard.
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
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import dcp_otel
from dcp_otel.otlp_file import OTLPJsonFileExporter

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    port, spans_file = sys.argv[1], sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
    dist.init_process_group("cpu:gloo")
    # What the daemon will use: a prefix store on a port that cannot exist.
    os.environ.update(DCP_USE_PREFIX_STORE="1", MASTER_PORT="70000")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPJsonFileExporter(spans_file)))
    dcp_otel.instrument(tracer_provider=provider)
    folder = tempfile.mkdtemp()
    raised = None
    try:
        response = dcp.async_save({"w": torch.arange(10.0)}, checkpoint_id=f"{folder}/step-1",
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS)  # fmt: skip
        getattr(response, "upload_completion", response).result(timeout=120)
    except BaseException as exc:  # noqa: BLE001 - what the caller gets, for the test
        raised = type(exc).__name__
    flushed = dcp_otel.flush(timeout_s=30)
    print(json.dumps({"raised": raised, "flushed": flushed, "diagnostics": dcp_otel.diagnostics()}))
    dcp_otel.uninstrument()
    provider.shutdown()
    dist.destroy_process_group()
