"""How long a SIGTERM takes to end a process mid-save, plain and instrumented: what the evidence costs.

    .venv/bin/python benchmarks/sigterm_exit.py [--runs 5]

Runs ``tests/workers/signal_script.py term`` (three finished saves queued in a batch processor, a fourth
blocked in ``write_data``, spans to a file: a healthy exporter) once plain and once instrumented per
round, interleaved, and times each from the SIGTERM the parent sends to the child's end. Prints the
medians, their ratio and difference, and the exit statuses (both must be -15). What it leaves out: a
slow or stuck exporter (the ending then waits up to ``flush_timeout_s``: tests/test_endings.py bounds
it), and the process start-up (not timed).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.ranks import WORKERS, rank_env  # noqa: E402


def once(out: Path, plain: bool) -> tuple[float, int]:
    out.mkdir(parents=True)
    command = [sys.executable, str(WORKERS / "signal_script.py"), str(out), "term", *(["--plain"] if plain else [])]
    proc = subprocess.Popen(command, env=rank_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    tick, deadline = threading.Event(), time.monotonic() + 120
    while not (out / "ready").exists():  # the fourth save is blocked in write_data (polled, bounded)
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"sigterm_exit: the script ended or hung before its save blocked ({out})")
        tick.wait(0.02)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    return time.monotonic() - sent, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"plain": [], "instrumented": []}
    codes: dict[str, set[int]] = {"plain": set(), "instrumented": set()}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            arms = ("plain", "instrumented") if run % 2 == 0 else ("instrumented", "plain")  # each first in turn
            for arm in arms:
                took, code = once(Path(tmp) / f"{run}-{arm}", arm == "plain")
                times[arm].append(took)
                codes[arm].add(code)
    plain, traced = statistics.median(times["plain"]), statistics.median(times["instrumented"])
    print(f"SIGTERM to exit, mid-save, medians of {args.runs} interleaved runs:")
    print(f"  plain        {plain * 1000:7.1f} ms   exit {sorted(codes['plain'])}")
    print(f"  instrumented {traced * 1000:7.1f} ms   exit {sorted(codes['instrumented'])}   "
          f"ratio {traced / plain:.2f}, added {(traced - plain) * 1000:+.1f} ms (the interrupted save's and the "
          f"three queued saves' spans, built and flushed)")  # fmt: skip


if __name__ == "__main__":
    main()
