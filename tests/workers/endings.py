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
                  test's signals (repeated SIGINT: the test times the end).
  ``gloo``        one of two gloo ranks (RANK from the environment): rank 1 hangs in ``write_data``,
                  rank 0 waits for it in DCP's collective; both first ran an event loop that took
                  and gave back the wakeup fd; spans go through a ``SimpleSpanProcessor`` to the file,
                  then to an exporter that hangs for good; the test sends SIGTERM to rank 0.
  ``term``        three saves (their spans queued for a collector that never answers), then a fourth
                  that blocks in ``write_data``: the test sends SIGTERM.
  ``hung_init``   rank 0 of 2 waits in ``init_process_group`` for a peer that never comes (before any
                  checkpoint): the test sends SIGTERM.
  ``faulthandler`` ``faulthandler.register(SIGTERM)`` dumps every stack when the scheduler stops a hung
                  job, and the process goes on: the test sends SIGTERM; the script saves once more.
  ``threads``     a thread appends a timestamped line every 50 ms while the main thread saves (spans to
                  a collector that takes 3 s per export): the test sends SIGTERM, then counts the lines
                  written after it.
  ``async_upload`` an ``async_save`` uploading to slow storage (1.5 s), a collector that takes 3 s per
                  export: the test sends SIGTERM during the upload (the checkpoint stays incomplete).
  ``uvloop``      uvloop imported before ``instrument()``; a coroutine blocked in a call that never
                  returns: the test sends SIGTERM.
  ``alarm``       a one-shot SIGALRM handler (restores the previous disposition, raises TimeoutError)
                  armed around ``get_model_state_dict`` 240 times at varying delays: how many alarms
                  fired, reached the loop, and what dcp-otel counted as its own problems (OUT/alarms.json).
  ``forked``      a ``multiprocessing`` fork child saves and returns (exit 0, by ``os._exit`` as multiprocessing
                  ends its children), then a plain ``os.fork`` child saves and calls ``sys.exit(0)``; the
                  parent, which saved before forking, saves once more after both (its survivor running).
  ``spawn``       ``torch.multiprocessing.spawn`` starts 2 gloo ranks (as Lightning's ``ddp_spawn``); rank
                  1 hangs in ``write_data``: the test sends SIGTERM to it (its pid in ``OUT/rank1.pid``).
"""

from __future__ import annotations

import asyncio
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
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from dcp_otel.otlp_file import OTLPJsonFileExporter
from dcp_otel.spool.reader import read_record

NEVER = threading.Event()
STATE = {"w": torch.arange(64.0)}


class Hanging(SpanExporter):
    """An exporter that never returns (a collector that accepted the connection and went silent)."""

    def export(self, spans: Any) -> SpanExportResult:
        NEVER.wait()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class Slow(SpanExporter):
    """A collector that takes ``seconds`` to answer each export."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def export(self, spans: Any) -> SpanExportResult:
        NEVER.wait(self.seconds)
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
    if scenario == "uvloop":
        import uvloop  # noqa: F401 - before instrument(): it keeps its own reference to signal.set_wakeup_fd
    provider = TracerProvider()
    if scenario == "gloo":
        provider.add_span_processor(SimpleSpanProcessor(OTLPJsonFileExporter(out / "spans.jsonl")))
        provider.add_span_processor(SimpleSpanProcessor(Hanging()))
    elif scenario in ("idle", "term"):
        provider.add_span_processor(BatchSpanProcessor(Hanging()))
    elif scenario in ("threads", "async_upload"):
        provider.add_span_processor(BatchSpanProcessor(Slow(3.0)))
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


def term(out: Path, files: Path, instrumented: Any) -> None:
    for step in range(3):
        dcp.save(STATE, checkpoint_id=str(files / f"step-{step}"))
    say("saved 3")
    dcp.save(STATE, storage_writer=Gated(str(files / "hung"), None, out / "ready"))
    say("not reached")


def hung_init(out: Path, files: Path, instrumented: Any) -> None:
    (out / "ready").write_text(str(os.getpid()))
    say("waiting for the peer")
    dist.init_process_group("gloo", rank=0, world_size=2, timeout=timedelta(seconds=60))  # it never comes
    say("not reached")


def faulthandler_sigterm(out: Path, files: Path, instrumented: Any) -> None:
    import faulthandler

    dump = (out / "stacks.txt").open("w")
    faulthandler.register(signal.SIGTERM, file=dump, all_threads=True)  # installed with sigaction, not signal()
    dcp.save(STATE, checkpoint_id=str(files / "before"))
    if instrumented is not None:
        # Between checkpoints, where a scheduler's SIGTERM nearly always lands: dcp-otel's threads wait, idle. A dump
        # of all threads that lands while another thread runs Python can crash CPython 3.11+ (cpython#116008), as
        # it does amid torch's own async_save upload thread: dcp-otel's run for a few ms after each checkpoint
        # (docs/performance.md, "A faulthandler dump amid dcp-otel's threads").
        instrumented.flush()
        spool = instrumented.DCPInstrumentor()._spool
        assert spool is None or spool.keep.wait_idle(30)  # (the spool's confirmation of those spans, too)
    (out / "ready").write_text(str(os.getpid()))
    while not (out / "stacks.txt").stat().st_size:  # until the scheduler's SIGTERM made it dump the stacks
        time.sleep(0.01)
    say("stacks dumped; going on")
    dcp.save(STATE, checkpoint_id=str(files / "after"))
    say("saved after")


def threads(out: Path, files: Path, instrumented: Any) -> None:
    lines = (files / "ticks.txt").open("w", buffering=1)

    def tick() -> None:
        while True:
            lines.write(f"{time.time()}\n")
            time.sleep(0.05)

    threading.Thread(target=tick, daemon=True).start()
    for step in range(3):
        dcp.save(STATE, checkpoint_id=str(files / f"step-{step}"))
    (out / "ready").write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


class SlowStorage(dcp.FileSystemWriter):
    """Storage that takes 1.5 s to take the data (an object store on a bad day)."""

    def __init__(self, path: str, started: Path) -> None:
        super().__init__(path)
        self.started = started

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        self.started.write_text(str(os.getpid()))
        NEVER.wait(1.5)
        return super().write_data(plan, planner)


def async_upload(out: Path, files: Path, instrumented: Any) -> None:
    dcp.save(STATE, checkpoint_id=str(files / "step0"))
    future = dcp.async_save(STATE, storage_writer=SlowStorage(str(files / "step1"), out / "ready"))
    say("uploading")
    future.result()
    say("step1 complete")
    while True:  # (the scheduler's SIGTERM came during the upload: never here)
        time.sleep(0.05)


def uvloop_run(out: Path, files: Path, instrumented: Any) -> None:
    import uvloop

    async def train() -> None:
        dcp.save(STATE, checkpoint_id=str(files / "before"))
        (out / "ready").write_text(str(os.getpid()))
        await asyncio.get_running_loop().run_in_executor(None, NEVER.wait)  # a call that never returns

    uvloop.run(train())
    say("not reached")


def alarm(out: Path, files: Path, instrumented: Any) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    # Once before any alarm: the first call imports torch._dynamo lazily, and an alarm landing in that import leaves
    # the module half made for good (AttributeError ever after), plain as instrumented: torch's, not what is tested.
    get_model_state_dict(model)
    fired = lost = timeouts = 0

    def one_shot(signum: int, frame: Any) -> None:
        nonlocal fired
        fired += 1
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # a one-shot timeout: restores the previous disposition
        raise TimeoutError("state dict took too long")

    for attempt in range(240):
        before, caught = fired, False
        signal.signal(signal.SIGALRM, one_shot)
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, 0.00005 + 0.00003 * (attempt % 40))
                get_model_state_dict(model)
                for _ in range(200):  # where a late alarm lands
                    pass
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except TimeoutError:
            caught = True
            timeouts += 1
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        if fired > before and not caught:  # it fired, and its TimeoutError never reached the loop
            lost += 1
    say("alarm loop done")  # (how many landed where depends on timing: the counts go to a file, not to stdout)
    left: dict[str, Any] = {}
    if instrumented is not None:  # what the alarms left in dcp-otel: nothing (dcp_otel.tracing.cut_short)
        from opentelemetry import context as context_api

        from dcp_otel.tracing.operations import OPERATION_KEY

        left["operation_current"] = context_api.get_value(OPERATION_KEY) is not None
        get_model_state_dict(model)  # the next call: an operation of its own
        instrumented.flush()
        record = instrumented.DCPInstrumentor().recorder.record
        left["record_unbuilt"] = len(read_record(record.directory).unbuilt_ops()) if record.directory else 0
    problems = instrumented.diagnostics() if instrumented else {}
    (out / "alarms.json").write_text(json.dumps({"fired": fired, "reached": timeouts, "lost": lost,
                                                 "dcp_otel_problems": problems, "left": left}))  # fmt: skip


def forked_save(files: Path, name: str) -> None:
    dcp.save(STATE, checkpoint_id=str(files / name))
    say(f"{name} saved")


def forked(out: Path, files: Path, instrumented: Any) -> None:
    import multiprocessing

    dcp.save(STATE, checkpoint_id=str(files / "parent-before"))
    child = multiprocessing.get_context("fork").Process(target=forked_save, args=(files, "mp-child"))
    child.start()
    child.join()
    say(f"mp child exited {child.exitcode}")
    pid = os.fork()
    if pid == 0:
        try:
            forked_save(files, "fork-child")
        finally:
            sys.exit(0)
    _, status = os.waitpid(pid, 0)
    say(f"fork child exited {os.waitstatus_to_exitcode(status)}")
    dcp.save(STATE, checkpoint_id=str(files / "parent-after"))
    if instrumented is not None:  # the parent's survivor has looked at the spool since both ended
        instrumented.flush()


def spawned_rank(rank: int, files: Path, out: Path, port: int, plain: bool) -> None:
    warnings.simplefilter("ignore")
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if not plain:  # each rank instruments itself, as a Lightning ddp_spawn user's training function does
        import dcp_otel

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(out / f"rank-{rank}.jsonl")))
        dcp_otel.instrument(tracer_provider=provider)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    dcp.save(STATE, checkpoint_id=str(files / "step-1"))
    if rank == 1:
        (out / "rank1.pid").write_text(str(os.getpid()))
    writer = Gated(str(files / "step-2"), None, out / "ready") if rank == 1 else dcp.FileSystemWriter(str(files / "step-2"))
    dcp.save(STATE, storage_writer=writer)


def spawn(out: Path, files: Path, instrumented: Any) -> None:
    import torch.multiprocessing as mp

    port = int(os.environ["SPAWN_PORT"])
    try:
        mp.spawn(spawned_rank, args=(files, out, port, instrumented is None), nprocs=2)
    except mp.ProcessExitedException as exc:
        say(f"spawn: rank {exc.error_index} ended with {exc.exit_code}")


SCENARIOS = {
    "lightning": lightning,
    "chain": chain,
    "asyncio": asyncio_run,
    "trio": trio_run,
    "scoped": scoped,
    "async_ctrl_c": async_ctrl_c,
    "idle": idle,
    "gloo": gloo,
    "term": term,
    "hung_init": hung_init,
    "faulthandler": faulthandler_sigterm,
    "threads": threads,
    "async_upload": async_upload,
    "uvloop": uvloop_run,
    "alarm": alarm,
    "spawn": spawn,
    "forked": forked,
}

if __name__ == "__main__":
    main()
