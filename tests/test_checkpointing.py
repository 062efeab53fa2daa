"""``torch_checkpointing`` (where torch's checkpointer went), traced like DCP's save and load.

One real 2-rank gloo job (``workers/checkpointing_rank.py``) saves and loads with a sync and an async
``CheckpointManager``; the async one writes in its writer process, whose spans go to a file of their own
(configured by ``subprocess_init_fn``, as a user would); rank 1's last write fails in that process (an
injected disk failure). Spans are read back from the OTLP JSON files, the way ``dcp-otel report`` reads
them. The same job runs without dcp-otel: what every call returned or raised, and every file, must match.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_otel import _selftelemetry, semconv
from dcp_otel.attach.torch_checkpointing import LATENCY_PREFIX, latency_attribute
from dcp_otel.otlp_file import read_spans
from dcp_otel.report import build
from tests.checkpointer_job import CheckpointerRun, assert_the_second_save_waited_for_the_first_write, per_rank
from tests.ranks import REPO, Job, rank_env, run_ranks

WORLD = 2
SAVE, ASYNC_SAVE, LOAD = semconv.CHECKPOINTING_SAVE, semconv.CHECKPOINTING_ASYNC_SAVE, semconv.CHECKPOINTING_LOAD
WRITE, ITEMS, BARRIER = "dcp.write_checkpoint", "dcp.write_items", "dcp.barrier"
FINALIZE, METADATA = f"dcp.{semconv.CHECKPOINTING_FINALIZE}", f"dcp.{semconv.CHECKPOINTING_WRITE_METADATA}"
ITEM_KEYS = ("model", "optimizer", "step")


class Run(CheckpointerRun):
    """The job's spans, results and files; and the plain job's results."""

    def __init__(self, job: Job, plain: Job) -> None:
        super().__init__(job, WORLD)
        self.plain_results = [json.loads((plain.out / f"result-{r}.json").read_text()) for r in range(WORLD)]

    def bytes_of(self, folder: str, rank: int) -> int:
        """The bytes of ``rank``'s item files in a checkpoint (``<item>_<rank>.pt``)."""
        return sum(os.path.getsize(self.job.ckpt / folder / f"{key}_{rank}.pt") for key in ITEM_KEYS)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    env = {"DCP_OTEL_RUN_ID": "checkpointing-test"}
    traced = run_ranks("checkpointing_rank", WORLD, tmp_path_factory.mktemp("checkpointing"), env=env, timeout_s=240)
    plain = run_ranks("checkpointing_rank", WORLD, tmp_path_factory.mktemp("checkpointing-plain"), env=env,
                      extra_args=["--plain"], timeout_s=240)  # fmt: skip
    return Run(traced, plain)


def test_a_sync_save_is_one_trace_across_ranks_with_its_items_barrier_and_durable_rename(run: Run) -> None:
    spans = run.trace_of("sync", SAVE)
    (root,) = [s for s in spans if s.name == semconv.SPAN_CHECKPOINT]
    ops, writes, items = per_rank(spans, f"dcp.{SAVE}"), per_rank(spans, WRITE), per_rank(spans, ITEMS)
    barriers, finalize = per_rank(spans, BARRIER), per_rank(spans, FINALIZE)
    assert set(ops) == set(writes) == set(items) == set(barriers) == {0, 1}
    assert set(finalize) == set(per_rank(spans, METADATA)) == {0}  # role rank 0 writes the metadata and renames
    for rank in range(WORLD):
        assert run.parent(ops[rank]) is root and run.parent(writes[rank]) is ops[rank]
        assert run.parent(items[rank]) is writes[rank] and run.parent(barriers[rank]) is writes[rank]
        # The items: one file each, their bytes on the write and the operation.
        assert items[rank].attributes[semconv.ATTR_ITEMS] == len(ITEM_KEYS)
        assert sorted(items[rank].attributes[semconv.ATTR_ITEMS_SLOWEST]) == sorted(ITEM_KEYS)
        assert ops[rank].attributes[semconv.ATTR_WRITTEN_BYTES] == run.bytes_of("sync", rank)
        assert writes[rank].attributes[semconv.ATTR_WRITTEN_BYTES] == run.bytes_of("sync", rank)
        # torch_checkpointing's own latencies (whole milliseconds), on the span they measured.
        assert isinstance(writes[rank].attributes[f"{LATENCY_PREFIX}write.execute.final_barrier_ms"], int)
        assert ops[rank].attributes[semconv.ATTR_WAIT_SECONDS] >= barriers[rank].duration_s
        assert not any(s.error for s in (ops[rank], writes[rank], items[rank], barriers[rank]))
    # Durable when rank 0's rename ends: after every rank reached the barrier (each had written its items).
    assert run.parent(finalize[0]) is writes[0] and finalize[0].start_ns >= barriers[0].end_ns
    assert finalize[0].start_ns >= max(b.start_ns for b in barriers.values()) >= max(i.end_ns for i in items.values())
    assert run.results[0]["sync_save"] == {"returned": "NoneType"} and run.results[0]["sync_load_equal"]


def test_an_async_save_is_one_trace_with_the_writer_process_under_the_upload(run: Run) -> None:
    spans = run.trace_of("async", ASYNC_SAVE)
    (root,) = [s for s in spans if s.name == semconv.SPAN_CHECKPOINT]
    ops = per_rank(spans, f"dcp.{ASYNC_SAVE}")
    uploads, staging = per_rank(spans, semconv.SPAN_ASYNC_UPLOAD), per_rank(spans, semconv.SPAN_ASYNC_STAGING)
    stage, hand_off = per_rank(spans, "dcp.stage_checkpoint"), per_rank(spans, "dcp.hand_off_checkpoint")
    writes, items, barriers = per_rank(spans, WRITE), per_rank(spans, ITEMS), per_rank(spans, BARRIER)
    process_ids = {s.span_id for s in run.process_spans}
    for rank in range(WORLD):
        assert run.parent(ops[rank]) is root
        for caller_side in (uploads, staging, stage, hand_off):
            assert run.parent(caller_side[rank]) is ops[rank] and caller_side[rank].span_id not in process_ids
        # The copy, on the ckpt-staging thread: its bytes, from the CPU, into shared memory (torch_checkpointing's
        # default), and the rate on the staging future's span.
        assert stage[rank].attributes[semconv.ATTR_STAGING_BYTES] > 0
        assert stage[rank].attributes[semconv.ATTR_STAGING_DEVICE] == "cpu"
        assert stage[rank].attributes[semconv.ATTR_STAGING_SHARED] is True
        assert stage[rank].attributes[semconv.ATTR_STAGING_PINNED] is False
        assert staging[rank].attributes[semconv.ATTR_STAGING_RATE] > 0
        # The write ran in the writer process, continuing the rank's upload.
        for side in (writes, items, barriers):
            assert side[rank].span_id in process_ids and side[rank].resource["service.name"] == "ckpt-writer"
        assert run.parent(writes[rank]) is uploads[rank] and run.parent(items[rank]) is writes[rank]
        assert writes[rank].attributes[semconv.ATTR_WRITTEN_BYTES] == run.bytes_of("async", rank)
        # The checkpoint is durable when the upload ends: after the process's write (and rank 0's rename).
        assert uploads[rank].end_ns >= writes[rank].end_ns and ops[rank].end_ns <= uploads[rank].end_ns
        # The step its logging context said (checkpoint_logging_context.update(step=7)).
        assert ops[rank].attributes[semconv.ATTR_TRAINING_STEP] == 7
        assert not any(s.error for s in spans if s.attributes.get(semconv.ATTR_RANK) == rank)
        assert run.results[rank]["async_written"] == {"returned": "NoneType"} and run.results[rank]["async_load_equal"]
    (finalize,) = [s for s in spans if s.name == FINALIZE]
    assert finalize.span_id in process_ids and run.parent(finalize) is writes[0]


def test_a_save_waiting_for_the_previous_write_shows_the_wait(run: Run) -> None:
    assert_the_second_save_waited_for_the_first_write(run, ASYNC_SAVE, WORLD)


def test_loads_count_the_bytes_of_every_file_they_read(run: Run) -> None:
    for folder in ("sync", "async"):
        spans = run.trace_of(folder, LOAD)
        reads, ops = per_rank(spans, "dcp.read_checkpoint"), per_rank(spans, f"dcp.{LOAD}")
        for rank in range(WORLD):
            assert reads[rank].attributes[semconv.ATTR_READ_BYTES] == run.bytes_of(folder, rank)
            assert ops[rank].attributes[semconv.ATTR_READ_BYTES] == run.bytes_of(folder, rank)


def test_a_write_failing_in_rank_1s_writer_process_is_marked_where_it_started(run: Run) -> None:
    spans = run.trace_of("async-fail", ASYNC_SAVE)
    items, writes = per_rank(spans, ITEMS), per_rank(spans, WRITE)
    uploads, barriers = per_rank(spans, semconv.SPAN_ASYNC_UPLOAD), per_rank(spans, BARRIER)
    process_ids = {s.span_id for s in run.process_spans}
    # Rank 1: the item whose file failed, on the step that wrote it, in the writer process; no barrier.
    assert items[1].error and items[1].span_id in process_ids
    assert "injected: disk failure on rank 1" in items[1].status_message and "OSError" in (items[1].exception or "")
    assert items[1].attributes[semconv.ATTR_ITEMS_FAILED] == "model" and writes[1].error and 1 not in barriers
    assert uploads[1].error  # the write future raised: not durable
    # Rank 0: wrote its items, then its barrier gave up waiting for rank 1.
    assert not items[0].error and barriers[0].error and uploads[0].error
    assert run.results[1]["async_fail_written"]["raised"] == "OSError"  # (rebuilt from the type torch_checkpointing sent)
    report = run.report("async-fail", ASYNC_SAVE)
    assert report.failed_ranks == [0, 1] and report.origins == [1] and report.failed_waiting == [0]
    assert "injected: disk failure on rank 1" in (report.error or "")
    text = build(sorted((run.job.out / "traces").glob("*.jsonl"))).text(limit=None)
    assert "it started on rank 1; rank 0 failed waiting for it" in text


def test_metrics_count_both_sides_of_every_checkpoint_on_the_rank(run: Run) -> None:
    for rank in range(WORLD):
        written = sum(run.bytes_of(folder, rank) for folder in ("sync", "async", "async-a", "async-b"))
        assert run.sample(rank, "dcp_written_bytes_total") == written  # the failed save counts nothing
        assert run.sample(rank, "dcp_read_bytes_total") == run.bytes_of("sync", rank) + run.bytes_of("async", rank)
        # Relayed from the writer process: its writes and barriers, on the rank's endpoint.
        count = run.sample(rank, "dcp_step_duration_seconds_count", operation=ASYNC_SAVE, step="write_items")
        assert count == 4, rank
        assert run.sample(rank, "dcp_async_saves_in_flight") == 0
        assert run.sample(rank, "dcp_operations_total", operation=ASYNC_SAVE, status="success") == 3
        assert run.sample(rank, "dcp_operations_total", operation=ASYNC_SAVE, status="failure") == 1
        assert run.sample(rank, "dcp_operations_total", operation=SAVE, status="success") == 1
        staged = run.sample(rank, "dcp_async_phase_duration_seconds_count", phase=semconv.PHASE_STAGING)
        assert staged is not None and staged >= 4
        assert run.results[rank]["diagnostics"] == {"open_spans": 0}


def test_the_report_reads_torch_checkpointing_like_dcp(run: Run) -> None:
    report = run.report("async", ASYNC_SAVE)
    assert report.error is None and report.training_step == 7
    for rank in report.ranks:
        assert rank.upload == "completed" and rank.bytes == run.bytes_of("async", rank.rank)
    whole = build(sorted((run.job.out / "traces").glob("*.jsonl")))
    text = whole.text(limit=None)
    assert "7 checkpoint operations (1 checkpointing_save, 2 checkpointing_load, 4 checkpointing_async_save)" in text
    assert "finalize_checkpoint" in text and "write_items" in text and "hand_off_checkpoint" in text
    assert "checkpointing_async_save" in whole.html()


def test_plain_and_instrumented_return_raise_and_write_the_same(run: Run) -> None:
    """Every call's result (or exception type and first line), and every byte of every file."""
    for traced, plain in zip(run.results, run.plain_results, strict=True):
        assert {k: v for k, v in traced.items() if k not in ("samples", "diagnostics")} == plain
    assert run.results[0]["files"] and run.results[0]["files"] == run.plain_results[0]["files"]
    assert run.results[1]["async_fail_written"]["raised"] == "OSError"  # the scenario really fails


# --- a schema that moves --------------------------------------------------------------------------------
def test_each_latency_becomes_one_bounded_attribute_and_per_item_ones_none() -> None:
    assert latency_attribute("train.checkpoint_write.submit.wait_for_prev.latency_ms") == \
        "torch_checkpointing.write.submit.wait_for_prev_ms"  # fmt: skip
    assert latency_attribute("train.checkpoint_read.execute.filesystem.metadata.read.latency_ms") == \
        "torch_checkpointing.read.execute.filesystem.metadata.read_ms"  # fmt: skip
    assert latency_attribute("train.checkpoint_metadata.all_gather.latency_ms") == \
        "torch_checkpointing.metadata.all_gather_ms"  # fmt: skip
    # An item's key in the name: the items are summarized on dcp.write_items instead (no unbounded attributes).
    assert latency_attribute("train.checkpoint_write.execute.storage.model.save_task.e2e.latency_ms") is None
    assert latency_attribute("train.checkpoint_read.execute.filesystem.model.read.latency_ms") is None
    assert latency_attribute("latency_ms") is None


def test_an_unknown_event_type_or_field_is_counted_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    from torch_checkpointing.logging_utils import EventLogger, EventType

    import dcp_otel

    _selftelemetry.reset()
    with caplog.at_level(logging.INFO, logger="dcp_otel"):
        dcp_otel.instrument()
    try:
        lines = [r.getMessage() for r in caplog.records if "torch_checkpointing" in r.getMessage()]
        assert lines == ["dcp_otel: torch_checkpointing 0.1.1 instrumented (tested: 0.1.1)"]
        logged = EventLogger()(EventType.LOG_METRIC, metric_name="train.checkpoint_write.x.latency_ms")
        assert _selftelemetry.counts().get("library_schema", 0) == 0
        # A field its next release adds (its main branch has measured_from_start_time_ms): counted, and the
        # record it returns is exactly what torch_checkpointing made.
        moved = EventLogger()(EventType.LOG_METRIC, metric_name="train.checkpoint_write.x.latency_ms",
                              measured_from_start_time_ms=5)  # fmt: skip
        assert moved["measured_from_start_time_ms"] == 5 and set(moved) - set(logged) == {"measured_from_start_time_ms"}
        assert _selftelemetry.counts()["library_schema"] == 1
    finally:
        dcp_otel.uninstrument()


def test_without_torch_checkpointing_instrument_says_nothing_about_it(tmp_path: Path) -> None:
    """An optional package: absent, its points are skipped without a word (and the training runs as before)."""
    script = ("import logging, sys; sys.modules['torch_checkpointing'] = None\n"
              "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
              "import dcp_otel; dcp_otel.instrument(); print('instrumented'); dcp_otel.uninstrument()\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=rank_env())  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "instrumented" in done.stdout and "torch_checkpointing" not in done.stdout + done.stderr
    assert "Missing" not in done.stdout + done.stderr



def test_opentelemetry_instrument_torchrun_traces_it_with_no_code_in_the_script_or_its_writer_process(
    tmp_path: Path,
) -> None:
    """Zero code: ``opentelemetry-instrument torchrun`` and OTEL_* alone; spans over real OTLP/HTTP to a loopback
    receiver, the writer processes' included (their tracer provider built from the OTEL_* they inherit)."""
    from tests.otlp_receiver import OtlpReceiver
    from tests.ranks import WORKERS

    bindir = Path(sys.executable).parent
    with OtlpReceiver() as receiver:
        env = {**rank_env(), "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_METRICS_EXPORTER": "none",
               "OTEL_LOGS_EXPORTER": "none", "OTEL_SERVICE_NAME": "zero-code-checkpointing",
               "CKPT": str(tmp_path / "c")}  # fmt: skip
        run = subprocess.run([str(bindir / "opentelemetry-instrument"), str(bindir / "torchrun"), "--standalone",
                              "--nproc-per-node", "2", str(WORKERS / "checkpointing_train.py")],
                             capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    spans = receiver.spans
    saves = [s for s in spans if s.name == f"dcp.{ASYNC_SAVE}"]
    assert sorted(s.attributes["dcp.rank"] for s in saves) == [0, 1] and len({s.trace_id for s in saves}) == 1
    assert all(s.attributes[semconv.ATTR_TRAINING_STEP] == 100 for s in saves)  # from its id, step-100
    in_trace = [s for s in spans if s.trace_id == saves[0].trace_id]
    by_id = {s.span_id: s for s in in_trace}
    assert [s.name for s in in_trace].count(semconv.SPAN_CHECKPOINT) == 1
    assert all(s.parent_id in by_id for s in in_trace if s.name != semconv.SPAN_CHECKPOINT)  # no orphans
    writes = [s for s in in_trace if s.name == WRITE]
    assert sorted(by_id[s.parent_id].attributes["dcp.rank"] for s in writes) == [0, 1]
    assert all(by_id[s.parent_id].name == semconv.SPAN_ASYNC_UPLOAD for s in writes)  # in the writer process
    assert [s.name for s in in_trace].count(FINALIZE) == 1
    loads = [s for s in spans if s.name == f"dcp.{LOAD}"]
    assert sorted(s.attributes["dcp.rank"] for s in loads) == [0, 1]
    assert all(s.resource["service.name"] == "zero-code-checkpointing" for s in spans)


def test_its_logging_contexts_step_is_its_own_operations_training_step_and_not_dcps(tmp_path: Path) -> None:
    """``checkpoint_logging_context.update(step=5)`` says the step of torch_checkpointing's saves; a ``dcp.save``
    beside them keeps reading its own (none in ``latest``)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.logging_utils import checkpoint_logging_context
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    import dcp_otel

    provider, exported = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    writer = CheckpointWriterConfig(barrier_config=None, write_to_temp_dir=False)  # one process, no process group
    dcp_otel.instrument(tracer_provider=provider)
    try:
        manager = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(writer_config=writer),
                                                             storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))  # fmt: skip
        checkpoint_logging_context.update(step=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (DCP: "assuming the intent is to save in a single process")
            dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "latest"))
        manager.save(str(tmp_path / "latest-items"), {"model": {"w": torch.ones(4)}})
        manager.close()
        assert dcp_otel.flush(timeout_s=30, tracer_provider=provider)
    finally:
        checkpoint_logging_context.update(step=None)
        dcp_otel.uninstrument()
    spans = {s.name: s for s in exported.get_finished_spans()}
    assert semconv.ATTR_TRAINING_STEP not in spans["dcp.save"].attributes
    assert spans[f"dcp.{SAVE}"].attributes[semconv.ATTR_TRAINING_STEP] == 5


def test_a_writer_process_killed_mid_write_is_reported_by_its_rank_in_the_checkpoints_trace(tmp_path: Path) -> None:
    """SIGKILL runs no Python in the writer process: what it had open comes from its record, sent by the rank (its
    parent's survivor), in the trace of the save it was writing. The caller sees what it sees without dcp-otel."""
    from tests.ranks import WORKERS

    seen = {}
    for arm in ("plain", "traced"):
        out = tmp_path / arm
        out.mkdir()
        env = rank_env(DCP_OTEL_SPOOL_DIR=str(out / "spool"), DCP_OTEL_RUN_ID=f"killed-writer-{arm}")
        done = subprocess.run([sys.executable, str(WORKERS / "checkpointing_killed_writer.py"), str(out),
                               *(["--plain"] if arm == "plain" else [])], capture_output=True, text=True,
                              timeout=240, cwd=REPO, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        seen[arm] = json.loads((out / "result.json").read_text())
    assert seen["traced"].pop("reported") is True
    assert seen["traced"] == seen["plain"] == {"first": {"returned": "NoneType"}, "second": {"raised": "RuntimeError"}}
    spans = read_spans([tmp_path / "traced" / "traces" / "rank-0.jsonl"])
    second = [s for s in spans if str(s.attributes.get(semconv.ATTR_CHECKPOINT_ID, "")).endswith("second")]
    by_name = {s.name: s for s in second}
    write, items, upload = by_name[WRITE], by_name[ITEMS], by_name[semconv.SPAN_ASYNC_UPLOAD]
    assert items.status_message == "terminated by SIGKILL during write_items in the checkpoint process"
    assert write.error and items.parent_id == write.span_id and write.parent_id == upload.span_id
    assert upload.error and len({s.trace_id for s in second}) == 1


def test_its_own_wait_timeout_a_relative_path_and_a_prewarm_copy_come_out_as_without_dcp_otel(tmp_path: Path) -> None:
    """``wait_timeout_secs`` still bounds a save's wait for the previous write (torch_checkpointing's own
    RuntimeError, timed as ``dcp.wait_previous_checkpoint``); ``./relative`` has its bytes counted where rank 0
    renamed its folder; a ``prewarm_staging`` copy is no operation."""
    from tests.ranks import WORKERS

    seen = {}
    for arm in ("plain", "traced"):
        out = tmp_path / arm
        out.mkdir()
        done = subprocess.run([sys.executable, str(WORKERS / "checkpointing_edges.py"), str(out),
                               *(["--plain"] if arm == "plain" else [])], capture_output=True, text=True,
                              timeout=240, cwd=REPO, env=rank_env(DCP_OTEL_RUN_ID=f"edges-{arm}"))  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        seen[arm] = json.loads((out / "result.json").read_text())
    assert seen["traced"] == seen["plain"]
    assert seen["plain"]["next"]["raised"] == "RuntimeError" and "lock" in seen["plain"]["next"]["message"]
    spans = read_spans([tmp_path / "traced" / "traces" / "rank-0.jsonl"])
    (wait,) = [s for s in spans if s.name == "dcp.wait_previous_checkpoint"]
    (nxt,) = [s for s in spans if s.name == f"dcp.{ASYNC_SAVE}" and str(s.attributes[semconv.ATTR_CHECKPOINT_ID]) == "next"]
    assert wait.parent_id == nxt.span_id and wait.error and "Failed to acquire" in wait.status_message
    # Its own timeout (1 s): it gave up before the slow write (4 s) ended.
    (slow_upload,) = [s for s in spans if s.name == semconv.SPAN_ASYNC_UPLOAD and s.trace_id != nxt.trace_id]
    assert wait.duration_s >= 0.9 and wait.end_ns < slow_upload.end_ns
    (relative,) = [s for s in spans if s.name == f"dcp.{SAVE}"]
    files = tmp_path / "traced" / "ckpt" / "relative"
    assert relative.attributes[semconv.ATTR_WRITTEN_BYTES] == sum(p.stat().st_size for p in files.glob("*_0.pt")) > 0
    assert {s.attributes.get(semconv.ATTR_OPERATION) for s in spans} == {SAVE, ASYNC_SAVE}  # no prewarm operation
