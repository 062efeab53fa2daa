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
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
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
    """A free port for the ranks' store, below the kernel's ephemeral range: a port-0 bind (each rank's metrics
    endpoint) is never given it. One taken from that range was given again, once, to rank 0's metrics endpoint, and
    the store then failed to listen on it (EADDRINUSE, a CI run)."""
    low = ephemeral_range()[0]
    for port in random.sample(range(max(1024, low - 12000), low), 64):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue  # (in use)
            return port
    with socket.socket() as probe:  # (none free below: the kernel's choice)
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range, first and last (Linux's default where it cannot be read): the ports a
    port-0 bind, or an outgoing connection, may be given."""
    try:
        low, high = (int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


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
    print(f"dcp-otel demo: {args.ranks} ranks, {args.steps} steps, a checkpoint every {args.every}; output in {out}/",
          flush=True)  # fmt: skip
    codes = _run_ranks(_command(args), args.ranks, out)
    if any(codes):
        failed = next(rank for rank, code in enumerate(codes) if code)
        log = out / "logs" / f"rank-{failed}.log"
        print(f"dcp-otel demo: rank {failed} exited with {codes[failed]}; its log: {log}", file=sys.stderr)
        print(log.read_text()[-3000:], file=sys.stderr)
        return 1
    return write_report(out)


def _command(args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "dcp_otel.demo.rank", "--out", str(args.out), "--steps", str(args.steps),
               "--every", str(args.every), "--slow-seconds", str(args.slow_seconds)]  # fmt: skip
    if args.slow_rank is not None:
        command += ["--slow-rank", str(args.slow_rank)]
    if args.fail_rank is not None:
        command += ["--fail-rank", str(args.fail_rank)]
    return command


def _run_ranks(command: list[str], ranks: int, out: Path) -> list[int]:
    """Start every rank with torchrun's environment, forward their output, and wait for them all."""
    env = {
        **os.environ,
        "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
        semconv.ENV_RUN_ID: os.environ.get(semconv.ENV_RUN_ID) or f"demo-{uuid.uuid4().hex[:12]}",
        semconv.ENV_METRICS_ADDR: os.environ.get(semconv.ENV_METRICS_ADDR, "127.0.0.1"),
        "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    procs: list[subprocess.Popen[str]] = []
    threads, logs = [], []
    try:
        for rank in range(ranks):
            log = (out / "logs" / f"rank-{rank}.log").open("w")
            logs.append(log)
            proc = subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
            procs.append(proc)
            thread = threading.Thread(target=_forward, args=(proc.stdout, log, rank == 0), daemon=True)
            thread.start()
            threads.append(thread)
        return _wait_all(procs)
    finally:  # also on Ctrl-C: no rank is left behind
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for thread in threads:
            thread.join(timeout=10)
        for log in logs:
            log.close()


def _wait_all(procs: list[subprocess.Popen[str]]) -> list[int]:
    """Wait for every rank; if one fails, stop the others (they would wait for it forever)."""
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
    return [p.wait() for p in procs]


def write_report(out: Path) -> int:
    """The details, where the files are, then the answer: the summary is the last screen."""
    report = build([out / "traces"])
    print()
    print(report.details_text())
    html_path, perfetto_path = out / "report.html", out / "trace.perfetto.json"
    html_path.write_text(report.html(), encoding="utf-8")
    perfetto_path.write_text(json.dumps(report.perfetto()), encoding="utf-8")
    print()
    print(f"spans (OTLP JSON):     {out / 'traces'}/rank-*.jsonl")
    print(f"report (HTML):         {html_path}")
    print(f"trace (Perfetto):      {perfetto_path}   (open in https://ui.perfetto.dev or chrome://tracing)")
    print(f"again, from the files: {report_command()} report {out / 'traces'} --html {html_path}")
    print()
    print(report.summary_text())
    return 0


def report_command() -> str:
    """How to run ``dcp-otel`` from here: the script beside this interpreter, else ``python -m dcp_otel``."""
    script = Path(sys.executable).with_name("dcp-otel")
    if shutil.which("dcp-otel") == str(script):
        return "dcp-otel"  # on PATH (an activated environment, or installed for the user)
    if script.exists():
        try:
            return str(script.relative_to(Path.cwd()))
        except ValueError:
            return str(script)
    return f"{sys.executable} -m dcp_otel"
