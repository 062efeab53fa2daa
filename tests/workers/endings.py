"""How a job ends, plain and instrumented: the scripts tests/test_endings.py runs both ways and compares.

Usage: ``endings.py OUT SCENARIO [--plain]``. Without ``--plain`` the script calls
``dcp_otel.instrument()`` with its defaults (the tracer provider aside: spans go to
``OUT/spans.jsonl``). Everything else is identical. What it prints to stdout and the files it
writes under ``OUT/files`` are what the test compares, with its exit status. ``OUT/ready`` says
when the test may send its signal (the scenarios that send their own don't write it).

SCENARIO:
  ``lightning``   a real PyTorch Lightning Trainer on CPU gets SIGTERM mid-fit; a callback saves
                  with ``dcp.save`` in ``on_exception`` (Lightning stops at the batch end: exit 0).
  ``chain``       an application handler installed after ``instrument()`` chains to the one it
                  found, then stops the loop after the current save (exit 0).
  ``asyncio``     ``asyncio.run()``; Ctrl-C cancels the main task, which saves and returns (exit 0).
  ``trio``        ``trio.run()``; Ctrl-C raises ``KeyboardInterrupt`` inside it, which is caught.
  ``scoped``      scoped SIGINT/SIGTERM handlers (the "delay KeyboardInterrupt" pattern) restored
                  after ``uninstrument()``; then Ctrl-C is caught, and SIGTERM kills (-15).
  ``async_ctrl_c`` Ctrl-C caught while an async save uploads; the upload finishes and loads back.
  ``idle``        saves (their spans queued for an exporter that never returns), then waits for the
                  test's signals (repeated SIGINT or SIGTERM: the test times the end).
  ``lock_held``   SIGTERM arrives while the main thread holds an operation's lock (instrumented: sent
                  from inside ``Operation.add_part``; plain: at the same point of the script).
  ``gloo``        one of two gloo ranks (RANK from the environment): rank 1 hangs in ``write_data``,
                  rank 0 waits for it in DCP's collective; both first ran an event loop that took
                  and gave back the wakeup fd; spans go through a ``SimpleSpanProcessor`` to the file,
                  then to an exporter that hangs for good; the test sends SIGTERM to rank 0.
"""

from __future__ import annotations

import asyncio
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
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from dcp_otel.otlp_file import OTLPJsonFileExporter

NEVER = threading.Event()
STATE = {"w": torch.arange(64.0)}


class Hanging(SpanExporter):
    """An exporter that never returns (a collector that accepted the connection and went silent)."""

    def export(self, spans: Any) -> SpanExportResult:
        NEVER.wait()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class Gated(dcp.FileSystemWriter):
    """``write_data`` waits for ``gate`` (``None``: for good), saying it started in ``started``."""

    def __init__(self, path: str, gate: threading.Event | None = None, started: Path | None = None) -> None:
        super().__init__(path)
        self.gate, self.started = gate, started

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if self.started is not None:
            self.started.write_text(str(os.getpid()))
        (self.gate or NEVER).wait()
        return super().write_data(plan, planner)


def say(text: str) -> None:
    print(text, flush=True)


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    plain = "--plain" in sys.argv
    warnings.simplefilter("ignore")
    files = out / "files"
    files.mkdir(parents=True, exist_ok=True)
    provider = TracerProvider()
    if scenario == "gloo":
        provider.add_span_processor(SimpleSpanProcessor(OTLPJsonFileExporter(out / "spans.jsonl")))
        provider.add_span_processor(SimpleSpanProcessor(Hanging()))
    elif scenario == "idle":
        provider.add_span_processor(BatchSpanProcessor(Hanging()))
    else:
        provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(out / "spans.jsonl")))
    if scenario == "gloo":
        gloo_before(out)
    instrumented = None
    if not plain:
        import dcp_otel

        instrumented = dcp_otel
        options: dict[str, Any] = {}
        if scenario == "gloo":
            options = {"stall_after_s": 1, "flush_timeout_s": 3}
        dcp_otel.instrument(tracer_provider=provider, **options)
    SCENARIOS[scenario](out, files, instrumented)


def lightning(out: Path, files: Path, instrumented: Any) -> None:
    import lightning as L  # noqa: N812 - Lightning's own spelling
    from torch.utils.data import DataLoader, TensorDataset

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class SaveOnException(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            say(f"batch {batch_idx} done")
            if batch_idx == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's SIGTERM, mid-fit

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            say(f"on_exception: {type(exception).__name__}")
            dcp.save({"model": pl_module.state_dict()}, checkpoint_id=str(files / "on_exception"))
            say("saved in on_exception")

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=10, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[SaveOnException()])  # fmt: skip
    trainer.fit(Model(), DataLoader(data, batch_size=4))
    say(f"fit returned; received_sigterm={trainer.received_sigterm}")


def chain(out: Path, files: Path, instrumented: Any) -> None:
    stop: list[int] = []
    previous = signal.getsignal(signal.SIGTERM)

    def graceful(signum: int, frame: Any) -> None:
        say("application handler: SIGTERM")
        stop.append(signum)
        if callable(previous):  # the common "chain to the handler that was there" pattern
            previous(signum, frame)

    signal.signal(signal.SIGTERM, graceful)
    for step in range(5):
        dcp.save(STATE, checkpoint_id=str(files / f"step-{step}"))
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if stop:
            say(f"stopping after step {step}")
            break
    dcp.save(STATE, checkpoint_id=str(files / "final"))
    say("saved final; exiting")


def asyncio_run(out: Path, files: Path, instrumented: Any) -> None:
    async def train() -> str:
        dcp.save(STATE, checkpoint_id=str(files / "before"))
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGINT)  # Ctrl-C
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            say("main task cancelled: saving and returning")
            dcp.save(STATE, checkpoint_id=str(files / "after"))
            return "returned normally"
        return "not cancelled"

    say(asyncio.run(train()))


def trio_run(out: Path, files: Path, instrumented: Any) -> None:
    import trio

    async def train() -> None:
        dcp.save(STATE, checkpoint_id=str(files / "before"))
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
        await trio.sleep(60)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trio.run(train)
        except KeyboardInterrupt:
            say("KeyboardInterrupt from trio.run")
    for warning in caught:  # trio warns when set_wakeup_fd says someone else held the fd
        if "collided" in str(warning.message):
            say(f"trio warned: {warning.message}")
    dcp.save(STATE, checkpoint_id=str(files / "after"))
    say("saved after")


def scoped(out: Path, files: Path, instrumented: Any) -> None:
    held: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        held.append(signum)

    # "Delay KeyboardInterrupt (and SIGTERM) while saving": take both, restore what was there after.
    previous_int = signal.signal(signal.SIGINT, hold)
    previous_term = signal.signal(signal.SIGTERM, hold)
    dcp.save(STATE, checkpoint_id=str(files / "scoped"))
    if instrumented is not None:
        instrumented.uninstrument()
    signal.signal(signal.SIGINT, previous_int)
    signal.signal(signal.SIGTERM, previous_term)
    say(f"restored; held {held}")
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            time.sleep(0.01)
        say("no KeyboardInterrupt")
    except KeyboardInterrupt:
        say("KeyboardInterrupt caught")
    say("sending SIGTERM")
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):
        time.sleep(0.01)
    say("still alive after SIGTERM")


def async_ctrl_c(out: Path, files: Path, instrumented: Any) -> None:
    gate = threading.Event()
    future = dcp.async_save(STATE, storage_writer=Gated(str(files / "async"), gate))
    try:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the upload runs
        for _ in range(1000):
            time.sleep(0.01)
        say("no KeyboardInterrupt")
    except KeyboardInterrupt:
        say("KeyboardInterrupt caught: waiting for the upload")
    gate.set()
    future.result()
    loaded = {"w": torch.zeros(64)}
    dcp.load(loaded, checkpoint_id=str(files / "async"))
    say(f"loaded back: {bool(torch.equal(loaded['w'], STATE['w']))}")
    if instrumented is not None:
        instrumented.flush()


def idle(out: Path, files: Path, instrumented: Any) -> None:
    for step in range(3):
        dcp.save(STATE, checkpoint_id=str(files / f"step-{step}"))
    say("saved 3; waiting")
    (out / "ready").write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


def lock_held(out: Path, files: Path, instrumented: Any) -> None:
    if instrumented is not None:
        from dcp_otel.tracing import records

        sent: list[int] = []

        def add_part(self: Any) -> None:  # Operation.add_part, with SIGTERM arriving while it holds the lock
            with self.lock:
                self.pending += 1
                if not sent:
                    sent.append(signal.SIGTERM)
                    os.kill(os.getpid(), signal.SIGTERM)
                    for _ in range(1000):  # the handler runs here, between two bytecodes, the lock held
                        pass

        records.Operation.add_part = add_part  # type: ignore[method-assign]
    say("async save")
    if instrumented is None:
        os.kill(os.getpid(), signal.SIGTERM)  # the same point: as the save begins
    dcp.async_save(STATE, storage_writer=Gated(str(files / "async")))
    say("not reached")


def gloo_before(out: Path) -> None:
    async def with_signal_handler() -> None:  # takes the wakeup fd; closing the loop sets it to -1
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: None)
        await asyncio.sleep(0)

    asyncio.run(with_signal_handler())


def gloo(out: Path, files: Path, instrumented: Any) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    say(f"rank {rank} saving")
    writer = Gated(str(files / "hung"), None, out / "ready") if rank == 1 else dcp.FileSystemWriter(str(files / "hung"))
    dcp.save(STATE, storage_writer=writer)
    say("not reached")


SCENARIOS = {
    "lightning": lightning,
    "chain": chain,
    "asyncio": asyncio_run,
    "trio": trio_run,
    "scoped": scoped,
    "async_ctrl_c": async_ctrl_c,
    "idle": idle,
    "lock_held": lock_held,
    "gloo": gloo,
}

if __name__ == "__main__":
    main()
