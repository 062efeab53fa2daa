"""A training script that forks while dcp-otel is busy: ``fork_train.py MODE OUT``.

MODE ``locks``: other threads hold every lock dcp-otel has when the process
forks (the worst moment); the child then checkpoints, flushes and reads
diagnostics, and writes ``OUT/child.json``. Without re-initialized locks the
child hangs (and the test's timeout fails it).

MODE ``dataloader``: DataLoader workers are forked (``multiprocessing_context="fork"``)
while an async save is in flight and its spans are queued in the exporter; a
plain ``os.fork()`` child exits through ``sys.exit`` (running atexit hooks).
Every process exports spans to ``OUT/spans-<pid>.jsonl``; with
``PROMETHEUS_MULTIPROC_DIR`` set, metrics are per-process files the test adds up.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

import dcp_otel
from dcp_otel import _selftelemetry

warnings.simplefilter("ignore")


class PerProcessFile:
    """Each process appends its spans to its own file (a forked child gets a new one)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def write(self, text: str) -> None:
        with open(self.out / f"spans-{os.getpid()}.jsonl", "a") as f:
            f.write(text)

    def flush(self) -> None:
        pass


class Squares(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(float(i * i))


def hold_all_locks(instrumentor: dcp_otel.DCPInstrumentor, held: threading.Event, release: threading.Event) -> None:
    recorder, installed = instrumentor.recorder, instrumentor.installed
    assert recorder is not None and installed is not None and installed.carrier and installed.bridge
    locks = [_selftelemetry._lock, recorder.uploads._cond, recorder.builder._cond, recorder._seq._lock,
             installed.carrier._lock, installed.bridge._lock]  # fmt: skip
    for lock in locks:
        lock.acquire()
    held.set()
    release.wait()
    for lock in reversed(locks):
        lock.release()


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    provider = TracerProvider()
    exporter = ConsoleSpanExporter(out=PerProcessFile(out), formatter=lambda s: s.to_json(indent=None) + "\n")  # type: ignore[arg-type]
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=3_600_000))
    instrumentor = dcp_otel.instrument(tracer_provider=provider)

    if mode == "locks":
        held, release = threading.Event(), threading.Event()
        holder = threading.Thread(target=hold_all_locks, args=(instrumentor, held, release))
        holder.start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            dcp.save({"w": torch.ones(4)}, checkpoint_id=tempfile.mkdtemp(), no_dist=True)
            flushed = dcp_otel.flush(timeout_s=30)
            (out / "child.json").write_text(json.dumps({"flushed": flushed, "diagnostics": dcp_otel.diagnostics()}))
            os._exit(0)
        release.set()
        holder.join()
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"child_status": os.waitstatus_to_exitcode(status)}), flush=True)
    else:
        future = dcp.async_save({"w": torch.ones(4)}, checkpoint_id=tempfile.mkdtemp())
        loader = torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=2, multiprocessing_context="fork")
        total = float(sum(batch.sum() for batch in loader))
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # runs the atexit hooks a forked child inherited
        _, status = os.waitpid(pid, 0)
        future.result()
        print(json.dumps({"total": total, "child_status": os.waitstatus_to_exitcode(status),
                          "pid": os.getpid()}), flush=True)  # fmt: skip
    # No explicit flush: the spans still queued go out at interpreter exit.


if __name__ == "__main__":
    main()
