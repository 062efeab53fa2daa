"""A single-process training script stopped while a checkpoint is open, for the signal tests.

Usage: ``signal_script.py OUT MODE [--plain]``. Spans go through a batch processor (flushed
every 5 s, as by default) to ``OUT/spans.jsonl``; ``OUT/ready`` is written once the last
save is blocked in ``write_data`` (an Event nobody sets), on the main thread unless the
mode says otherwise; ``OUT/result.json`` holds what the script saw, when it gets to write it.

MODE:
  ``int``         a save that blocks; the test sends SIGINT; the script catches what
                  the save raises (torch wraps the step's ``KeyboardInterrupt`` in a
                  ``CheckpointException``), saves once more, and exits 0.
  ``user``        the script installs its own SIGTERM handler before ``instrument()``;
                  the test sends SIGTERM during a blocked save on a worker thread; the
                  handler records it and lets the script exit 0.
  ``exit``        a daemon thread blocks in a save; the main thread returns (interpreter exit).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from dcp_otel.otlp_file import OTLPJsonFileExporter

NEVER = threading.Event()
ENTERED = threading.Event()  # a blocking write has begun


class Blocking(dcp.FileSystemWriter):
    """Blocks in ``write_data`` for good (after saying so) when given a ``ready`` file to write."""

    def __init__(self, path: str, ready: Path | None = None) -> None:
        super().__init__(path)
        self.ready = ready

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if self.ready is not None:
            self.ready.write_text(str(os.getpid()))
            ENTERED.set()
            NEVER.wait()
        return super().write_data(plan, planner)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    plain = "--plain" in sys.argv
    warnings.simplefilter("ignore")
    result: dict[str, object] = {}
    seen: list[int] = []
    if mode == "user":
        signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    handlers_before = {s.name: repr(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT)}
    set_wakeup_fd = signal.set_wakeup_fd  # the interpreter's: dcp-otel's stand-in hides its own fd from callers
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(out / "spans.jsonl")))
    if not plain:
        import dcp_otel

        dcp_otel.instrument(tracer_provider=provider)
    result["handlers_changed"] = [s.name for s in (signal.SIGTERM, signal.SIGINT)
                                  if repr(signal.getsignal(s)) != handlers_before[s.name]]  # fmt: skip
    wakeup = set_wakeup_fd(-1)  # -1: nobody holds it; put back as it was
    if wakeup != -1:
        set_wakeup_fd(wakeup, warn_on_full_buffer=False)
    result["wakeup_fd_taken"] = wakeup != -1
    state = {"w": torch.arange(256.0)}
    ready = out / "ready"

    if mode == "int":
        try:
            dcp.save(state, storage_writer=Blocking(str(out / "hung"), ready))
        except BaseException as exc:  # torch wraps the KeyboardInterrupt of a step in CheckpointException
            result["raised"] = type(exc).__name__
            result["cause"] = [type(f[0]).__name__ for f in getattr(exc, "failures", {}).values()]
        dcp.save(state, checkpoint_id=str(out / "after"))
        result["after"] = "saved"
    elif mode == "user":
        worker = threading.Thread(target=dcp.save, args=(state,), daemon=True,
                                  kwargs={"storage_writer": Blocking(str(out / "hung"), ready)})  # fmt: skip
        worker.start()
        while not seen:  # the test sends SIGTERM once the save is blocked
            signal.pause()
        result["user_handler_saw"] = seen
    elif mode == "exit":
        threading.Thread(target=dcp.save, args=(state,), daemon=True,
                         kwargs={"storage_writer": Blocking(str(out / "hung"), ready)}).start()  # fmt: skip
        ENTERED.wait()
    if not plain:
        import dcp_otel

        result["diagnostics"] = dcp_otel.diagnostics()
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
