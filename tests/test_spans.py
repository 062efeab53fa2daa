"""Every DCP step becomes a span, named, nested and timed as DCP itself saw it."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import dcp_otel
from dcp_otel import semconv
from tests.spans_io import SpanRecord, named

SAVE_STEPS = {"dcp._stateful_to_state_dict", "dcp.local_step", "dcp.global_step", "dcp.write_data", "dcp.finish_checkpoint"}
LOAD_STEPS = {"dcp.local_step", "dcp.global_step", "dcp.read_data"}


def children(spans: list[SpanRecord], parent: SpanRecord) -> list[SpanRecord]:
    return [s for s in spans if s.parent_id == parent.span_id]


def state() -> dict:
    return {"model": torch.nn.Linear(4, 4), "step": torch.tensor([7])}


def test_save_is_a_root_checkpoint_span_with_one_span_per_step(traced, tmp_path: Path) -> None:
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))

    spans = traced.spans()
    (root,) = named(spans, semconv.SPAN_CHECKPOINT)
    (save,) = named(spans, "dcp.save")
    assert root.parent_id is None
    assert save.parent_id == root.span_id and save.trace_id == root.trace_id
    # One process, no torch.distributed: DCP makes no collective, so there is no dcp.collective.* span.
    assert {s.name for s in children(spans, save)} == SAVE_STEPS
    assert all(s.trace_id == root.trace_id for s in spans)
    assert all(s.end_ns >= s.start_ns for s in spans)


def test_load_spans_nest_under_the_load_operation(traced, tmp_path: Path) -> None:
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
    target = state()
    dcp.load(target, checkpoint_id=str(tmp_path / "c"))

    assert int(target["step"].item()) == 7  # the checkpoint still does its job
    spans = traced.spans()
    (load,) = named(spans, "dcp.load")
    assert {s.name for s in children(spans, load)} == LOAD_STEPS
    (root,) = [s for s in named(spans, semconv.SPAN_CHECKPOINT) if s.trace_id == load.trace_id]
    assert load.parent_id == root.span_id


def test_span_times_are_dcps_own_nanosecond_timestamps(traced, dcp_records, tmp_path: Path) -> None:
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))

    starts = {(r["func_name"]): r["time"] for r in dcp_records if r["event"] == "start"}
    ends = {(r["func_name"]): r["time"] for r in dcp_records if r["event"] == "end"}
    for span in traced.spans():
        if span.name == semconv.SPAN_CHECKPOINT:
            continue
        func = span.name.removeprefix(semconv.SPAN_PREFIX)
        assert span.start_ns == starts[func], span.name
        assert span.end_ns == ends[func], span.name


def test_every_span_carries_rank_world_size_checkpoint_and_classes(traced, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "c")
    dcp.save(state(), storage_writer=dcp.FileSystemWriter(ckpt))
    dcp.load(state(), storage_reader=dcp.FileSystemReader(ckpt), planner=dcp.DefaultLoadPlanner())

    spans = traced.spans()
    for span in spans:
        assert span.attributes[semconv.ATTR_RANK] == 0
        assert span.attributes[semconv.ATTR_WORLD_SIZE] == 1
        assert span.attributes[semconv.ATTR_CHECKPOINT_ID] == ckpt
        assert span.attributes[semconv.ATTR_OPERATION] in {"save", "load"}
    for span in spans:
        if span.attributes[semconv.ATTR_OPERATION] == "save":
            assert span.attributes[semconv.ATTR_STORAGE_WRITER] == "FileSystemWriter", span.name
        else:
            assert span.attributes[semconv.ATTR_STORAGE_READER] == "FileSystemReader", span.name
            assert span.attributes[semconv.ATTR_PLANNER] == "DefaultLoadPlanner", span.name


def test_a_storage_class_dcp_infers_from_the_checkpoint_id_is_on_every_span(traced, tmp_path: Path) -> None:
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))  # no storage_writer given
    dcp.load(state(), checkpoint_id=str(tmp_path / "c"))

    for span in traced.spans():
        if span.attributes[semconv.ATTR_OPERATION] == "save":
            assert span.attributes[semconv.ATTR_STORAGE_WRITER] == "FileSystemWriter", span.name
        else:
            assert span.attributes[semconv.ATTR_STORAGE_READER] == "FileSystemReader", span.name


def test_checkpoint_ids_are_redacted_in_spans(traced, tmp_path: Path) -> None:
    class SignedWriter(dcp.FileSystemWriter):
        @property
        def checkpoint_id(self) -> str:  # what a cloud writer reports
            return "https://user:hunter2@storage.example/ckpt?sig=SECRET&se=2026"

    dcp.save(state(), storage_writer=SignedWriter(str(tmp_path / "c")))

    for span in traced.spans():
        text = repr(span.attributes)
        assert "hunter2" not in text and "SECRET" not in text
        assert span.attributes[semconv.ATTR_CHECKPOINT_ID] == "https://REDACTED@storage.example/ckpt?sig=REDACTED&se=REDACTED"


def test_a_caller_span_is_linked_both_ways(traced, tmp_path: Path) -> None:
    tracer = traced.provider.get_tracer("training")
    with tracer.start_as_current_span("train_step") as step:
        dcp.save(state(), checkpoint_id=str(tmp_path / "c"))

    spans = traced.spans()
    (train,) = named(spans, "train_step")
    (save,) = named(spans, "dcp.save")
    (root,) = named(spans, semconv.SPAN_CHECKPOINT)
    assert save.trace_id != train.trace_id  # a checkpoint is its own trace ...
    for span in (save, root):  # ... linked to the step that asked for it
        assert {"trace_id": train.trace_id, "span_id": train.span_id,
                "attributes": {semconv.ATTR_LINK_KIND: semconv.LINK_CALLER}} in span.links  # fmt: skip
    assert {"trace_id": save.trace_id, "span_id": save.span_id,
            "attributes": {semconv.ATTR_LINK_KIND: semconv.LINK_CHECKPOINT}} in train.links  # fmt: skip
    assert step.get_span_context().span_id == int(train.span_id, 16)


def test_two_saves_to_the_same_checkpoint_id_are_two_traces(traced, tmp_path: Path) -> None:
    for _ in range(2):
        dcp.save(state(), checkpoint_id=str(tmp_path / "c"))

    saves = named(traced.spans(), "dcp.save")
    assert len({s.trace_id for s in saves}) == 2
    assert sorted(s.attributes[semconv.ATTR_OPERATION_SEQ] for s in saves) == [0, 1]


def test_code_run_by_a_step_sees_the_step_as_current_span(traced, tmp_path: Path) -> None:
    plugin_tracer = traced.provider.get_tracer("storage-plugin")
    seen: list[str] = []

    class Probe(dcp.FileSystemWriter):
        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            with plugin_tracer.start_as_current_span("upload"):
                seen.append("upload")
            return super().write_data(plan, planner)

    dcp.save(state(), storage_writer=Probe(str(tmp_path / "c")))

    spans = traced.spans()
    (upload,) = named(spans, "upload")
    (write,) = named(spans, "dcp.write_data")
    assert seen == ["upload"] and upload.parent_id == write.span_id


def test_bookkeeping_is_empty_after_every_operation(traced, tmp_path: Path) -> None:
    recorder = traced.recorder()
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
    assert (recorder.open_count(), recorder.stack_depth()) == (0, 0)
    dcp.load(state(), checkpoint_id=str(tmp_path / "c"))
    assert (recorder.open_count(), recorder.stack_depth()) == (0, 0)


def test_a_built_operation_leaves_nothing_for_the_garbage_collector(traced, tmp_path: Path) -> None:
    # Calls name their operation and it lists them: unless the builder breaks that cycle, every checkpoint's
    # calls (and the storage writer and write results its operation holds) wait for a collection.
    dcp.save(state(), checkpoint_id=str(tmp_path / "warm"))
    dcp_otel.flush(timeout_s=30)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable is kept in gc.garbage, to be read
    try:
        dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
        dcp.load(state(), checkpoint_id=str(tmp_path / "c"))
        assert dcp_otel.flush(timeout_s=30)
        gc.collect()
        left = [type(o) for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    ours = {t.__qualname__ for t in left if t.__module__.startswith(("dcp_otel", "opentelemetry"))}
    theirs = {t.__qualname__ for t in left if t.__name__ in ("FileSystemWriter", "FileSystemReader", "WriteResult")}
    assert (ours, theirs) == (set(), set())
