"""Prometheus metrics for every checkpoint, from the same events as the spans."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families

import dcp_otel
from dcp_otel import _selftelemetry, semconv
from tests.spans_io import named

SAVE = {"operation": "save", "rank": "0"}


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def state() -> dict:
    return {"w": torch.ones(1000), "model": torch.nn.Linear(10, 10)}


def data_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.distcp"))


def test_a_save_and_a_load_are_counted_timed_and_sized(traced, tmp_path: Path) -> None:
    before = time.time()
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
    after = time.time()
    dcp.load(state(), checkpoint_id=str(tmp_path / "c"))

    r = traced.registry
    assert sample(r, "dcp_operations_total", status="success", **SAVE) == 1
    assert sample(r, "dcp_operations_total", operation="load", status="success", rank="0") == 1
    assert sample(r, "dcp_operation_duration_seconds_count", status="success", **SAVE) == 1
    for step in ("_stateful_to_state_dict", "local_step", "global_step", "write_data", "finish_checkpoint"):
        assert sample(r, "dcp_step_duration_seconds_count", step=step, **SAVE) == 1, step
    # Bytes come from DCP's own write results and read plans: exactly the data file.
    size = data_bytes(tmp_path / "c")
    assert sample(r, "dcp_written_bytes_total", rank="0") == size
    assert sample(r, "dcp_read_bytes_total", rank="0") == size
    assert before <= sample(r, "dcp_last_success_timestamp_seconds", **SAVE) <= after
    spans = traced.spans()
    assert named(spans, "dcp.save")[0].attributes[semconv.ATTR_WRITTEN_BYTES] == size
    assert named(spans, "dcp.load")[0].attributes[semconv.ATTR_READ_BYTES] == size
    assert semconv.ATTR_READ_BYTES not in named(spans, "dcp.save")[0].attributes


def test_a_save_plan_is_never_counted_as_a_read(traced, tmp_path: Path) -> None:
    class WriterWithStorageData(dcp.FileSystemWriter):
        storage_data: dict = {}  # what a reader has; a save's local plan must still not count as a read

    dcp.save(state(), storage_writer=WriterWithStorageData(str(tmp_path / "c")))
    (save,) = named(traced.spans(), "dcp.save")
    assert semconv.ATTR_READ_BYTES not in save.attributes
    assert sample(traced.registry, "dcp_read_bytes_total", rank="0") is None


def test_durations_match_the_spans_and_wait_is_the_uncovered_part(traced, tmp_path: Path) -> None:
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))

    spans = traced.spans()
    (save,) = named(spans, "dcp.save")
    steps = [s for s in spans if s.parent_id == save.span_id]
    total = sample(traced.registry, "dcp_operation_duration_seconds_sum", status="success", **SAVE)
    assert total == pytest.approx((save.end_ns - save.start_ns) / 1e9, abs=1e-9)
    wait = sample(traced.registry, "dcp_collective_wait_seconds_sum", **SAVE)
    expected_wait = (save.end_ns - save.start_ns - sum(s.end_ns - s.start_ns for s in steps)) / 1e9
    assert wait == pytest.approx(expected_wait, abs=1e-9)
    assert 0 <= wait <= total


def test_a_failed_save_counts_as_failure_and_is_not_a_success(traced, tmp_path: Path) -> None:
    class FullDisk(dcp.FileSystemWriter):
        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            raise OSError(28, "No space left on device")

    with pytest.raises(BaseException):  # noqa: B017 - torch's CheckpointException is a BaseException
        dcp.save(state(), storage_writer=FullDisk(str(tmp_path / "c")))

    r = traced.registry
    assert sample(r, "dcp_operations_total", status="failure", **SAVE) == 1
    assert sample(r, "dcp_operations_total", status="success", **SAVE) == 0
    assert sample(r, "dcp_operation_duration_seconds_count", status="failure", **SAVE) == 1
    assert sample(r, "dcp_last_success_timestamp_seconds", **SAVE) is None
    assert sample(r, "dcp_written_bytes_total", rank="0") is None


class RecordingWriter(dcp.FileSystemWriter):
    """A file-system writer that keeps weak references to the write results it hands DCP."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.results: list[weakref.ref] = []

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        future = super().write_data(plan, planner)
        self.results += [weakref.ref(result) for result in future.wait()]
        return future


def test_torchs_write_results_are_freed_when_torch_drops_them_and_only_their_total_is_kept(tmp_path: Path) -> None:
    """Summed as they are gathered, while in cache: holding 10,000 of them for the builder made it sum and
    free them cold, 20-25 ms of the interpreter lock per checkpoint (benchmarks/own_share.py)."""
    many = {f"t{i}": torch.ones(4) for i in range(200)}
    plain = RecordingWriter(str(tmp_path / "plain"))
    dcp.save(many, storage_writer=plain)
    assert len(plain.results) == 200 and all(ref() is None for ref in plain.results)  # torch frees them itself

    exporting, release = threading.Event(), threading.Event()

    class HeldExporter(SpanExporter):  # holds the builder inside the save's first span's export
        def export(self, spans):  # type: ignore[no-untyped-def]
            exporting.set()
            release.wait(60)
            return SpanExportResult.SUCCESS

    provider, registry = TracerProvider(), CollectorRegistry()
    provider.add_span_processor(SimpleSpanProcessor(HeldExporter()))
    dcp_otel.instrument(tracer_provider=provider, registry=registry)
    try:
        traced = RecordingWriter(str(tmp_path / "traced"))
        dcp.save(many, storage_writer=traced)
        assert exporting.wait(60)  # the builder is busy with this save's spans
        assert len(traced.results) == 200 and all(ref() is None for ref in traced.results)  # as plain
        assert sample(registry, "dcp_written_bytes_total", rank="0") == data_bytes(tmp_path / "traced")
    finally:
        release.set()
        dcp_otel.uninstrument()
        provider.shutdown()


def test_write_results_are_summed_as_before_though_only_their_total_is_kept() -> None:
    """A writer's sizes may be numpy integers or floats (from ``np.prod``): counted; a list with anything but
    DCP's write results in it counts nothing, as before."""
    import numpy as np
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    from dcp_otel.tracing.measure import written_bytes

    def result(size: object) -> WriteResult:
        return WriteResult(index=MetadataIndex("w"), size_in_bytes=size, storage_data=None)  # type: ignore[arg-type]

    assert written_bytes([result(3), result(4)]) == 7
    assert written_bytes([result(np.int64(3)), result(4.0)]) == 7
    assert written_bytes([result(3), types.SimpleNamespace(size_in_bytes=10**9)]) is None
    assert written_bytes([result("3")]) is None and written_bytes([]) is None and written_bytes((result(3),)) is None


def test_the_failure_counter_exists_at_zero_from_the_first_success_on(traced, tmp_path: Path) -> None:
    # Prometheus's increase() cannot see a counter that is born at 1: the first failure
    # after successes must be an increase of an existing series.
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
    r = traced.registry
    assert sample(r, "dcp_operations_total", status="success", **SAVE) == 1
    assert sample(r, "dcp_operations_total", status="failure", **SAVE) == 0


def test_async_save_phases_and_in_flight_gauge(traced, tmp_path: Path) -> None:
    future = dcp.async_save(state(), checkpoint_id=str(tmp_path / "c"))
    future.result()
    assert dcp_otel.flush(timeout_s=30)

    r = traced.registry
    assert sample(r, "dcp_async_saves_in_flight", rank="0") == 0
    assert sample(r, "dcp_async_phase_duration_seconds_count", phase="staging", rank="0") == 1
    assert sample(r, "dcp_async_phase_duration_seconds_count", phase="upload", rank="0") == 1
    assert sample(r, "dcp_operations_total", operation="async_save", status="success", rank="0") == 1
    assert sample(r, "dcp_written_bytes_total", rank="0") == data_bytes(tmp_path / "c")


def test_blocked_seconds_count_the_training_threads_own_calls_and_not_an_async_saves_upload(traced, tmp_path: Path) -> None:
    gate = threading.Event()

    class SlowUpload(dcp.FileSystemWriter):
        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            gate.wait(30)  # the upload waits until the training thread has gone on
            return super().write_data(plan, planner)

    start = time.perf_counter()
    dcp.save(state(), checkpoint_id=str(tmp_path / "s"))
    saved = time.perf_counter() - start
    future = dcp.async_save(state(), storage_writer=SlowUpload(str(tmp_path / "a")))
    returned = time.perf_counter()
    dcp.save(state(), checkpoint_id=str(tmp_path / "meanwhile"))  # training goes on while the upload waits
    between = time.perf_counter() - returned
    gate.set()
    future.result()
    dcp.load(state(), checkpoint_id=str(tmp_path / "s"))
    assert dcp_otel.flush(timeout_s=30)

    r = traced.registry
    blocked = {op: sample(r, "dcp_training_blocked_seconds_total", operation=op, rank="0")
               for op in ("save", "async_save", "load")}  # fmt: skip
    assert all(value is not None and value > 0 for value in blocked.values()), blocked
    assert blocked["save"] <= saved + between  # the two saves' own calls, each measured inside it
    # The async save's blocked time ended when it returned; its operation went on, until the upload, at least as
    # long as the training thread worked after it returned.
    duration = sample(r, "dcp_operation_duration_seconds_sum", operation="async_save", status="success", rank="0")
    assert duration is not None and duration - blocked["async_save"] >= between


def test_histogram_exemplars_carry_the_spans_trace_and_span_ids_in_openmetrics(traced, tmp_path: Path) -> None:
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))

    (save,) = named(traced.spans(), "dcp.save")
    exposition = generate_openmetrics(traced.registry).decode()
    exemplars = [
        (s.name, s.labels, s.exemplar)
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
        if s.exemplar is not None
    ]
    names = {name for name, _, _ in exemplars}
    assert {"dcp_operation_duration_seconds_bucket", "dcp_step_duration_seconds_bucket",
            "dcp_collective_wait_seconds_bucket"} <= names  # fmt: skip
    for _, _, exemplar in exemplars:
        assert re.fullmatch(r"[0-9a-f]{32}", exemplar.labels["trace_id"])
        assert exemplar.labels == {"trace_id": save.trace_id, "span_id": save.span_id, "rank": "0"}
    assert "# {" not in generate_latest(traced.registry).decode()  # the classic format carries none


@pytest.mark.parametrize("sdk", ["none", "sampled_out"])
def test_metrics_without_recorded_spans_have_no_exemplars(tmp_path: Path, sdk: str) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    registry = CollectorRegistry()
    provider = TracerProvider(sampler=ALWAYS_OFF) if sdk == "sampled_out" else None
    dcp_otel.instrument(registry=registry, tracer_provider=provider)  # "none": no SDK, spans are no-ops
    try:
        dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
        assert sample(registry, "dcp_operations_total", status="success", **SAVE) == 1
        exposition = generate_openmetrics(registry).decode()
    finally:
        dcp_otel.uninstrument()
    assert "dcp_step_duration_seconds_bucket" in exposition
    assert "trace_id" not in exposition  # no exemplar points at a trace that was not recorded


def test_uninstrument_removes_the_metrics_and_reinstrumenting_works(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    dcp_otel.instrument(registry=registry)
    dcp_otel.uninstrument()
    assert "dcp_operations" not in generate_latest(registry).decode()
    dcp_otel.instrument(registry=registry)  # would raise "Duplicated timeseries" if left behind
    dcp_otel.uninstrument()


def test_a_registry_that_already_has_our_metrics_is_a_configuration_error() -> None:
    from dcp_otel.metrics.prometheus import CheckpointMetrics

    registry = CollectorRegistry()
    first = CheckpointMetrics(registry)
    try:
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            dcp_otel.instrument(registry=registry)
        assert dcp_otel.DCPInstrumentor().recorder is None
    finally:
        first.unregister()
    with pytest.raises(ValueError, match="CollectorRegistry"):
        dcp_otel.instrument(registry="global")


def test_label_values_never_take_free_text() -> None:
    from dcp_otel.metrics.prometheus import bounded_name

    assert bounded_name("write_data") == "write_data"
    assert bounded_name("_stateful_to_state_dict") == "_stateful_to_state_dict"
    for bad in ("_stateful_to_state_dict.model", "Save", "x" * 80, "a b", "日本"):
        assert bounded_name(bad) == "other"


def test_promtool_accepts_the_exposition_of_a_real_save_and_load(traced, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing in CI: scripts/setup.sh --prometheus installs it")
        pytest.skip("promtool not installed (scripts/test.sh installs it)")
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
    dcp.load(state(), checkpoint_id=str(tmp_path / "c"))
    dcp.async_save(state(), checkpoint_id=str(tmp_path / "a")).result()
    dcp_otel.flush(timeout_s=30)

    exposition = generate_latest(traced.registry)
    assert b"dcp_step_duration_seconds_bucket" in exposition
    lint = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()


def test_telemetry_problems_are_exported_with_their_reason_and_this_process_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.checkpoint.logger as dcp_log

    monkeypatch.setenv("RANK", "3")
    registry = CollectorRegistry()
    dcp_otel.instrument(registry=registry)
    try:
        assert sample(registry, "dcp_otel_telemetry_problems_total", reason="malformed_event", rank="3") is None
        for _ in range(2):
            dcp_log._dcp_logger.debug({"event": "start"})  # no uuid: dropped, counted
        assert sample(registry, "dcp_otel_telemetry_problems_total", reason="malformed_event", rank="3") == 2
    finally:
        dcp_otel.uninstrument()
    assert _selftelemetry._listeners == []  # uninstrumented metrics stop listening: nothing accumulates
    # Reinstrumented, counting starts over in the new registry.
    fresh = CollectorRegistry()
    dcp_otel.instrument(registry=fresh)
    try:
        dcp_log._dcp_logger.debug({"event": "start"})
        assert sample(fresh, "dcp_otel_telemetry_problems_total", reason="malformed_event", rank="3") == 1
    finally:
        dcp_otel.uninstrument()
