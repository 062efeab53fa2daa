"""One rank of a torchrun job whose second checkpoint never finishes: rank 1's write blocks for good.

Run by ``torchrun --nproc-per-node 2 hang_rank.py --out DIR --mode MODE [--plain]``. Each rank
checkpoints once (it completes), then again, and on rank 1 that write waits on an
Event nobody sets, as a write to a hung storage mount does; rank 0 finishes its own
write and then waits for rank 1 in DCP's collectives (or the checkpointer's barrier).
Before blocking, rank 1 writes ``DIR/blocked-1``. The job ends only when the test
stops torchrun with SIGTERM.

MODE ``save``: ``dcp.save``, blocking in ``write_data`` on the rank itself. ``process``:
``dcp.async_save`` with ``AsyncCheckpointerType.PROCESS``: the block is in the async
save process (the rank waits for the upload). ``checkpointer``: the ``_experimental``
``AsyncCheckpointer``: the block is in its checkpoint process, in the write's commit
hook, before the writer's barrier. ``checkpointing``: ``torch_checkpointing``'s
``CheckpointManager``: the block is in its writer process, writing an item's file.

Instrumented (not ``--plain``): spans go to ``DIR/traces/rank-R.jsonl`` (the checkpoint
processes: ``process-R.jsonl``) through a batch processor, as a job's would; metrics are
served on ``$DCP_OTEL_METRICS_PORT`` + local rank (or, with ``$PROMETHEUS_MULTIPROC_DIR``,
by local rank 0 for the node) and, with ``--otlp URL``, pushed there every 500 ms.
``$DCP_OTEL_STALL_AFTER_S`` is set by the test.
"""

from __future__ import annotations

import argparse
import os
import threading
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from dcp_otel.otlp_file import OTLPJsonFileExporter

#: Never set: a write waiting on it never returns.
NEVER = threading.Event()
HANG_RANK = 1


def out_dir() -> Path:
    return Path(os.environ["HANG_OUT"])


def provider(name: str) -> TracerProvider:
    rank = os.environ.get("RANK", "0")
    tracer_provider = TracerProvider(resource=Resource.create({"service.name": "hang-test", "test.rank": int(rank)}))
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(out_dir() / "traces" / f"{name}-{rank}.jsonl")))
    return tracer_provider


def process_provider() -> TracerProvider:
    """``DCP_OTEL_PROCESS_SETUP`` of the async save process: its spans to a file of its own."""
    return provider("process")


def block_here() -> None:
    """Say so, then wait for good (rank 1 of the hanging checkpoint only)."""
    (out_dir() / f"blocked-{os.environ['RANK']}").write_text(str(os.getpid()))
    NEVER.wait()


class HangingWriter(dcp.FileSystemWriter):
    """A file-system writer whose ``write_data`` blocks on rank 1 when ``hang`` is set."""

    hang = False

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if self.hang and int(os.environ["RANK"]) == HANG_RANK:
            block_here()
        return super().write_data(plan, planner)


def checkpointer_writer(rank_info, hang_path: str):  # type: ignore[no-untyped-def]
    """``checkpoint_writer_init_fn`` of the checkpoint process: for ``hang_path``, rank 1's commit hook
    (inside the write, after the rank's file, before the barrier) blocks."""
    from torch.distributed.checkpoint._experimental import CheckpointWriter, CheckpointWriterConfig, WriterHook
    from torch.distributed.checkpoint._experimental.barriers import DistBarrier

    class HangingCommit(WriterHook):
        def pre_commit(self, path, **kwargs):  # type: ignore[no-untyped-def]
            if str(path) == hang_path and rank_info.global_rank == HANG_RANK:
                block_here()

        def post_commit(self, path, **kwargs):  # type: ignore[no-untyped-def]
            pass

    return CheckpointWriter(CheckpointWriterConfig(), rank_info, DistBarrier(), HangingCommit())


def checkpointer_process_init(instrumented: bool) -> None:
    """``subprocess_init_fn`` of the checkpoint process: a process group for its barrier, and its spans."""
    dist.init_process_group("gloo", init_method=f"file://{out_dir() / 'process-store'}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))  # fmt: skip
    if instrumented:
        trace.set_tracer_provider(provider("process"))


def checkpointing_process_init(instrumented: bool) -> None:
    """``subprocess_init_fn`` of torch_checkpointing's writer process: its spans (its barrier uses the job's store)."""
    if instrumented:
        trace.set_tracer_provider(provider("process"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("save", "process", "checkpointer", "checkpointing"), required=True)
    parser.add_argument("--plain", action="store_true", help="without dcp-otel, for comparison")
    parser.add_argument("--otlp", default="", help="push metrics over OTLP/HTTP to this URL too")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    if not args.plain:
        import dcp_otel

        options = {}
        if args.otlp:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{args.otlp}/v1/metrics"), 500)
            options = {"meter_provider": MeterProvider([reader]), "metrics": "prometheus,opentelemetry"}
        dcp_otel.instrument(tracer_provider=provider("rank"), **options)
    state = {"w": torch.arange(1024.0) + rank}
    ckpt = out_dir() / "ckpt"
    if args.mode == "save":
        dcp.save(state, storage_writer=HangingWriter(str(ckpt / "first")))
        writer = HangingWriter(str(ckpt / "second"))
        writer.hang = True
        dcp.save(state, storage_writer=writer)
    elif args.mode == "process":
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        for name in ("first", "second"):
            writer = HangingWriter(str(ckpt / name))
            writer.hang = name == "second"
            dcp.async_save(state, storage_writer=writer,
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()  # fmt: skip
    elif args.mode == "checkpointing":
        from torch_checkpointing import CheckpointManager

        from tests.workers.checkpointing_storage import FaultyStorageConfig

        storage = FaultyStorageConfig(use_direct_io=False, rank=rank, fault_rank=HANG_RANK, fault_in="second",
                                      fault="hang")  # fmt: skip
        manager = CheckpointManager(CheckpointManager.Config(storage_config=storage,
                                                             subprocess_init_fn=checkpointing_process_init,
                                                             subprocess_init_args=(not args.plain,)))  # fmt: skip
        for name in ("first", "second"):
            written = manager.save(str(ckpt / name), {"model": state})
            assert written is not None
            written.result()
    else:
        from torch.distributed.checkpoint._experimental import (
            CheckpointerConfig,
            CheckpointStagerConfig,
            make_async_checkpointer,
        )

        second = str(ckpt / "second")
        checkpointer = make_async_checkpointer(
            CheckpointerConfig(staging_config=CheckpointStagerConfig(
                use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                use_non_blocking_copy=False)),
            subprocess_init_fn=checkpointer_process_init, subprocess_init_args=(not args.plain,),
            checkpoint_writer_init_fn=checkpointer_writer, checkpoint_writer_init_args={"hang_path": second},
        )  # fmt: skip
        for path in (str(ckpt / "first"), second):
            futures = checkpointer.save(path, state)
            assert futures is not None
            futures[1].result()
    raise AssertionError("the second checkpoint was expected never to finish")


if __name__ == "__main__":
    main()
