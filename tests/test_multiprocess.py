"""Real multi-process jobs (gloo on CPU): one trace per checkpoint across all ranks.

Two jobs write the same checkpoint ids, in order, in the same folder:
* 2 ranks, run id from ``DCP_OTEL_RUN_ID``, with rank 1 running out of disk in
  ``write_data`` on a last save;
* 4 ranks, run id from ``TORCHELASTIC_RUN_ID``.
Each rank saves (inside a user ``train_step`` span), saves the same id again,
loads, and async-saves; see ``tests/workers/dcp_rank.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcp_otel import semconv
from tests.ranks import Job, run_ranks
from tests.spans_io import SpanRecord, by_trace, load_spans, named

OPERATION_SPANS = {"dcp.save", "dcp.load", "dcp.async_save"}
#: Spans of an async_save that start before its background save resolves the storage class.
BEFORE_ASYNC_STORAGE = {"dcp.async_save", "dcp._stateful_to_state_dict", "dcp.stage_state_dict",
                        semconv.SPAN_ASYNC_UPLOAD, "dcp.maybe_synchronize_staging"}  # fmt: skip


@pytest.fixture(scope="module")
def shared_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared-ckpt")


@pytest.fixture(scope="module")
def job2(tmp_path_factory: pytest.TempPathFactory, shared_ckpt: Path) -> Job:
    return run_ranks("dcp_rank", 2, tmp_path_factory.mktemp("job2"), ckpt=shared_ckpt,
                     env={semconv.ENV_RUN_ID: "run-a"}, extra_args=["--fail-rank", "1"])  # fmt: skip


@pytest.fixture(scope="module")
def job2_requeued(tmp_path_factory: pytest.TempPathFactory, shared_ckpt: Path, job2: Job) -> Job:
    """job2 again, as a SLURM requeue or a restarted pod runs it: the same run id, restart count and paths."""
    return run_ranks("dcp_rank", 2, tmp_path_factory.mktemp("job2-requeued"), ckpt=shared_ckpt,
                     env={semconv.ENV_RUN_ID: "run-a"}, extra_args=["--fail-rank", "1"])  # fmt: skip


@pytest.fixture(scope="module")
def job4(tmp_path_factory: pytest.TempPathFactory, shared_ckpt: Path, job2: Job) -> Job:
    return run_ranks("dcp_rank", 4, tmp_path_factory.mktemp("job4"), ckpt=shared_ckpt,
                     env={semconv.ENV_TORCHELASTIC_RUN_ID: "run-b"})  # fmt: skip


@pytest.fixture(params=["job2", "job4"])
def job(request: pytest.FixtureRequest) -> Job:
    return request.getfixturevalue(request.param)


def spans_of(job: Job) -> list[SpanRecord]:
    return load_spans(sorted(job.out.glob("spans-*.jsonl")))


def dcp_traces(job: Job) -> dict[str, list[SpanRecord]]:
    return {t: s for t, s in by_trace(spans_of(job)).items() if any(x.name.startswith("dcp.") for x in s)}


def top_level(spans: list[SpanRecord]) -> list[SpanRecord]:
    """Each trace's root and the operation spans directly under it (one per rank)."""
    roots = {s.span_id for s in spans if s.name == semconv.SPAN_CHECKPOINT}
    return [s for s in spans if s.span_id in roots or s.parent_id in roots]


def results(job: Job) -> list[dict]:
    return [json.loads((job.out / f"result-{r}.json").read_text()) for r in range(job.world)]


def test_each_operation_is_one_trace_with_one_root_on_the_coordinator(job: Job) -> None:
    traces = dcp_traces(job)
    assert len(traces) == (5 if job.world == 2 else 4)  # save, save, load, async_save (+ failed save)
    for spans in traces.values():
        (root,) = named(spans, semconv.SPAN_CHECKPOINT)
        assert root.parent_id is None and root.rank == 0
        operations = [s for s in spans if s.parent_id == root.span_id]
        assert sorted(s.rank for s in operations) == list(range(job.world))
        assert {s.name for s in operations} <= OPERATION_SPANS and len({s.name for s in operations}) == 1
        ids = {s.span_id for s in spans}
        assert all(s.parent_id in ids for s in spans if s is not root)  # no orphans


def test_steps_only_the_coordinator_runs_appear_only_on_it(job: Job) -> None:
    spans = spans_of(job)
    for name in ("dcp.global_step", "dcp.finish_checkpoint"):
        assert {s.rank for s in named(spans, name)} == {0}, name
    for name in ("dcp.local_step", "dcp.write_data", "dcp.read_data", "dcp.stage_state_dict"):
        assert {s.rank for s in named(spans, name)} == set(range(job.world)), name


def test_spans_carry_rank_world_size_backend_and_checkpoint(job: Job) -> None:
    for rank in range(job.world):
        for span in load_spans([job.out / f"spans-{rank}.jsonl"]):
            if not span.name.startswith("dcp."):
                continue
            assert span.attributes[semconv.ATTR_RANK] == rank
            assert span.attributes[semconv.ATTR_WORLD_SIZE] == job.world
            assert span.attributes[semconv.ATTR_BACKEND] == "gloo"
            assert span.attributes[semconv.ATTR_CHECKPOINT_ID].startswith(str(job.ckpt))
            if span.name in BEFORE_ASYNC_STORAGE and span.attributes[semconv.ATTR_OPERATION] == "async_save":
                continue  # async_save given only an id: the background save resolves the storage later
            storage_key = semconv.ATTR_STORAGE_READER if span.attributes[semconv.ATTR_OPERATION] == "load" else semconv.ATTR_STORAGE_WRITER
            assert span.attributes[storage_key] in {"FileSystemWriter", "FileSystemReader", "FailingWriter"}, span.name
    for span in top_level(spans_of(job)):
        assert span.attributes[semconv.ATTR_COORDINATOR] is (span.rank == 0)
        assert span.attributes[semconv.ATTR_GROUP_RANK] == span.rank


def test_two_saves_to_the_same_id_are_two_traces_and_link_to_the_caller(job: Job) -> None:
    saves = [s for s in named(spans_of(job), "dcp.save")
             if s.attributes[semconv.ATTR_CHECKPOINT_ID] == str(job.ckpt / "a")]  # fmt: skip
    assert len({s.trace_id for s in saves}) == 2
    for rank, result in enumerate(results(job)):
        first = min((s for s in saves if s.rank == rank), key=lambda s: s.start_ns)
        assert [link["span_id"] for link in first.links] == [result["train_step_span_id"]]


def test_the_async_upload_joins_the_async_save_trace_on_every_rank(job: Job) -> None:
    for spans in dcp_traces(job).values():
        if not named(spans, "dcp.async_save"):
            continue
        by_id = {s.span_id: s for s in spans}
        for rank in range(job.world):
            (upload,) = [s for s in named(spans, semconv.SPAN_ASYNC_UPLOAD) if s.rank == rank]
            (background,) = [s for s in named(spans, "dcp.save") if s.rank == rank]
            assert background.parent_id == upload.span_id
            assert by_id[upload.parent_id].name == "dcp.async_save"
            assert [s.name for s in spans if s.parent_id == background.span_id and s.rank == rank].count("dcp.write_data") == 1


def test_the_checkpoint_still_does_its_job_and_bookkeeping_is_empty(job: Job) -> None:
    for result in results(job):
        assert result["loaded_step"] == 42
        assert result["diagnostics"] == {"open_spans": 0}
        assert result["stack_depth"] == 0 and result["flushed"] is True


def test_a_rank_failing_in_write_data_fails_every_ranks_spans(job2: Job) -> None:
    (spans,) = [s for s in dcp_traces(job2).values() if any(x.status == "ERROR" for x in s)]
    writes = {s.rank: s for s in named(spans, "dcp.write_data")}
    assert writes[1].status == "ERROR"
    assert writes[1].status_description == "OSError: [Errno 28] No space left on device (injected by the test)"
    assert writes[0].status == "UNSET"  # rank 0's own write worked
    for save in named(spans, "dcp.save"):
        assert save.status == "ERROR" and save.attributes[semconv.ATTR_FAILED_RANKS] == [1]
        assert save.status_description.startswith("CheckpointException: ranks [1] failed; rank 1: OSError")
    assert named(spans, semconv.SPAN_CHECKPOINT)[0].status == "ERROR"
    for result in results(job2):  # the caller got exactly what it gets without us
        assert result["instrumented_failure"] == result["uninstrumented_failure"]
        assert result["instrumented_failure"]["type"] == "CheckpointException"
        assert result["instrumented_failure"]["failure_types"] == {"1": "OSError"}


def test_two_runs_saving_the_same_ids_never_share_a_trace(job2: Job, job4: Job) -> None:
    def ids(job: Job) -> set[str]:
        return {s.attributes[semconv.ATTR_CHECKPOINT_ID] for s in spans_of(job) if s.name == "dcp.save"}

    assert ids(job2) & ids(job4)  # the same paths were saved by both runs ...
    assert not set(dcp_traces(job2)) & set(dcp_traces(job4))  # ... in different traces
    assert {s.attributes[semconv.ATTR_RUN_ID] for s in top_level(spans_of(job4))} == {"run-b"}


def test_a_requeued_run_with_the_same_ids_never_reuses_a_trace(job2: Job, job2_requeued: Job) -> None:
    first, again = dcp_traces(job2), dcp_traces(job2_requeued)
    assert not set(first) & set(again)  # before: every trace id and root span id emitted twice
    assert len(again) == len(first)
    for spans in again.values():  # still one trace per checkpoint, with every rank in it
        assert {s.rank for s in spans if s.name in OPERATION_SPANS} == {0, 1}
    # Each rank's part of an operation says which generation ran it; every rank agreed on one.
    parts = [s for s in spans_of(job2_requeued) if semconv.ATTR_RUN_ID in s.attributes]
    generations = {s.attributes.get(semconv.ATTR_GENERATION) for s in parts}
    assert {s.rank for s in parts} == {0, 1} and len(generations) == 1 and None not in generations
