"""How often a faulthandler dump of all threads crashes a process that checkpoints, plain and instrumented.

``faulthandler.register(SIGUSR1, all_threads=True)`` (or SIGTERM: a scheduler's stop) is how many jobs say
where they hang. The dump reads every thread's frames without the interpreter lock, and CPython 3.11+
can crash (SIGSEGV) when one of them runs Python or starts or ends meanwhile (cpython#116008). A plain
``dcp.save`` has no other Python thread; torch's ``async_save`` has its upload thread; dcp-otel's threads
run Python for a few ms after each checkpoint (the builder, the spool's confirmation) and for a tick a
second (the watchdog, the survivor). Each run: a process saves once (its threads start, instrumented), is
left to finish that (``dcp_otel.flush()``), then saves ``--saves`` more times while this script sends it
SIGUSR1 every ``--every`` seconds; a run ends in exit 0 or a crash.

Usage::

    .venv/bin/python benchmarks/faulthandler_dumps.py                 # 8 runs an arm, a dump every 10 ms (~2 min)
    .venv/bin/python benchmarks/faulthandler_dumps.py --runs 4 --every 0.02

What it leaves out: real schedulers send one signal, not a storm (a run here takes hundreds of dumps); the
per-dump risk is what the crashes over the dumps sent say.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

JOB = r"""
import faulthandler, os, signal, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed.checkpoint as dcp
out, instrumented, asynchronous, saves = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", int(sys.argv[4])
if instrumented:
    import dcp_otel
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    class Discard(SpanExporter):
        def export(self, spans): return SpanExportResult.SUCCESS
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    dcp_otel.instrument(tracer_provider=provider)
faulthandler.register(signal.SIGUSR1, file=open(os.devnull, "w"), all_threads=True)
def save(i):
    if asynchronous:
        dcp.async_save({"w": torch.ones(4)}, checkpoint_id=f"{out}/c{i % 3}").result()
    else:
        dcp.save({"w": torch.ones(4)}, checkpoint_id=f"{out}/c{i % 3}")
save(0)
if instrumented:
    dcp_otel.flush(timeout_s=30)
open(f"{out}/ready", "w").close()
for i in range(saves):
    save(i)
open(f"{out}/done", "w").close()
"""


def run(instrumented: bool, asynchronous: bool, saves: int, every_s: float) -> tuple[bool, int]:
    """One process: whether it crashed, and the dumps sent to it."""
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as out:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-c", JOB, out, str(int(instrumented)), str(int(asynchronous)),
                                 str(saves)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        while not os.path.exists(f"{out}/ready") and proc.poll() is None:
            time.sleep(0.001)
        dumps = 0
        while proc.poll() is None and not os.path.exists(f"{out}/done"):
            try:
                proc.send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                break
            dumps += 1
            time.sleep(every_s)
        proc.wait(120)
        return proc.returncode != 0, dumps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--saves", type=int, default=100)
    parser.add_argument("--every", type=float, default=0.01, help="seconds between dumps")
    args = parser.parse_args()
    print(f"faulthandler dumps of all threads every {args.every * 1e3:.0f} ms during {args.saves} saves, "
          f"{args.runs} runs an arm (Python {sys.version.split()[0]})")
    print(f"{'arm':<28}{'runs crashed':>14}{'dumps sent':>12}{'crashes per 1,000 dumps':>26}")
    for asynchronous in (False, True):
        for instrumented in (False, True):
            outcomes = [run(instrumented, asynchronous, args.saves, args.every) for _ in range(args.runs)]
            crashed, dumps = sum(c for c, _ in outcomes), sum(d for _, d in outcomes)
            arm = f"{'async_save' if asynchronous else 'save'}, {'instrumented' if instrumented else 'plain'}"
            print(f"{arm:<28}{crashed:>9} of {args.runs:<2}{dumps:>12}{1000 * crashed / max(dumps, 1):>26.2f}")


if __name__ == "__main__":
    main()
