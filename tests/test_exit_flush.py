"""Spans are flushed at interpreter exit, and a hung exporter cannot hold the exit (real processes)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from dcp_otel import semconv
from tests.ranks import REPO, WORKERS, rank_env
from tests.spans_io import load_spans


def run_script(mode: str, out: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    run = subprocess.run(
        [sys.executable, str(WORKERS / "exit_flush.py"), mode, str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=rank_env(**env),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads(run.stdout.strip().splitlines()[-1])


def test_a_script_that_never_flushes_still_exports_its_last_checkpoint(tmp_path: Path) -> None:
    _, diagnostics = run_script("file", tmp_path)
    names = [s.name for s in load_spans([tmp_path / "spans.jsonl"])]
    assert {"dcp.async_save", "dcp.async_upload", "dcp.write_data", "dcp.checkpoint"} <= set(names)
    assert names.count("dcp.async_upload") == 1
    assert "flush_timeout" not in diagnostics


def test_a_hung_exporter_delays_exit_by_at_most_the_flush_timeout(tmp_path: Path) -> None:
    # The subprocess timeout (120 s) is the failure: without a bound the exit would hang forever.
    _, diagnostics = run_script("hung", tmp_path, DCP_OTEL_FLUSH_TIMEOUT_S="1")
    assert diagnostics["flush_timeout"] == 1


def test_an_exporter_that_never_returns_on_the_thread_that_ends_a_span_delays_exit_by_at_most_the_flush_timeout(
        tmp_path: Path) -> None:  # fmt: skip
    """Through a ``SimpleSpanProcessor`` a span's end runs the exporter: the ``dcp.process`` span that dcp-otel ends
    at exit is ended on a thread of its own, so a hung exporter holds the exit no longer than the flush timeout (it
    held it for good before; the subprocess timeout, 120 s, is the failure)."""
    run, _ = run_script("hung-simple", tmp_path, DCP_OTEL_FLUSH_TIMEOUT_S="1")
    plain, _ = run_script("hung-simple-plain", tmp_path, DCP_OTEL_FLUSH_TIMEOUT_S="1")
    assert run.returncode == plain.returncode == 0 and run.stdout.count("\n") == plain.stdout.count("\n")


def test_a_job_whose_collector_never_answers_ends_as_plain_its_agent_not_waiting_for_the_exporter_again(
        tmp_path: Path) -> None:  # fmt: skip
    """Under ``opentelemetry-instrument torchrun``, each rank's exit flush gives up after the flush timeout and leaves
    its spans in its record; torchelastic's agent then hands them to its own provider, whose exporter is stuck on
    the same collector. The agent's exit waits half the flush timeout for them and leaves that provider's shutdown
    to a daemon thread: the SDK's exit hook would wait for the exporter again (30 s, its batch processor's bound,
    with an exporter whose timeout is longer; with the defaults a review found the job ending 21 s after plain, 10
    of them the agent's). The job may take the flush timeout (1 s) and the agent's half of it longer than plain;
    15 s is far from both that and the hook's 30 s."""
    bin_dir = Path(sys.executable).parent
    torchrun = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "1", "--monitor-interval", "0.1",
                str(WORKERS / "plain_train.py")]  # fmt: skip
    with socket.socket() as collector:
        collector.bind(("127.0.0.1", 0))
        collector.listen(128)  # the kernel completes connections; nobody ever reads or answers
        otel = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TIMEOUT": "300",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.getsockname()[1]}",
                "DCP_OTEL_FLUSH_TIMEOUT_S": "1", semconv.ENV_SPOOL_DIR: str(tmp_path / "spool")}  # fmt: skip
        runs, took = {}, {}
        for name, command in (("plain", torchrun), ("traced", [str(bin_dir / "opentelemetry-instrument"), *torchrun])):
            started = time.monotonic()
            runs[name] = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                                        env=rank_env(**otel, CKPT=str(tmp_path / name)))  # fmt: skip
            took[name] = time.monotonic() - started
    assert runs["plain"].returncode == runs["traced"].returncode == 0, runs["traced"].stderr[-3000:]
    assert took["traced"] < took["plain"] + 15, took
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == sorted(p.name for p in (tmp_path / "traced").iterdir())
    # (The rank's exit flush gave up, its spans left in its record: what the agent then sends through its provider.)
    assert "the span exporter did not finish flushing in time" in runs["traced"].stderr
