"""Two process-based async_saves issued back to back, before the first daemon is up.

Usage: ``daemon_two_saves.py MASTER_PORT``. torch gives each save that finds no
daemon its own ``_ProcessGroupInitInfo`` (and dcp-otel each one a metrics pipe);
both saves then race to start a daemon. A third save reuses whichever daemon
torch kept. Prints one JSON line: each save's outcome and the rank's metrics.
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
from prometheus_client import CollectorRegistry
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import dcp_otel


def outcome(response: object) -> str:
    future = getattr(response, "upload_completion", response)
    try:
        return type(future.result(timeout=300)).__name__  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        return f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("cpu:gloo")
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=TracerProvider(), registry=registry)
    folder = tempfile.mkdtemp()

    def save(step: int) -> object:
        return dcp.async_save({"w": torch.arange(10.0) * step}, checkpoint_id=f"{folder}/step-{step}",
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)  # fmt: skip

    first, second = save(1), save(2)  # the second before the first's daemon has started
    results = [outcome(first), outcome(second)]
    results.append(outcome(save(3)))
    dcp_otel.flush(timeout_s=10)
    samples = [[s.name, s.labels, s.value] for metric in registry.collect() for s in metric.samples]
    print(json.dumps({"results": results, "samples": samples}), flush=True)
    dist.destroy_process_group()
