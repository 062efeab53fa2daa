"""One rank of a job checkpointing with ``torch_checkpointing``'s ``CheckpointManager`` (gloo on CPU).

1. A sync manager: a save (in the caller: its writer waits at the default store barrier, then rank 0
   renames the temporary folder), then a load.
2. An async manager (its default: staging on a ``ckpt-staging`` thread into shared memory, the write in a
   writer process whose ``subprocess_init_fn`` sends that process's spans to a file of its own, as a user
   would configure it): a save under ``checkpoint_logging_context.update(step=7)``, a load, two saves back
   to back (the second waits for the first's write), then a save whose write fails on rank 1 in the writer
   process (its storage raises for that checkpoint's files: an injected disk failure).

The storage writes without ``O_DIRECT`` (torch_checkpointing's default fails on ext4, see TRAPS.md).
With ``--plain`` dcp-otel is not imported: the same calls, for comparing outcomes and files.

Spans go to ``DIR/traces/rank-R.jsonl`` and ``DIR/traces/process-R.jsonl`` (OTLP JSON); ``DIR/result-R.json``
has what each call returned or raised and the rank's metrics.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.logging_utils import checkpoint_logging_context

from dcp_otel.otlp_file import OTLPJsonFileExporter
from tests.workers import rank_parser, write_result
from tests.workers.checkpointing_storage import FaultyStorageConfig

FAILING_SAVE = "async-fail"


def provider_to(path: str, rank: int, service: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service, "test.rank": rank}))
    provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(path)))
    return provider


def init_process(out: str, rank: int, instrumented: bool) -> None:
    """The writer process's ``subprocess_init_fn``: its spans go to their own file."""
    if instrumented:
        trace.set_tracer_provider(provider_to(os.path.join(out, "traces", f"process-{rank}.jsonl"), rank, "ckpt-writer"))


def outcome(call: Any) -> dict[str, Any]:
    """What ``call()`` returned (its type) or raised (its type and message)."""
    try:
        value = call()
        return {"returned": type(value).__name__}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {"raised": type(exc).__name__, "message": str(exc).splitlines()[0][:300] if str(exc) else ""}


def files(root: str) -> dict[str, str]:
    """Every file under ``root`` (relative path -> its bytes, hashed): what the checkpoints hold."""
    import hashlib

    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as fh:
                found[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return found


def main() -> None:
    parser = rank_parser()
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rank, world, ckpt = args.rank, args.world, str(args.ckpt)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    provider = registry = None
    if not args.plain:
        from prometheus_client import CollectorRegistry

        import dcp_otel

        provider = provider_to(os.path.join(args.out, "traces", f"rank-{rank}.jsonl"), rank, "ckpt-rank")
        registry = CollectorRegistry()
        dcp_otel.instrument(tracer_provider=provider, registry=registry)
    state = {"model": {"w": torch.arange(4096, dtype=torch.float32) + rank, "b": torch.ones(16)},
             "optimizer": {"lr": 0.1, "m": torch.zeros(1024)}, "step": 7}  # fmt: skip
    storage = FaultyStorageConfig(use_direct_io=False, rank=rank, fault_rank=1, fault_in=FAILING_SAVE)
    result: dict[str, Any] = {}

    # 1. synchronous
    sync = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage))
    result["sync_save"] = outcome(lambda: sync.save(os.path.join(ckpt, "sync"), state))
    # A rank's save returns once every rank passed the barrier, before rank 0 renamed the folder onto its path.
    dist.barrier()
    loaded = sync.load(os.path.join(ckpt, "sync"), into={"model": None, "optimizer": None, "step": None})
    result["sync_load_equal"] = torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["step"] == 7
    sync.close()

    # 2. asynchronous, in a writer process
    # Rank 0's writer waits at the barrier for rank 1's, which failed: 10 s, not the default 600.
    writer = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=10)
    manager = CheckpointManager(CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(writer_config=writer), storage_config=storage, subprocess_init_fn=init_process,
        subprocess_init_args=(str(args.out), rank, not args.plain)))  # fmt: skip
    checkpoint_logging_context.update(step=7)
    written = manager.save(os.path.join(ckpt, "async"), state)
    assert written is not None
    result["async_written"] = outcome(written.result)
    checkpoint_logging_context.update(step=None)
    dist.barrier()
    loaded = manager.load(os.path.join(ckpt, "async"), into={"model": None, "optimizer": None, "step": None})
    result["async_load_equal"] = torch.equal(loaded["model"]["w"], state["model"]["w"])
    # Back to back: the second save waits for the first one's write (still in the writer process) first.
    first = manager.save(os.path.join(ckpt, "async-a"), state)
    second = manager.save(os.path.join(ckpt, "async-b"), state)
    assert first is not None and second is not None
    result["back_to_back"] = [outcome(first.result), outcome(second.result)]
    dist.barrier()  # every rank's write is done before the failing one starts
    failing = manager.save(os.path.join(ckpt, FAILING_SAVE), state)
    assert failing is not None
    result["async_fail_written"] = outcome(failing.result)
    result["close"] = outcome(manager.close)

    dist.barrier()
    result["files"] = files(ckpt) if rank == 0 else {}
    write_result(args.out, rank, result, provider, registry)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
