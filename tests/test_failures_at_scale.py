"""Failures told right at every scale: global ranks, counted where they start (real gloo ranks).

``tests/workers/subgroup_rank.py``: 4 ranks; groups [0, 1] and [2, 3] each save with their
own ``process_group``, and global rank 3 (rank 1 of its group) runs out of disk; then all
4 save one checkpoint and global rank 1 runs out of disk. ``detail="auto"``, span budget 16.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan, read_spans
from tests.ranks import REPO, Job, run_ranks

IN_GROUP, IN_WORLD = 3, 1


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return run_ranks("subgroup_rank", 4, tmp_path_factory.mktemp("subgroups"), timeout_s=180)


def results(job: Job) -> list[dict[str, Any]]:
    return [json.loads((job.out / f"result-{r}.json").read_text()) for r in range(job.world)]


def spans_of(job: Job, checkpoint: str) -> list[FileSpan]:
    """The spans of the checkpoint saved to ``checkpoint`` (the last part of its path)."""
    return [s for s in read_spans([job.out / "traces"])
            if str(s.attributes.get(semconv.ATTR_CHECKPOINT_ID, "")).endswith("/" + checkpoint)]  # fmt: skip


def sample(result: dict[str, Any], name: str, **labels: str) -> float | None:
    return next((v for n, ls, v in result["samples"] if n == name and labels.items() <= ls.items()), None)


def report(job: Job) -> str:
    done = subprocess.run([sys.executable, "-m", "dcp_otel", "report", str(job.out / "traces"), "--all"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_sub_group_save_names_the_failed_rank_by_its_global_rank(job: Job) -> None:
    found = results(job)
    # torch itself numbers it within the group: rank 1 of [2, 3].
    assert [r["group"]["raised"] for r in found] == [None, None, "CheckpointException", "CheckpointException"]
    assert found[IN_GROUP]["group"]["failure_keys"] == [1]
    spans = spans_of(job, "group-1")
    saves = {s.attributes[semconv.ATTR_RANK]: s for s in spans if s.name == "dcp.save"}
    assert sorted(saves) == [2, 3]
    for save in saves.values():
        assert save.attributes[semconv.ATTR_FAILED_RANKS] == [IN_GROUP]
        assert save.status_message.startswith(f"CheckpointException: ranks [{IN_GROUP}] failed; rank {IN_GROUP}: OSError")
    # detail="auto" knows the failing rank as failed: its write_data, with the real exception, is exported.
    (write,) = [s for s in spans if s.name == "dcp.write_data" and s.attributes[semconv.ATTR_RANK] == IN_GROUP]
    assert write.error and write.exception and "injected on global rank 3" in write.exception
    assert saves[IN_GROUP].attributes[semconv.ATTR_DETAIL_REASON] == "failed"
    # Nothing of group [0, 1] failed, and nobody names global rank 1.
    assert not [s for s in spans_of(job, "group-0") if s.error]


def test_a_failure_is_counted_once_on_the_rank_where_it_started_with_its_error_type(job: Job) -> None:
    found = results(job)
    failures, operations = f"{semconv.METRIC_FAILURES}_total", f"{semconv.METRIC_OPERATIONS}_total"
    # Where each started: rank 3's own OSError in its group's save, rank 1's in the world's. Every other failed rank
    # only re-raised torch's report of it.
    started = {rank: sample(found[rank], failures, operation="save", error_type="OSError") for rank in range(4)}
    assert started == {0: None, 1: 1.0, 2: None, 3: 1.0}
    assert not [n for r in found for n, ls, v in r["samples"] if n == failures and ls["error_type"] != "OSError"]
    # The operations counter keeps its meaning: every rank's own outcome.
    failed = {rank: sample(found[rank], operations, operation="save", status="failure") for rank in range(4)}
    assert failed == {0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0}


def test_the_report_marks_where_each_failure_started_and_says_torchs_report_once(job: Job) -> None:
    blocks = {block.split()[1].rsplit("/", 1)[-1]: block for block in report(job).split("\n\n") if block.startswith("save ")}
    world, group = blocks["world"], blocks["group-1"]
    assert f"failed on rank {IN_WORLD}: OSError" in world and f"it started on rank {IN_WORLD};" in world
    rows = {line.split()[0]: line for line in world.splitlines() if line.strip()[:1].isdigit()}
    assert "<- failed here" in rows[str(IN_WORLD)]
    assert all(f"CheckpointException (rank {IN_WORLD}'s failure)" in rows[str(r)] for r in (0, 2, 3))
    assert f"failed on rank {IN_GROUP}: OSError" in group and f"it started on rank {IN_GROUP};" in group
