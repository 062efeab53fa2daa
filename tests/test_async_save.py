"""async_save: the background save joins the trace; staging and upload are their own spans."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import dcp_otel
from dcp_otel import semconv
from tests.spans_io import SpanRecord, from_readable, named


def assert_bookkeeping_empty() -> None:
    instrumentor = dcp_otel.DCPInstrumentor()
    assert instrumentor.recorder.open_count() == 0
    assert instrumentor.installed.carrier.pending_count() == 0  # every hand-over was used


def ancestors(spans: list[SpanRecord], span: SpanRecord) -> list[str]:
    by_id = {s.span_id: s for s in spans}
    names = []
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        names.append(span.name)
    return names


def test_background_save_and_its_steps_join_the_async_save_trace(traced, tmp_path: Path) -> None:
    future = dcp.async_save({"w": torch.ones(8)}, checkpoint_id=str(tmp_path / "c"))
    future.result()
    assert traced.recorder().wait_for_uploads(timeout=30)

    spans = traced.spans()
    (root,) = named(spans, semconv.SPAN_CHECKPOINT)
    assert {s.trace_id for s in spans} == {root.trace_id}
    (upload,) = named(spans, semconv.SPAN_ASYNC_UPLOAD)
    (background,) = named(spans, "dcp.save")
    assert ancestors(spans, background) == [semconv.SPAN_ASYNC_UPLOAD, "dcp.async_save", semconv.SPAN_CHECKPOINT]
    (write,) = named(spans, "dcp.write_data")
    assert ancestors(spans, write)[0] == "dcp.save"
    # Staging and upload can be read directly, and the root covers the upload.
    (staging,) = named(spans, "dcp.stage_state_dict")
    (call,) = named(spans, "dcp.async_save")
    assert staging.parent_id == call.span_id and upload.parent_id == call.span_id
    assert upload.end_ns >= background.end_ns
    assert root.end_ns >= upload.end_ns
    assert all(s.attributes[semconv.ATTR_OPERATION] == "async_save" for s in spans)
    assert_bookkeeping_empty()
    # The operation's metrics describe the durable checkpoint: they end with the upload.
    labels = {"operation": "async_save", "rank": "0"}
    assert traced.registry.get_sample_value("dcp_operations_total", {**labels, "status": "success"}) == 1
    last_success = traced.registry.get_sample_value("dcp_last_success_timestamp_seconds", labels)
    assert abs(last_success - upload.end_ns / 1e9) < 0.01  # set when the upload ended
    assert last_success >= background.end_ns / 1e9
    duration = traced.registry.get_sample_value(
        "dcp_operation_duration_seconds_sum", {**labels, "status": "success"}
    )
    assert duration >= (upload.end_ns - call.start_ns) / 1e9 - 0.01


def test_a_failed_upload_marks_the_upload_and_root_as_errors(traced, tmp_path: Path) -> None:
    class FullDisk(dcp.FileSystemWriter):
        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            raise OSError(28, "No space left on device")

    future = dcp.async_save({"w": torch.ones(8)}, storage_writer=FullDisk(str(tmp_path / "c")))
    error = future.exception()
    assert traced.recorder().wait_for_uploads(timeout=30)

    assert error is not None
    spans = traced.spans()
    (upload,) = named(spans, semconv.SPAN_ASYNC_UPLOAD)
    (root,) = named(spans, semconv.SPAN_CHECKPOINT)
    (call,) = named(spans, "dcp.async_save")
    assert upload.status == "ERROR" and root.status == "ERROR"
    assert call.status == "UNSET"  # handing off worked; the upload did not
    assert_bookkeeping_empty()
    # An async save whose upload failed is a failed save: it counts as one, and is no success.
    labels = {"operation": "async_save", "rank": "0"}
    assert traced.registry.get_sample_value("dcp_operations_total", {**labels, "status": "failure"}) == 1
    assert traced.registry.get_sample_value("dcp_operations_total", {**labels, "status": "success"}) == 0
    assert traced.registry.get_sample_value("dcp_last_success_timestamp_seconds", labels) is None
    assert traced.registry.get_sample_value("dcp_async_saves_in_flight", {"rank": "0"}) == 0


def test_an_asynchronous_stager_gets_its_own_staging_span(traced, tmp_path: Path) -> None:
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False))
    try:
        response = dcp.async_save({"w": torch.ones(8)}, checkpoint_id=str(tmp_path / "c"), async_stager=stager)
        response.staging_completion.result()
        response.upload_completion.result()
    finally:
        stager.close()
    assert traced.recorder().wait_for_uploads(timeout=30)

    spans = traced.spans()
    (staging,) = named(spans, semconv.SPAN_ASYNC_STAGING)
    (upload,) = named(spans, semconv.SPAN_ASYNC_UPLOAD)
    (background,) = named(spans, "dcp.save")
    assert staging.status == "UNSET" and staging.trace_id == upload.trace_id
    assert staging.end_ns <= background.end_ns  # the upload waited for staging
    assert_bookkeeping_empty()


def test_flush_waits_for_the_upload_and_flushes_the_instrumented_provider(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # not the global provider
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=3_600_000))
    dcp_otel.instrument(tracer_provider=provider)
    try:
        dcp.async_save({"w": torch.ones(8)}, checkpoint_id=str(tmp_path / "c")).result()
        assert dcp_otel.flush(timeout_s=30) is True
        names = {s.name for s in exporter.get_finished_spans()}  # exported only if flushed
    finally:
        dcp_otel.uninstrument()
        provider.shutdown()
    assert {semconv.SPAN_ASYNC_UPLOAD, semconv.SPAN_CHECKPOINT, "dcp.write_data"} <= names


def test_a_failing_metrics_backend_never_breaks_async_save(traced, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from dcp_otel.metrics.prometheus import CheckpointMetrics

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("metrics backend broken")

    for name in ("async_handed_off", "async_upload_done", "step_done", "operation_done", "bytes_written"):
        monkeypatch.setattr(CheckpointMetrics, name, broken)
    future = dcp.async_save({"w": torch.ones(8)}, checkpoint_id=str(tmp_path / "c"))
    assert future.result() is not None  # torch's own Metadata, as without dcp-otel
    assert traced.recorder().wait_for_uploads(timeout=30)
    assert dcp_otel.diagnostics()["metrics_error"] >= 1
    assert {semconv.SPAN_ASYNC_UPLOAD, "dcp.write_data"} <= {s.name for s in traced.spans()}  # spans unaffected


def test_uninstrument_during_an_upload_never_turns_the_successful_save_into_a_failure(tmp_path: Path) -> None:
    """torch's records stop reaching dcp-otel at uninstrument(); the background save and its write, still
    running then, end with their end unknown, not as errors, and the checkpoint counts as the success it is."""
    import threading

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    entered, release = threading.Event(), threading.Event()

    class Held(dcp.FileSystemWriter):
        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            entered.set()
            release.wait(timeout=60)
            return super().write_data(plan, planner)

    recorder = dcp_otel.instrument(tracer_provider=provider).recorder
    assert recorder is not None
    try:
        future = dcp.async_save({"w": torch.ones(8)}, storage_writer=Held(str(tmp_path / "c")))
        assert entered.wait(60)
    finally:
        dcp_otel.uninstrument()  # the upload is still writing
    release.set()
    future.result(timeout=60)
    assert recorder.wait_for_uploads(timeout=30)  # (its spans are still built, after uninstrument too)
    provider.shutdown()
    spans = {s.name: s for s in from_readable(exporter.get_finished_spans())}
    assert not [s.name for s in spans.values() if s.status == "ERROR"]
    for name in ("dcp.save", "dcp.write_data"):  # (the background save and its write)
        assert spans[name].attributes[semconv.ATTR_END_UNKNOWN] is True
        assert spans[name].status == "UNSET"
    assert spans[semconv.SPAN_ASYNC_UPLOAD].status != "ERROR" and semconv.SPAN_CHECKPOINT in spans


def test_the_staging_spans_say_what_was_staged_from_where_into_what_memory_and_how_fast(traced, tmp_path: Path) -> None:
    """Bytes, device, pinned/shared and rate of the copy an async save makes before it returns (CPU tensors here;
    scripts/gpu-check.sh shows the same from cuda:0)."""
    state = {"a": torch.ones(1000), "nested": {"b": torch.zeros(10, 10, dtype=torch.float64)}, "step": 3}
    expected = 1000 * 4 + 100 * 8
    dcp.async_save(state, checkpoint_id=str(tmp_path / "default")).result()  # torch's default: staged in the call
    stager = DefaultStager(StagingOptions(False, False, True, False))  # staged by a future, on the stager's thread
    response = dcp.async_save(state, checkpoint_id=str(tmp_path / "future"), async_stager=stager)
    response.upload_completion.result()
    stager.close()
    assert dcp_otel.flush()
    spans = traced.spans()
    steps = named(spans, "dcp.stage_state_dict")
    (future,) = named(spans, semconv.SPAN_ASYNC_STAGING)
    assert len(steps) == 2
    for span in (*steps, future):
        assert span.attributes[semconv.ATTR_STAGING_BYTES] == expected
        assert span.attributes[semconv.ATTR_STAGING_DEVICE] == "cpu"
        assert span.attributes[semconv.ATTR_STAGING_PINNED] is False and span.attributes[semconv.ATTR_STAGING_SHARED] is False
    # The rate is over the span that covers the copy: the step where it staged, the future where one did.
    (in_call,) = [s for s in steps if s.trace_id != future.trace_id]
    (submitting,) = [s for s in steps if s.trace_id == future.trace_id]
    for span in (in_call, future):
        rate = span.attributes[semconv.ATTR_STAGING_RATE]
        assert rate == expected / ((span.end_ns - span.start_ns) / 1e9)
    assert semconv.ATTR_STAGING_RATE not in submitting.attributes
    assert traced.registry.get_sample_value(f"{semconv.METRIC_STAGED_BYTES}_total", {"device": "cpu", "rank": "0"}) == 2 * expected


def test_what_a_stager_copies_is_read_from_sizes_and_devices_only() -> None:
    from dcp_otel.tracing.staged import device_type, staged

    class Blocking:
        cache_staged_state_dict = True

    facts = staged(Blocking(), {"x": [torch.ones(3, dtype=torch.bfloat16), (torch.ones(2, dtype=torch.int64),)], "y": None})
    assert facts == (3 * 2 + 2 * 8, "cpu", True, False)
    assert staged(DefaultStager(StagingOptions(False, True, False, False)), {}) == (0, "", False, True)
    assert device_type("cpu,cuda:0") == "cpu" and device_type("cuda:3") == "cuda"


def test_a_model_state_dict_is_read_whole_with_no_python_instruction_per_tensor() -> None:
    """A dict of plain tensors (a model's state dict) is summed in C; any other value in it takes the walk."""
    import sys

    from dcp_otel.tracing.staged import staged

    model = {f"layer{i}.weight": torch.ones(i + 1, dtype=torch.float16 if i % 2 else torch.float32) for i in range(500)}
    expected = sum(t.nbytes for t in model.values())
    meta = {"w": torch.empty(3, device="meta")}
    assert staged(object(), {"model": model, "optim": {"step": torch.ones(1), "lr": 0.1}, "meta": meta}) == (
        expected + 4 + 12, "cpu,meta", False, False)
    mixed = {**model, "p": torch.nn.Parameter(torch.ones(2)), "n": None}  # (a Parameter: a tensor of its own class)
    assert staged(object(), mixed).nbytes == expected + 8

    def instructions(state: dict) -> int:  # type: ignore[type-arg]
        count = [0]

        def tracing(frame, event, arg):  # type: ignore[no-untyped-def]
            frame.f_trace_opcodes = True
            count[0] += event == "opcode"
            return tracing

        sys.settrace(tracing)
        try:
            staged(object(), state)
        finally:
            sys.settrace(None)
        return count[0]

    # The same instructions for 10 tensors as for 500 (the walk took 27 a tensor).
    assert instructions({"model": model}) == instructions({"model": dict(list(model.items())[:10])})
