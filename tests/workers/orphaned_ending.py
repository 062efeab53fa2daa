"""A checkpoint process whose parent dies while it writes what SIGTERM interrupted.

torch's ``spawn`` (the ``_experimental`` checkpointer's checkpoint process) makes SIGINT the
signal its child gets when the parent dies, and a scheduler's SIGTERM reaches both: the parent
may die first, in the middle of the child's ending. Three processes, by role:

``orphaned_ending.py reaper OUT``: becomes a child subreaper (so the orphan is reparented to it
and its exit status can be read), starts the ``parent``, reaps every process of the tree, and
writes ``OUT/exits.json`` (role -> ``waitpid`` status).

``orphaned_ending.py parent OUT``: starts the ``child`` and waits (120 s at most) to be killed.

``orphaned_ending.py child OUT``: sets SIGINT as its parent-death signal with torch's own
function (what ``spawn``'s ``_wrap`` does), instruments dcp-otel, writes ``OUT/blocked`` and
blocks in ``write_data`` of a ``dcp.save``. Its spans go through a batch processor to
``OUT/spans.jsonl``, by an exporter that, once the SIGTERM ending exports, kills the parent
with SIGKILL and waits (15 s at most) until dcp-otel says it took the SIGINT that followed for
the parent's death, then writes them. With ``$ORPHAN_PLAIN`` set, the same child without
dcp-otel (the test then kills the parent itself, right after its SIGTERM to the child).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PR_SET_CHILD_SUBREAPER = 36


def reaper(out: Path) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    parent = subprocess.Popen([sys.executable, __file__, "parent", str(out)])
    statuses = {}
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # no child left: the orphan, reparented here, is reaped too
            break
        statuses[pid] = status
    roles = {parent.pid: "parent", int((out / "child.pid").read_text()): "child"}
    (out / "exits.json").write_text(json.dumps({roles.get(pid, str(pid)): status for pid, status in statuses.items()}))


def parent(out: Path) -> None:
    subprocess.Popen([sys.executable, __file__, "child", str(out)])
    threading.Event().wait(120)


def child(out: Path) -> None:
    from torch.multiprocessing import _prctl_pr_set_pdeathsig  # type: ignore[attr-defined]

    _prctl_pr_set_pdeathsig(signal.SIGINT)
    (out / "child.pid").write_text(str(os.getpid()))
    import torch
    import torch.distributed.checkpoint as dcp
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    import dcp_otel
    from dcp_otel.otlp_file import OTLPJsonFileExporter
    from tests.workers.endings import Gated  # write_data says it started, then blocks for good

    file = OTLPJsonFileExporter(out / "spans.jsonl")

    class OrphanedWhileExporting(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            if any(s.name == "dcp.write_data" for s in spans):  # the ending's export: the interrupted write
                os.kill(int((out / "parent.pid").read_text()), signal.SIGKILL)
                pause, deadline = threading.Event(), time.monotonic() + 15
                # Until the watchdog has read the SIGINT the parent's death sent (15 s at most).
                while not (taken := bool(dcp_otel.diagnostics().get("parent_death_sigint"))) and time.monotonic() < deadline:
                    pause.wait(0.05)
                (out / "sigint_taken").write_text(str(taken))
            return file.export(spans)

        def shutdown(self) -> None:
            file.shutdown()

    (out / "parent.pid").write_text(str(os.getppid()))
    if not os.environ.get("ORPHAN_PLAIN"):
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OrphanedWhileExporting()))
        dcp_otel.instrument(tracer_provider=provider)
    dcp.save({"w": torch.arange(16.0)}, storage_writer=Gated(str(out / "ckpt"), started=out / "blocked"), no_dist=True)


if __name__ == "__main__":
    role, directory = sys.argv[1], Path(sys.argv[2])
    {"reaper": reaper, "parent": parent, "child": child}[role](directory)
