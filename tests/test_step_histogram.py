"""Every training step reaches ``dcp_training_step_seconds``, between checkpoints too, and never too early.

The builder folds the steps the optimizer hook saw into the histogram as it builds each checkpoint, and also
between checkpoints: every few seconds while steps are seen and no checkpoint comes, and when a flush asks
(``dcp_otel.flush()``, the exit's). A step is folded only once nothing still open can overlap it: an upload in
flight holds back the steps after its start until its checkpoint is built, and then they count as overlapping.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry

import dcp_otel
from dcp_otel import semconv
from dcp_otel.tracing import builder as building
from tests.conftest import Traced
from tests.test_builder import STATE, HeldWriter


def steps_counted(registry: CollectorRegistry, overlaps: str) -> float:
    """The number of training steps in the histogram with ``overlaps``, as a scrape reads it."""
    return sum(sample.value for family in registry.collect() if family.name == semconv.METRIC_TRAINING_STEP
               for sample in family.samples
               if sample.name.endswith("_count") and sample.labels.get(semconv.LABEL_OVERLAPS) == overlaps)  # fmt: skip


class Loop:
    """A training loop's steps: a model, an optimizer, ``step(n)``."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(4, 4)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def step(self, n: int) -> None:
        for _ in range(n):
            self.model(torch.ones(4)).sum().backward()
            self.optimizer.step()


def after_a_checkpoint(tmp_path: Path, steps: int) -> Loop:
    """A loop that stepped ``steps`` times and then saved, that checkpoint built (the builder knows the rank)."""
    loop = Loop()
    loop.step(steps)
    dcp.save(STATE, checkpoint_id=str(tmp_path / "a"))
    assert dcp_otel.flush(timeout_s=30)
    return loop


def test_a_flush_puts_the_steps_since_the_last_checkpoint_in_the_histogram(traced: Traced, tmp_path: Path) -> None:
    loop = after_a_checkpoint(tmp_path, 3)
    before = steps_counted(traced.registry, semconv.OVERLAPS_NONE)
    assert before == 2  # the steps between the first three ends
    loop.step(5)  # no checkpoint after these
    assert dcp_otel.flush(timeout_s=30)
    assert steps_counted(traced.registry, semconv.OVERLAPS_NONE) == before + 5
    assert steps_counted(traced.registry, semconv.OVERLAPS_CHECKPOINT) == 0


def test_between_checkpoints_the_builder_folds_the_steps_unasked(traced: Traced, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A scrape between two checkpoints an hour apart sees the steps since the first (and the ring of 4,096
    step ends no longer loses the rest of an hour's): the builder wakes every FOLD_EVERY_S to fold them."""
    monkeypatch.setattr(building, "FOLD_EVERY_S", 0.05)
    monkeypatch.setattr(building, "FOLD_IDLE_S", 0.05)  # (the loop below may pause between two of its looks)
    builder = traced.recorder().builder
    loop = after_a_checkpoint(tmp_path, 3)  # (the builder's next wait is the patched one)
    before = steps_counted(traced.registry, semconv.OVERLAPS_NONE)
    with builder._lock:
        folds = builder.folds
    loop.step(4)
    with builder._cond:  # two folds more: the second began after the last step ended
        assert builder._cond.wait_for(lambda: builder.folds >= folds + 2, timeout=30)
    assert steps_counted(traced.registry, semconv.OVERLAPS_NONE) == before + 4


def test_steps_beside_an_upload_in_flight_wait_for_its_checkpoint_and_count_as_overlapping_it(
        traced: Traced, tmp_path: Path) -> None:  # fmt: skip
    builder = traced.recorder().builder
    loop = after_a_checkpoint(tmp_path, 2)
    loop.step(4)  # 4 steps between the checkpoints
    upload = HeldWriter(str(tmp_path / "async"))
    try:
        future = dcp.async_save(STATE, storage_writer=upload)
        assert upload.inside.wait(30)
        loop.step(3)  # beside the upload
        # (dcp_otel.flush() would wait for the upload: the builder's own drain is what a flush asks of it)
        assert builder.drain(30)  # folds the steps before the async save, none of those beside it
        assert steps_counted(traced.registry, semconv.OVERLAPS_NONE) == 1 + 4
        assert steps_counted(traced.registry, semconv.OVERLAPS_CHECKPOINT) == 0
        upload.release.set()
        future.result(timeout=30)
        loop.step(1)  # the step the upload ended in
        assert dcp_otel.flush(timeout_s=30)
        assert steps_counted(traced.registry, semconv.OVERLAPS_CHECKPOINT) == 3 + 1  # each one beside the upload
        assert steps_counted(traced.registry, semconv.OVERLAPS_NONE) == 1 + 4  # none of them as "none"
    finally:
        HeldWriter.release_all()


def test_a_drain_of_the_metrics_only_never_waits_for_a_span_exporter(tmp_path: Path) -> None:
    """The async save process answers its rank once its metrics are recorded, and a metrics collection reads
    them, through ``drain(metrics_only=True)``: no fold of the steps is asked there, which would come only after
    the build under way, and that build waits here for an exporter that does not answer."""
    exporting, release = threading.Event(), threading.Event()

    class Stuck(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            exporting.set()
            release.wait(60)
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Stuck()))
    dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
    builder = dcp_otel.DCPInstrumentor().recorder.builder
    loop = Loop()
    try:
        release.set()
        loop.step(3)
        dcp.save(STATE, checkpoint_id=str(tmp_path / "a"))
        assert dcp_otel.flush(timeout_s=30)
        release.clear()
        exporting.clear()
        dcp.save(STATE, checkpoint_id=str(tmp_path / "b"))  # its build waits in the exporter
        assert exporting.wait(30)
        loop.step(3)  # steps no build has folded
        assert builder.drain(10, metrics_only=True)  # its metrics are recorded: it answers, exporter or not
    finally:
        release.set()
        dcp_otel.uninstrument()


def test_steps_beside_an_upload_that_ended_but_is_not_handed_on_yet_are_not_folded(traced: Traced, tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Between an upload's end and its hand-on to the builder (a few instructions on the thread its future
    completes on, or a switch of the interpreter), no call of it is open and its window is not known yet: a fold
    then waits, else every step beside the upload would count as overlapping nothing."""
    from dcp_otel.tracing.records import Operation

    in_gap, leave_gap = threading.Event(), threading.Event()
    part_done = Operation.part_done

    def held(op, end_ns, error, part=None):  # type: ignore[no-untyped-def]
        if op.name == "async_save" and part is None and op.pending == 1:  # (its last part, ended by a future)
            in_gap.set()
            assert leave_gap.wait(60)
        return part_done(op, end_ns, error, part)

    builder = traced.recorder().builder
    loop = after_a_checkpoint(tmp_path, 2)
    monkeypatch.setattr(Operation, "part_done", held)
    upload = HeldWriter(str(tmp_path / "async"))
    try:
        future = dcp.async_save(STATE, storage_writer=upload)
        assert upload.inside.wait(30)
        loop.step(3)  # beside the upload
        upload.release.set()
        assert in_gap.wait(30)  # the upload ended; its operation is not queued yet
        assert builder.drain(30)  # a fold now
        assert steps_counted(traced.registry, semconv.OVERLAPS_NONE) == 1
        leave_gap.set()
        future.result(timeout=30)
        loop.step(1)
        assert dcp_otel.flush(timeout_s=30)
        assert steps_counted(traced.registry, semconv.OVERLAPS_CHECKPOINT) == 3 + 1
        assert steps_counted(traced.registry, semconv.OVERLAPS_NONE) == 1
    finally:
        leave_gap.set()
        HeldWriter.release_all()


def test_a_checkpoint_built_while_another_still_uploads_leaves_the_steps_beside_that_upload_for_its_build(
        traced: Traced, tmp_path: Path) -> None:  # fmt: skip
    builder = traced.recorder().builder
    loop = after_a_checkpoint(tmp_path, 2)
    upload = HeldWriter(str(tmp_path / "async"))
    try:
        future = dcp.async_save(STATE, storage_writer=upload)
        assert upload.inside.wait(30)
        loop.step(2)  # beside the upload
        dcp.save(STATE, checkpoint_id=str(tmp_path / "b"))  # built while the upload goes on
        loop.step(1)
        assert builder.drain(30)
        assert steps_counted(traced.registry, semconv.OVERLAPS_NONE) == 1  # the step before the async save only
        upload.release.set()
        future.result(timeout=30)
        loop.step(1)  # the step the upload ended in
        assert dcp_otel.flush(timeout_s=30)
        assert steps_counted(traced.registry, semconv.OVERLAPS_CHECKPOINT) == 2 + 1 + 1
        assert steps_counted(traced.registry, semconv.OVERLAPS_NONE) == 1
    finally:
        HeldWriter.release_all()
