"""Spans are flushed at interpreter exit, and a hung exporter cannot hold the exit (real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
