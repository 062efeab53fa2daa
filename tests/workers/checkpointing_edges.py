"""torch_checkpointing's edges, in one process (a gloo world of one), plain (``--plain``) or instrumented.

1. A sync save to a relative path (``./relative``), then a change of working directory: the files, and
   (instrumented) their bytes.
2. An async manager whose lock gives up after ``wait_timeout_secs=1``: a save while the previous checkpoint's
   write takes 4 s more (a slow storage) raises torch_checkpointing's own ``RuntimeError``.
3. ``prewarm_staging`` before a save: a copy, no checkpoint.

``OUT/result.json``: what each call returned or raised, and the files; spans in ``OUT/traces/rank-0.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig

from tests.workers.checkpointing_storage import FaultyStorageConfig


def outcome(call: Any) -> dict[str, Any]:
    try:
        return {"returned": type(call()).__name__}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {"raised": type(exc).__name__, "message": str(exc)[:200]}


def main() -> None:
    out, plain = Path(sys.argv[1]), "--plain" in sys.argv
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))  # fmt: skip
    provider = None
    if not plain:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        import dcp_otel
        from dcp_otel.otlp_file import OTLPJsonFileExporter

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(out / "traces" / "rank-0.jsonl")))
        dcp_otel.instrument(tracer_provider=provider)
    (out / "ckpt").mkdir()
    os.chdir(out / "ckpt")
    state = {"model": {"w": torch.arange(1024.0)}, "step": 3}
    result: dict[str, Any] = {}

    storage = FaultyStorageConfig(use_direct_io=False, rank=0, fault_rank=0, fault_in="slow", fault="slow", delay_s=4)
    sync = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage))
    result["relative"] = outcome(lambda: sync.save("./relative", state))
    sync.close()
    (out / "other").mkdir()
    os.chdir(out / "other")  # (before its bytes are counted: they are still the ones of ckpt/relative)

    manager = CheckpointManager(CheckpointManager.Config(save=AsyncCheckpointSaverConfig(wait_timeout_secs=1),
                                                         storage_config=storage))  # fmt: skip
    result["prewarm"] = outcome(lambda: manager.prewarm_staging(state))
    slow = manager.save("slow", state)
    assert slow is not None
    result["next"] = outcome(lambda: manager.save("next", state))  # the previous write takes 4 s more
    result["slow"] = outcome(slow.result)
    result["close"] = outcome(manager.close)
    result["files"] = sorted(str(p.relative_to(out)) for folder in ("ckpt", "other") for p in (out / folder).rglob("*")
                             if p.is_file())  # fmt: skip
    if provider is not None:
        import dcp_otel

        assert dcp_otel.flush(timeout_s=30, tracer_provider=provider)
        dcp_otel.uninstrument()
        provider.shutdown()
    dist.destroy_process_group()
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
