"""One rank of ``dcp-otel demo``: a small training loop that checkpoints with DCP.

Started by :mod:`dcp_otel.demo` with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``). Trains a small MLP with
AdamW, checkpoints every ``--every`` steps (``save`` and ``async_save`` in
turn; training goes on while an async save uploads), then resumes from the
last checkpoint with ``load`` into a fresh model and optimizer. ``--slow-rank``
makes one rank's storage slow; ``--fail-rank`` makes one rank's storage fail
the third checkpoint (a save) (every rank sees the failure, as with a real full disk).

Spans go to ``<out>/traces/rank-<rank>.jsonl`` (OTLP JSON), and also over OTLP
to ``$OTEL_EXPORTER_OTLP_ENDPOINT`` when set. Metrics are served on
``$DCP_OTEL_METRICS_PORT`` (default 9710) + ``LOCAL_RANK``.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save, save

import dcp_otel
from dcp_otel.demo import METRICS_LINE
from dcp_otel.otlp_file import OTLPJsonFileExporter
from dcp_otel.resource import TorchDistributedResourceDetector

RANK = int(os.environ.get("RANK", "0"))
#: The checkpoint --fail-rank fails: the third, a synchronous save.
FAILING_CHECKPOINT = 3


class Storage:
    """The demo's storage faults: a slow rank, and a rank whose disk fills up once."""

    slow_rank = -1
    slow_s = 0.0
    fail_rank = -1
    failing = False


class Writer(FileSystemWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        if Storage.slow_rank == RANK:
            time.sleep(Storage.slow_s)  # a slow disk or link on this rank's node
        if Storage.failing and Storage.fail_rank == RANK:
            raise OSError(28, "No space left on device")
        return super().write_data(plan, planner)


class Reader(FileSystemReader):
    def read_data(self, plan: Any, planner: Any) -> Any:
        if Storage.slow_rank == RANK:
            time.sleep(Storage.slow_s)
        return super().read_data(plan, planner)


def tracing(out: Path) -> TracerProvider:
    """An OpenTelemetry SDK, as a traced application has: spans to a file, and to OTLP if configured."""
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "dcp-otel-demo")})
    provider = TracerProvider(resource=resource.merge(TorchDistributedResourceDetector().detect()))
    provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(out / "traces" / f"rank-{RANK}.jsonl")))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            say("OTEL_EXPORTER_OTLP_ENDPOINT is set, but the OTLP exporter is not installed "
                "(pip install 'dcp-otel[otlp]'): spans go to the files only")  # fmt: skip
        else:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint etc. from OTEL_*
    trace.set_tracer_provider(provider)
    return provider


def say(message: str) -> None:
    if RANK == 0:
        print(message, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-seconds", type=float, default=0.5)
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # DCP's own warnings about overwriting and planners
    Storage.slow_rank, Storage.slow_s, Storage.fail_rank = args.slow_rank, args.slow_seconds, args.fail_rank

    tracing(args.out)  # the global tracer provider: dcp-otel uses it
    dcp_otel.instrument()
    endpoint = dcp_otel.start_metrics_server()  # $DCP_OTEL_METRICS_PORT (default 9710) + LOCAL_RANK
    if endpoint is not None:
        print(f"{METRICS_LINE}{RANK}: {endpoint.url}", flush=True)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracer = trace.get_tracer("dcp_otel.demo")
    ckpts = args.out / "checkpoints"
    pending: Any = None
    durable = None
    for step in range(1, args.steps + 1):
        with tracer.start_as_current_span("train_step", attributes={"step": step}):
            x = torch.randn(64, 256)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if step % args.every:
            continue
        number = step // args.every
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": torch.tensor(step)}
        path = str(ckpts / f"step-{step}")
        if pending is not None:  # one async save at a time, as torchtitan does
            durable = _wait(pending) or durable
            pending = None
        Storage.failing = number == FAILING_CHECKPOINT
        started = time.perf_counter()
        try:
            if number % 2:
                save(state, storage_writer=Writer(path))
                durable = path
                say(f"[step {step:>3}/{args.steps}] loss {loss.item():.4f}  save {Path(path).name}: "
                    f"{time.perf_counter() - started:.2f} s")  # fmt: skip
            else:
                future = async_save(state, storage_writer=Writer(path))
                pending = (future, path)
                say(f"[step {step:>3}/{args.steps}] loss {loss.item():.4f}  async_save {Path(path).name}: "
                    f"training resumed after {time.perf_counter() - started:.2f} s")  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - CheckpointException: the demo's planned failure
            say(f"[step {step:>3}/{args.steps}] save {Path(path).name} FAILED: {type(exc).__name__}")
        finally:
            Storage.failing = False
    if pending is not None:
        durable = _wait(pending) or durable
    if durable is not None:
        fresh = make_model()  # as after a restart
        restored: dict[str, Any] = {"model": fresh.state_dict(), "optim": torch.optim.AdamW(fresh.parameters()).state_dict(),
                    "step": torch.tensor(0)}  # fmt: skip
        started = time.perf_counter()
        load(restored, storage_reader=Reader(durable))
        say(f"resumed from {Path(durable).name} (step {int(restored['step'])}): "
            f"load {time.perf_counter() - started:.2f} s")  # fmt: skip
    dcp_otel.flush(timeout_s=30)
    dist.destroy_process_group()
    if endpoint is not None:
        endpoint.close()
    # The provider is left to the exit: dcp-otel's exit flush first sends this process's dcp.process span (its
    # wall time: what the report's cost of checkpointing is a share of), then the SDK shuts it down.


def _wait(pending: tuple[Any, str]) -> str | None:
    """Wait for an async save; its path if it became durable."""
    future, path = pending
    try:
        future.result()
        say(f"             async_save {Path(path).name}: durable")
        return path
    except BaseException as exc:  # noqa: BLE001
        say(f"             async_save {Path(path).name} FAILED: {type(exc).__name__}")
        return None


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 1))  # fmt: skip


if __name__ == "__main__":
    main()
