"""``dcp-otel demo``: the whole product on a laptop, in one command.

Starts N ranks (gloo on CPU, torchrun's environment) of a real small training
job (:mod:`dcp_otel.demo.rank`) that checkpoints with ``save`` and
``async_save`` and resumes with ``load``; shows its progress; then prints the
checkpoint report and writes it as HTML and as a Perfetto trace. No collector,
Prometheus or Grafana needed: spans go to OTLP JSON files (and to
``$OTEL_EXPORTER_OTLP_ENDPOINT`` too when set), metrics are served per rank
while it runs.

Usage::

    dcp-otel demo                                  # 4 ranks, out/demo/
    dcp-otel demo --ranks 4 --slow-rank 2 --fail-rank 1
    python -m dcp_otel demo --ranks 2 --steps 12 --every 3 --out /tmp/demo
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import IO

from dcp_otel import semconv
from dcp_otel.report import build

#: Longest the demo may run before its ranks are stopped.
TIMEOUT_S = 600
#: How a rank announces its metrics endpoint (demo/rank.py).
METRICS_LINE = "metrics of rank "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every K steps (default 5)")
    parser.add_argument("--slow-rank", type=int, default=None, help="make this rank's storage slow")
    parser.add_argument("--slow-seconds", type=float, default=0.5, help="how slow (default 0.5 s per write/read)")
    parser.add_argument("--fail-rank", type=int, default=None, help="make this rank fail the third checkpoint")
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="output folder (default out/demo)")


def check(args: argparse.Namespace) -> None:
    """Bad options are errors before anything starts."""
    if not 1 <= args.ranks <= 64:
        raise ValueError(f"--ranks must be from 1 to 64, got {args.ranks}")
    if args.steps < 1 or args.every < 1:
        raise ValueError("--steps and --every must be at least 1")
    for name in ("slow_rank", "fail_rank"):
        rank = getattr(args, name)
        if rank is not None and not 0 <= rank < args.ranks:
            raise ValueError(f"--{name.replace('_', '-')} must be a rank from 0 to {args.ranks - 1}, got {rank}")
    if args.slow_seconds < 0:
        raise ValueError("--slow-seconds must be at least 0")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _forward(stream: IO[str], log: IO[str], everything: bool) -> None:
    """A rank's output into its log; to the terminal all of rank 0's, and every rank's endpoint."""
    for line in stream:
        log.write(line)
        if everything or line.startswith(METRICS_LINE):
            sys.stdout.write(line)
            sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    """Run the demo; its exit code."""
    check(args)
    out: Path = args.out
    for stale in ("traces", "checkpoints", "logs"):
        shutil.rmtree(out / stale, ignore_errors=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "WORLD_SIZE": str(args.ranks), "LOCAL_WORLD_SIZE": str(args.ranks),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
        semconv.ENV_RUN_ID: os.environ.get(semconv.ENV_RUN_ID) or f"demo-{uuid.uuid4().hex[:12]}",
        semconv.ENV_METRICS_ADDR: os.environ.get(semconv.ENV_METRICS_ADDR, "127.0.0.1"),
        "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    command = [sys.executable, "-m", "dcp_otel.demo.rank", "--out", str(out), "--steps", str(args.steps),
               "--every", str(args.every), "--slow-seconds", str(args.slow_seconds)]  # fmt: skip
    if args.slow_rank is not None:
        command += ["--slow-rank", str(args.slow_rank)]
    if args.fail_rank is not None:
        command += ["--fail-rank", str(args.fail_rank)]
    print(f"dcp-otel demo: {args.ranks} ranks, {args.steps} steps, a checkpoint every {args.every}; output in {out}/",
          flush=True)  # fmt: skip
    procs, threads, logs = [], [], []
    for rank in range(args.ranks):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"}
        log = (out / "logs" / f"rank-{rank}.log").open("w")
        logs.append(log)
        proc = subprocess.Popen(command, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        thread = threading.Thread(target=_forward, args=(proc.stdout, log, rank == 0), daemon=True)
        thread.start()
        threads.append(thread)
    codes = _wait_all(procs)
    for thread in threads:
        thread.join(timeout=10)
    for log in logs:
        log.close()
    if any(codes):
        failed = next(rank for rank, code in enumerate(codes) if code)
        print(f"dcp-otel demo: rank {failed} exited with {codes[failed]}; its log: {out}/logs/rank-{failed}.log",
              file=sys.stderr)  # fmt: skip
        print((out / "logs" / f"rank-{failed}.log").read_text()[-3000:], file=sys.stderr)
        return 1
    return write_report(out)


def _wait_all(procs: list[subprocess.Popen[str]]) -> list[int]:
    """Wait for every rank; if one fails, stop the others (they would wait for it forever)."""
    import time

    deadline = time.monotonic() + TIMEOUT_S
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
            break
        try:
            procs[0].wait(timeout=0.5)  # woken early by rank 0, the one that finishes last
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    return [p.wait() if p.returncode is None else p.returncode for p in procs]


def write_report(out: Path) -> int:
    report = build([out / "traces"])
    print()
    print(report.text())
    html_path, perfetto_path = out / "report.html", out / "trace.perfetto.json"
    html_path.write_text(report.html(), encoding="utf-8")
    perfetto_path.write_text(json.dumps(report.perfetto()), encoding="utf-8")
    print(f"spans (OTLP JSON):     {out / 'traces'}/rank-*.jsonl")
    print(f"report (HTML):         {html_path}")
    print(f"trace (Perfetto):      {perfetto_path}   (open in https://ui.perfetto.dev or chrome://tracing)")
    print(f"again, from the files: dcp-otel report {out / 'traces'}")
    return 0
