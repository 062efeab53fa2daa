"""A training script that forks neither deadlocks nor duplicates spans or metrics (real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, multiprocess

from tests.ranks import REPO, WORKERS, rank_env
from tests.spans_io import load_spans


def run_worker(mode: str, out: Path, **env: str) -> dict[str, object]:
    run = subprocess.run(
        [sys.executable, str(WORKERS / "fork_train.py"), mode, str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=rank_env(**env),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def test_a_child_forked_while_other_threads_hold_our_locks_can_checkpoint(tmp_path: Path) -> None:
    seen = run_worker("locks", tmp_path)
    assert seen["child_status"] == 0
    child = json.loads((tmp_path / "child.json").read_text())
    assert child["flushed"] is True
    assert child["diagnostics"] == {"open_spans": 0}  # its own counts, not the parent's
    child_spans = [s for path in tmp_path.glob("spans-*.jsonl") for s in load_spans([path])]
    assert "dcp.save" in {s.name for s in child_spans}  # the child's own save was traced


def test_dataloader_workers_and_forked_children_duplicate_no_span_and_no_metric(tmp_path: Path) -> None:
    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    seen = run_worker("dataloader", out, PROMETHEUS_MULTIPROC_DIR=str(prom_dir))
    assert seen["total"] == sum(i * i for i in range(8)) and seen["child_status"] == 0

    files = sorted(out.glob("spans-*.jsonl"))
    assert [f.name for f in files] == [f"spans-{seen['pid']}.jsonl"]  # no forked process exported anything
    spans = load_spans(files)
    assert len({s.span_id for s in spans}) == len(spans)  # each span exactly once
    assert [s.name for s in spans].count("dcp.async_save") == 1
    assert [s.name for s in spans].count("dcp.async_upload") == 1  # exported at exit, after the upload ended

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(prom_dir))
    total = registry.get_sample_value("dcp_operations_total", {"operation": "async_save", "status": "success",
                                                               "rank": "0"})  # fmt: skip
    assert total == 1  # the parent's one async save, counted once across all processes' files
