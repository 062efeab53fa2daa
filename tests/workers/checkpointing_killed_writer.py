"""One process whose torch_checkpointing writer process is killed (SIGKILL) in the middle of a write.

A gloo world of one; an async ``CheckpointManager`` whose storage hangs writing ``second`` (the writer process
writes ``$HANG_OUT/blocked-0`` with its pid first). The process kills that pid, then waits for the write future
(which raises: the writer is gone). Instrumented (not ``--plain``), the writer process's record is in
``$DCP_OTEL_SPOOL_DIR``: the rank's survivor, its parent, reports it; the process waits (bounded) until that
record is reported, flushes, and writes what each call returned or raised to ``OUT/result.json`` (spans:
``OUT/traces/rank-0.jsonl``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch_checkpointing import CheckpointManager

from tests.workers.checkpointing_storage import FaultyStorageConfig


def outcome(call: Any) -> dict[str, Any]:
    try:
        return {"returned": type(call()).__name__}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {"raised": type(exc).__name__}


def reported(spool: Path) -> bool:
    return any(spool.rglob("death.json"))


def main() -> None:
    out, plain = Path(sys.argv[1]), "--plain" in sys.argv
    warnings.simplefilter("ignore")
    os.environ["HANG_OUT"] = str(out)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))  # fmt: skip
    provider = None
    if not plain:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        import dcp_otel
        from dcp_otel.otlp_file import OTLPJsonFileExporter

        provider = TracerProvider(resource=Resource.create({"service.name": "killed-writer"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(out / "traces" / "rank-0.jsonl")))
        dcp_otel.instrument(tracer_provider=provider)
    storage = FaultyStorageConfig(use_direct_io=False, rank=0, fault_rank=0, fault_in="second", fault="hang")
    manager = CheckpointManager(CheckpointManager.Config(storage_config=storage))
    state = {"model": {"w": torch.arange(1024.0)}}
    result = {"first": outcome(lambda: manager.save(str(out / "ckpt" / "first"), state).result())}  # type: ignore[union-attr]
    written = manager.save(str(out / "ckpt" / "second"), state)
    assert written is not None
    blocked, pause, deadline = out / "blocked-0", threading.Event(), time.monotonic() + 60
    while not blocked.exists() and time.monotonic() < deadline:
        pause.wait(0.05)
    os.kill(int(blocked.read_text()), signal.SIGKILL)
    result["second"] = outcome(written.result)
    if provider is not None:
        import dcp_otel

        spool = Path(os.environ["DCP_OTEL_SPOOL_DIR"])
        deadline = time.monotonic() + 60
        while not reported(spool) and time.monotonic() < deadline:
            pause.wait(0.1)
        result["reported"] = reported(spool)
        dcp_otel.flush(timeout_s=30, tracer_provider=provider)
        dcp_otel.uninstrument()
        provider.shutdown()
    (out / "result.json").write_text(json.dumps(result))
    os._exit(0)  # (the manager's close would wait for the write future again: nothing more to see)


if __name__ == "__main__":
    main()
