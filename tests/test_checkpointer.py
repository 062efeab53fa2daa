"""torch's ``_experimental`` checkpointer (SyncCheckpointer, AsyncCheckpointer), traced like DCP's save and load.

One real 2-rank gloo job (``workers/checkpointer_rank.py``) saves and loads
with both checkpointers; the async one writes in its checkpoint process, whose
spans go to a file of their own (configured by ``subprocess_init_fn``, as a user
would). Spans are read back from the OTLP JSON files, the way ``dcp-otel report``
reads them. A second process (``workers/checkpointer_outcomes.py``) runs the
same calls without and with dcp-otel and compares what they returned and raised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from dcp_otel import semconv
from dcp_otel.report import build
from tests.checkpointer_job import CheckpointerRun, assert_the_second_save_waited_for_the_first_write, per_rank
from tests.ports import free_port_range
from tests.ranks import REPO, WORKERS, rank_env, run_ranks

WORLD = 2
FILE_OF = "checkpoint_{rank}.pt"


class Run(CheckpointerRun):
    """The job's spans, results and files."""

    def file_size(self, folder: str, rank: int) -> int:
        return os.path.getsize(self.job.ckpt / folder / FILE_OF.format(rank=rank))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("checkpointer")
    job = run_ranks("checkpointer_rank", WORLD, tmp, env={"DCP_OTEL_RUN_ID": "checkpointer-test"},
                    extra_args=["--store-port", str(free_port_range(1))], timeout_s=240)  # fmt: skip
    return Run(job, WORLD)


def test_a_sync_save_is_one_trace_across_ranks_with_the_write_and_the_barrier_wait(run: Run) -> None:
    spans = run.trace_of("sync", semconv.CHECKPOINTER_SAVE)
    (root,) = [s for s in spans if s.name == semconv.SPAN_CHECKPOINT]
    ops = per_rank(spans, "dcp.checkpointer_save")
    writes, barriers = per_rank(spans, "dcp.write_checkpoint"), per_rank(spans, "dcp.barrier")
    assert set(ops) == set(writes) == set(barriers) == {0, 1}
    for rank in range(WORLD):
        assert run.parent(ops[rank]) is root
        assert run.parent(writes[rank]) is ops[rank] and run.parent(barriers[rank]) is writes[rank]
        size = run.file_size("sync", rank)
        assert writes[rank].attributes[semconv.ATTR_WRITTEN_BYTES] == size
        assert ops[rank].attributes[semconv.ATTR_WRITTEN_BYTES] == size
        assert not any(s.error for s in (ops[rank], writes[rank], barriers[rank]))
        # Waiting at the barrier is waiting for the others, on the span and on the histogram.
        assert ops[rank].attributes[semconv.ATTR_WAIT_SECONDS] >= barriers[rank].duration_s
    assert run.results[0]["sync_save"] == {"returned": "NoneType"} and run.results[0]["sync_load_equal"]


def test_an_async_save_is_one_trace_with_the_checkpoint_process_write_under_the_upload(run: Run) -> None:
    spans = run.trace_of("async", semconv.CHECKPOINTER_ASYNC_SAVE)
    (root,) = [s for s in spans if s.name == semconv.SPAN_CHECKPOINT]
    ops = per_rank(spans, "dcp.checkpointer_async_save")
    uploads, staging = per_rank(spans, semconv.SPAN_ASYNC_UPLOAD), per_rank(spans, semconv.SPAN_ASYNC_STAGING)
    stage, hand_off = per_rank(spans, "dcp.stage_checkpoint"), per_rank(spans, "dcp.hand_off_checkpoint")
    writes, barriers = per_rank(spans, "dcp.write_checkpoint"), per_rank(spans, "dcp.barrier")
    process_ids = {s.span_id for s in run.process_spans}
    for rank in range(WORLD):
        assert run.parent(ops[rank]) is root
        for caller_side in (uploads, staging, stage, hand_off):
            assert run.parent(caller_side[rank]) is ops[rank] and caller_side[rank].span_id not in process_ids
        # What its DefaultStager copied: bytes, from the CPU, into shared memory for the checkpoint process.
        assert stage[rank].attributes[semconv.ATTR_STAGING_BYTES] > 0
        assert stage[rank].attributes[semconv.ATTR_STAGING_DEVICE] == "cpu"
        assert isinstance(stage[rank].attributes[semconv.ATTR_STAGING_SHARED], bool)
        # The write ran in the checkpoint process, continuing the rank's upload.
        assert writes[rank].span_id in process_ids and barriers[rank].span_id in process_ids
        assert run.parent(writes[rank]) is uploads[rank] and run.parent(barriers[rank]) is writes[rank]
        assert writes[rank].resource["service.name"] == "ckpt-process"
        assert writes[rank].attributes[semconv.ATTR_WRITTEN_BYTES] == run.file_size("async", rank)
        # The checkpoint is durable when the upload ends: after the process's write.
        assert uploads[rank].end_ns >= writes[rank].end_ns and ops[rank].end_ns <= uploads[rank].end_ns
        assert not any(s.error for s in spans if int(s.attributes.get(semconv.ATTR_RANK, 0)) == rank)
        assert run.results[rank]["async_written"] == {"returned": "NoneType"} and run.results[rank]["async_load_equal"]


def test_a_save_waiting_for_the_previous_checkpoints_write_shows_the_wait(run: Run) -> None:
    assert_the_second_save_waited_for_the_first_write(run, semconv.CHECKPOINTER_ASYNC_SAVE, WORLD)


def test_loads_read_each_rank_file_whole(run: Run) -> None:
    for folder in ("sync", "async"):
        spans = run.trace_of(folder, semconv.CHECKPOINTER_LOAD)
        reads = per_rank(spans, "dcp.read_checkpoint")
        for rank in range(WORLD):
            assert reads[rank].attributes[semconv.ATTR_READ_BYTES] == run.file_size(folder, rank)


def test_a_commit_hook_failing_on_rank_1_in_the_checkpoint_process_is_an_error_on_its_spans_only(run: Run) -> None:
    spans = run.trace_of("async-fail", semconv.CHECKPOINTER_ASYNC_SAVE)
    writes, uploads = per_rank(spans, "dcp.write_checkpoint"), per_rank(spans, semconv.SPAN_ASYNC_UPLOAD)
    assert writes[1].error and "commit hook failed on rank 1" in (writes[1].exception or "")
    assert uploads[1].error  # the write future raised: the checkpoint is not durable
    assert not any(s.error for s in spans if s.attributes.get(semconv.ATTR_RANK) == 0)
    assert run.results[1]["async_fail_written"]["raised"] == "RuntimeError"
    assert run.results[0]["async_fail_written"] == {"returned": "NoneType"}
    report = run.report("async-fail", semconv.CHECKPOINTER_ASYNC_SAVE)
    assert report.failed_ranks == [1] and report.error == "RuntimeError: commit hook failed on rank 1"


def test_a_write_failing_on_rank_1_fails_its_write_and_the_barrier_rank_0_waits_at(run: Run) -> None:
    spans = run.trace_of("sync-fail", semconv.CHECKPOINTER_SAVE)
    ops = per_rank(spans, "dcp.checkpointer_save")
    writes, barriers = per_rank(spans, "dcp.write_checkpoint"), per_rank(spans, "dcp.barrier")
    # Rank 1: its file could not be written; it never reached the barrier.
    assert writes[1].error and "Is a directory" in writes[1].status_message and ops[1].error
    assert 1 not in barriers
    # Rank 0: wrote its file, then the barrier failed when rank 1 left.
    assert barriers[0].error and writes[0].error and ops[0].error
    assert writes[0].status_message == barriers[0].status_message
    assert run.results[1]["sync_fail_save"]["raised"] == "RuntimeError"
    assert run.results[0]["sync_fail_save"]["raised"] in ("RuntimeError", "DistBackendError")
    # The report names the write that failed first, not the barrier that failed because of it.
    report = run.report("sync-fail", semconv.CHECKPOINTER_SAVE)
    assert report.failed_ranks == [0, 1] and "Is a directory" in (report.error or "")


def test_metrics_count_both_sides_of_every_checkpoint_on_the_rank(run: Run) -> None:
    saves = {0: ("sync", "async", "async-a", "async-b", "async-fail"),
             1: ("sync", "async", "async-a", "async-b")}  # rank 1's failed write counts nothing
    for rank in range(WORLD):
        written = sum(run.file_size(folder, rank) for folder in saves[rank])
        assert run.sample(rank, "dcp_written_bytes_total") == written
        reads = run.file_size("sync", rank) + run.file_size("async", rank)
        assert run.sample(rank, "dcp_read_bytes_total") == reads
        # Relayed from the checkpoint process: its writes and barriers, on the rank's endpoint.
        for step in (semconv.CHECKPOINTER_WRITE, semconv.CHECKPOINTER_BARRIER):
            count = run.sample(rank, "dcp_step_duration_seconds_count", operation=semconv.CHECKPOINTER_ASYNC_SAVE,
                               step=step)  # fmt: skip
            assert count == 4, (rank, step)
        assert run.sample(rank, "dcp_async_saves_in_flight") == 0
        assert run.sample(rank, "dcp_operations_total", operation=semconv.CHECKPOINTER_SAVE, status="failure") == 1
        failed_async = run.sample(rank, "dcp_operations_total", operation=semconv.CHECKPOINTER_ASYNC_SAVE,
                                  status="failure")  # fmt: skip
        assert failed_async == rank  # rank 1's second async save failed
        staging = run.sample(rank, "dcp_async_phase_duration_seconds_count", phase=semconv.PHASE_STAGING)
        assert staging is not None and staging >= 4
        waits = run.sample(rank, "dcp_collective_wait_seconds_sum", operation=semconv.CHECKPOINTER_SAVE)
        barriers = run.sample(rank, "dcp_step_duration_seconds_sum", operation=semconv.CHECKPOINTER_SAVE,
                              step=semconv.CHECKPOINTER_BARRIER)  # fmt: skip
        assert waits is not None and barriers is not None and waits >= barriers > 0
        assert run.results[rank]["diagnostics"] == {"open_spans": 0}


def test_the_report_reads_the_checkpointer_like_dcp(run: Run) -> None:
    report = run.report("async", semconv.CHECKPOINTER_ASYNC_SAVE)
    assert report.operation == semconv.CHECKPOINTER_ASYNC_SAVE and report.error is None
    for rank in report.ranks:
        assert rank.upload == "completed" and rank.bytes == run.file_size("async", rank.rank)
        assert rank.upload_busy_s > 0
    sync = run.report("sync", semconv.CHECKPOINTER_SAVE)
    for rank in sync.ranks:
        assert rank.bytes == run.file_size("sync", rank.rank) and rank.throughput_bps
    # What `dcp-otel report` prints, from the same files: the run, its failures and their causes.
    whole = build(sorted((run.job.out / "traces").glob("*.jsonl")))
    text = whole.text(limit=None)
    assert "8 checkpoint operations (2 checkpointer_save, 2 checkpointer_load, 4 checkpointer_async_save)" in text
    assert "2 failed" in text and "commit hook failed on rank 1" in text and "Is a directory" in text
    assert "hand_off_checkpoint" in text and "barrier" in text
    assert "checkpointer_async_save" in whole.html()


def test_observability_changes_no_return_value_or_exception(tmp_path: Path) -> None:
    """Sync and async saves, loads (strict, partial, missing), staging, and failures in the caller and
    in the checkpoint process: the same outcome without and with dcp-otel."""
    done = subprocess.run([sys.executable, str(WORKERS / "checkpointer_outcomes.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=240, cwd=REPO, env=rank_env())  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["plain"] == seen["traced"]
    raised = [o for o in seen["plain"] if "raised" in o]
    assert len(raised) == 4  # the scenario really exercises failures
    statuses: dict[str, set[str]] = defaultdict(set)
    for name, status in seen["spans"]:
        statuses[name].add(status)
    assert "ERROR" in statuses["dcp.write_checkpoint"] and "ERROR" in statuses[semconv.SPAN_ASYNC_UPLOAD]
    assert seen["diagnostics"] == {"open_spans": 0}
