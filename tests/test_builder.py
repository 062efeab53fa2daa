"""The hot path only records; one background thread builds spans and metrics, bounded, never blocking.

Specifications of the split between the caller's thread and the builder:
spans reach the provider from the builder thread only, with the ids chosen on
the hot path; a full build queue drops and counts, the save is unaffected;
every way of reading telemetry sees every finished operation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest

import dcp_otel
from dcp_otel import _selftelemetry
from tests.exporters import GatedExporter

STATE = {"w": torch.ones(8)}


class ThreadsSeen(SpanProcessor):
    """Which threads the SDK starts spans on."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def on_start(self, span, parent_context=None) -> None:  # type: ignore[no-untyped-def]
        self.threads.append(threading.current_thread().name)


def test_no_sdk_span_is_started_on_the_training_thread(tmp_path: Path) -> None:
    seen, exporter = ThreadsSeen(), InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(seen)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
    try:
        inside: list[trace.Span] = []

        class Writer(dcp.FileSystemWriter):
            def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
                inside.append(trace.get_current_span())
                return super().write_data(plan, planner)

        dcp.save(STATE, storage_writer=Writer(str(tmp_path / "c")))
        assert dcp_otel.flush(timeout_s=30)
    finally:
        dcp_otel.uninstrument()
    assert seen.threads and set(seen.threads) == {"dcp-otel-builder"}
    # While write_data ran, a light span carried the id the exported write_data span has.
    (current,) = inside
    assert not current.is_recording()
    (write,) = [s for s in exporter.get_finished_spans() if s.name == "dcp.write_data"]
    assert current.get_span_context().span_id == write.context.span_id
    assert current.get_span_context().trace_id == write.context.trace_id


class LookupThreads(dict):  # type: ignore[type-arg]
    """A reader's ``storage_data`` that notes which threads look its entries up by ``get``."""

    threads: set[str]

    def get(self, key, default=None):  # type: ignore[no-untyped-def]
        self.threads.add(threading.current_thread().name)
        return super().get(key, default)


def test_the_bytes_a_load_will_read_are_counted_off_the_training_thread(tmp_path: Path) -> None:
    """Summing a plan's read items took 52 ms per 100k items on the caller's thread, just before a collective."""
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(2000)}
    dcp.save(state, checkpoint_id=str(tmp_path / "c"))
    registry = CollectorRegistry()
    lookups = LookupThreads()
    lookups.threads = set()

    class Reader(dcp.FileSystemReader):
        def set_up_storage_reader(self, metadata, is_coordinator):  # type: ignore[no-untyped-def]
            super().set_up_storage_reader(metadata, is_coordinator)
            lookups.update(self.storage_data)
            self.storage_data = lookups

    dcp_otel.instrument(tracer_provider=TracerProvider(), registry=registry)
    try:
        loaded = {key: torch.zeros(4) for key in state}
        dcp.load(loaded, storage_reader=Reader(str(tmp_path / "c")))
        assert dcp_otel.flush(timeout_s=30)
        read = registry.get_sample_value("dcp_read_bytes_total", {"rank": "0"})  # (uninstrument unregisters it)
    finally:
        dcp_otel.uninstrument()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert lookups.threads == {"dcp-otel-builder"}  # counted, and only by the builder
    assert read is not None and read >= 2000 * 4 * 4


def test_a_full_build_queue_drops_and_counts_and_the_saves_are_unaffected(tmp_path: Path) -> None:
    _selftelemetry.reset()
    exporter = GatedExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=provider, registry=registry, max_queued_operations=2, flush_timeout_s=1)
    try:
        dcp.save(STATE, checkpoint_id=str(tmp_path / "first"))
        assert exporter.entered.wait(30)  # the builder is now stuck in the exporter
        results = [dcp.save({"w": torch.full((8,), float(i))}, checkpoint_id=str(tmp_path / f"c{i}")) for i in range(5)]
        loaded = {"w": torch.zeros(8)}
        dcp.load(loaded, checkpoint_id=str(tmp_path / "c4"))
        assert loaded["w"].tolist() == [4.0] * 8  # the checkpoints themselves are whole
        assert all(type(r).__name__ == "Metadata" for r in results)
        # 6 operations finished behind the stuck one: 2 wait in the queue, 4 were dropped and counted.
        assert dcp_otel.diagnostics()["build_queue_full"] == 4
        assert dcp_otel.flush(timeout_s=0.2) is False  # bounded: flush gives up, it does not hang
        # A scrape waits at most a second for the stuck builder, then answers with what it has.
        problems = {"reason": "build_queue_full", "rank": "0"}
        assert registry.get_sample_value("dcp_otel_telemetry_problems_total", problems) == 4
        # Metrics never depend on spans: the dropped operations (saves c2 to c4, the load) are counted already;
        # the two queued saves wait for the builder.
        saves = {"operation": "save", "status": "success", "rank": "0"}
        assert registry.get_sample_value("dcp_operations_total", saves) == 1 + 3
        assert registry.get_sample_value("dcp_operations_total", {**saves, "operation": "load"}) == 1
        exporter.gate.set()
        assert dcp_otel.flush(timeout_s=30)
        assert registry.get_sample_value("dcp_operations_total", saves) == 6  # every save once, none twice
    finally:
        exporter.gate.set()
        dcp_otel.uninstrument()
    provider.shutdown()


def test_readers_wait_for_a_stuck_builder_once_not_each_in_turn(tmp_path: Path) -> None:
    """A builder stuck behind an exporter that never returns costs one reader its second, not every reader every
    time: the SDK collects its readers one after another (a review timed 1, 2, 3 s for three), and a scrape after
    a scrape waited again. One more operation queued, or the builder moved, and the next reader waits again. (One
    that comes as it moves, before it finished what it was stuck on, does not wait: it misses that, the next one
    sees it.)"""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    exporter = GatedExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    readers = [InMemoryMetricReader() for _ in range(3)]
    meters = MeterProvider(metric_readers=readers)
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=provider, registry=registry, meter_provider=meters, flush_timeout_s=1)
    builder = dcp_otel.DCPInstrumentor().recorder.builder
    waits: list[bool] = []
    drain = builder.drain
    builder.drain = lambda *a, **k: waits.append(drain(*a, **k)) or waits[-1]  # type: ignore[method-assign]
    saves = {"operation": "save", "status": "success", "rank": "0"}
    try:
        dcp.save(STATE, checkpoint_id=str(tmp_path / "first"))
        assert exporter.entered.wait(30)  # the builder is now stuck in the exporter
        dcp.save(STATE, checkpoint_id=str(tmp_path / "queued"))  # (its metrics wait behind the stuck build)
        for reader in readers:
            reader.get_metrics_data()
        assert registry.get_sample_value("dcp_operations_total", saves) == 1
        assert waits == [False]  # the first reader waited its second in vain; the three after it did not wait
        dcp.save(STATE, checkpoint_id=str(tmp_path / "one more"))  # queued since: waited for once more
        for reader in readers:
            reader.get_metrics_data()
        assert waits == [False, False]
        exporter.gate.set()
        assert dcp_otel.flush(timeout_s=30)  # (the builder has moved on)
        del waits[:]
        assert registry.get_sample_value("dcp_operations_total", saves) == 3
        assert waits == [True]  # a reader waits for it again
    finally:
        exporter.gate.set()
        dcp_otel.uninstrument()
    provider.shutdown()
    meters.shutdown()


def test_every_reader_sees_every_finished_operation(tmp_path: Path) -> None:
    """A scrape, the provider's own force_flush and dcp_otel.flush() each wait for the builder."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=provider, registry=registry)
    try:
        for i in range(20):
            dcp.save(STATE, checkpoint_id=str(tmp_path / f"c{i}"))
            count = registry.get_sample_value("dcp_operations_total",
                                              {"operation": "save", "status": "success", "rank": "0"})  # fmt: skip
            assert count == i + 1
        provider.force_flush()
        assert len([s for s in exporter.get_finished_spans() if s.name == "dcp.checkpoint"]) == 20
    finally:
        dcp_otel.uninstrument()


class EndTimes(SpanProcessor):
    """When each span was ended (by the builder), by name."""

    def __init__(self) -> None:
        self.ended: dict[str, list[int]] = {}

    def on_end(self, span: ReadableSpan) -> None:
        self.ended.setdefault(span.name, []).append(time.time_ns())


class HeldWriter(dcp.FileSystemWriter):
    """A writer whose ``write_data`` says it is inside and waits for ``release`` (every one released at a test's
    end, whatever it asserted: ``release_all``)."""

    made: list[HeldWriter] = []  # noqa: RUF012

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.inside, self.release = threading.Event(), threading.Event()
        HeldWriter.made.append(self)

    @classmethod
    def release_all(cls) -> None:
        for writer in cls.made:
            writer.release.set()
        cls.made.clear()

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        self.inside.set()
        assert self.release.wait(60)
        return super().write_data(plan, planner)


def _upload_ends_inside_a_save(tmp_path: Path) -> tuple[HeldWriter, threading.Thread, list[int]]:
    """An async save whose upload ends while another thread is inside a save: ``(that save's writer, its thread,
    when its save returned)``. Its spans are then ready to be built."""
    upload = HeldWriter(str(tmp_path / "async"))
    future = dcp.async_save(STATE, storage_writer=upload)
    assert upload.inside.wait(30)
    held, returned = HeldWriter(str(tmp_path / "sync")), []

    def train() -> None:
        dcp.save(STATE, storage_writer=held)
        returned.append(time.time_ns())

    trainer = threading.Thread(target=train)
    trainer.start()
    assert held.inside.wait(30)
    upload.release.set()
    future.result(timeout=30)  # the async save is complete: the builder has it
    return held, trainer, returned


def test_spans_are_built_after_the_checkpoint_call_that_is_running_returns(tmp_path: Path) -> None:
    """Building an async save as the next checkpoint call plans and stages took the interpreter from that call
    (benchmarks/own_share.py): the builder waits until no thread is inside a checkpoint call."""
    times = EndTimes()
    provider = TracerProvider()
    provider.add_span_processor(times)
    dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
    builder = dcp_otel.DCPInstrumentor().recorder.builder
    try:
        held, trainer, returned = _upload_ends_inside_a_save(tmp_path)
        # A bounded wait for something that must not happen (the builder is free to build for half a second):
        assert builder.drain(0.5, hurry=False) is False
        assert "dcp.async_save" not in times.ended
        held.release.set()
        trainer.join(30)
        assert builder.drain(30, hurry=False)
        (async_end,) = times.ended["dcp.async_save"]
        assert async_end >= returned[0]  # built once the save returned, not before
    finally:
        HeldWriter.release_all()
        dcp_otel.uninstrument()


def test_the_wait_for_a_checkpoint_call_is_bounded_and_a_flush_cuts_it_short(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from dcp_otel.tracing import builder as building

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
    builder = dcp_otel.DCPInstrumentor().recorder.builder
    try:
        # A flush: whoever reads telemetry now gets every finished operation, a checkpoint call open or not.
        held, trainer, _ = _upload_ends_inside_a_save(tmp_path / "flushed")
        assert dcp_otel.flush(timeout_s=30)
        assert [s.name for s in exporter.get_finished_spans() if s.name == "dcp.async_save"] == ["dcp.async_save"]
        held.release.set()
        trainer.join(30)
        assert dcp_otel.flush(timeout_s=30)
        exporter.clear()
        # Bounded: a checkpoint call that runs on (a save of minutes) no longer holds the build back.
        monkeypatch.setattr(building, "DEFER_MAX_S", 0.2)
        held, trainer, returned = _upload_ends_inside_a_save(tmp_path / "bounded")
        assert builder.drain(30, hurry=False)
        assert not returned  # built while the save was still inside write_data
        assert [s.name for s in exporter.get_finished_spans() if s.name == "dcp.async_save"] == ["dcp.async_save"]
        held.release.set()
        trainer.join(30)
    finally:
        HeldWriter.release_all()
        dcp_otel.uninstrument()


def _held_save(tmp_path: Path) -> tuple[HeldWriter, threading.Thread]:
    """A thread inside a save's ``write_data`` until its writer is released."""
    held = HeldWriter(str(tmp_path / "held"))
    trainer = threading.Thread(target=dcp.save, args=(STATE,), kwargs={"storage_writer": held})
    trainer.start()
    assert held.inside.wait(30)
    return held, trainer


def test_back_to_back_checkpoint_calls_never_fill_the_build_queue(tmp_path: Path) -> None:
    """The builder waits out checkpoint calls only while its queue is short: saves one after another (the poll
    rarely lands between two) would otherwise keep it waiting until the queue dropped spans."""
    _selftelemetry.reset()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry(), max_queued_operations=40)
    try:
        held, trainer = _held_save(tmp_path)  # (and a thread inside a checkpoint call all along)
        for i in range(100):
            dcp.save(STATE, checkpoint_id=str(tmp_path / f"c{i}"))
        assert "build_queue_full" not in dcp_otel.diagnostics()
        held.release.set()
        trainer.join(30)
        assert dcp_otel.flush(timeout_s=60)
        assert len([s for s in exporter.get_finished_spans() if s.name == "dcp.checkpoint"]) == 101
    finally:
        HeldWriter.release_all()
        dcp_otel.uninstrument()


def test_operations_queued_behind_a_checkpoint_call_that_never_returns_share_one_deadline(
        tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """Each operation waits at most DEFER_MAX_S from when it finished, not that long after the one before it."""
    from dcp_otel.tracing import builder as building

    monkeypatch.setattr(building, "DEFER_MAX_S", 1.0)
    dcp_otel.instrument(tracer_provider=TracerProvider(), registry=CollectorRegistry())
    builder = dcp_otel.DCPInstrumentor().recorder.builder
    try:
        held, trainer = _held_save(tmp_path)
        for i in range(5):
            dcp.save(STATE, checkpoint_id=str(tmp_path / f"c{i}"))
        # One after another they would take 5 s; together, about 1 s after the last finished.
        assert builder.drain(3.0, hurry=False)
        assert trainer.is_alive()  # (built with the save still inside write_data)
    finally:
        HeldWriter.release_all()
        dcp_otel.uninstrument()


def test_the_end_of_the_checkpoint_call_wakes_the_builder_instead_of_a_look_every_few_ms(
        tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """A look every 20 ms woke the builder thread 50 times a second beside a checkpoint call, each a switch of the
    interpreter lock the caller paid for (20-50 ms of CPU beside a 10,000-tensor async_save,
    benchmarks/own_share.py): the operation call's end wakes it, and it looks only every _LOOK_EVERY_S otherwise."""
    from dcp_otel.tracing import builder as building

    monkeypatch.setattr(building, "_LOOK_EVERY_S", 60.0)
    monkeypatch.setattr(building, "DEFER_MAX_S", 60.0)
    dcp_otel.instrument(tracer_provider=TracerProvider(), registry=CollectorRegistry())
    builder = dcp_otel.DCPInstrumentor().recorder.builder
    try:
        held, trainer, _ = _upload_ends_inside_a_save(tmp_path)
        assert builder.drain(0.3, hurry=False) is False  # (a bounded wait for what must not happen)
        held.release.set()
        trainer.join(30)
        assert builder.drain(20, hurry=False)  # woken by the save's end: not 60 s later
    finally:
        HeldWriter.release_all()
        dcp_otel.uninstrument()


def _an_upload_ended_inside_a_step(tmp_path: Path) -> torch.optim.Optimizer:
    """Eight usual training steps, then an async save whose upload ends while the next step is under way: its
    optimizer step (which ends that step) is the caller's to take."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(8):
        model(torch.ones(4)).sum().backward()
        optimizer.step()
    upload = HeldWriter(str(tmp_path / "async"))
    future = dcp.async_save(STATE, storage_writer=upload)
    assert upload.inside.wait(30)
    model(torch.ones(4)).sum().backward()  # the step under way as the upload ends
    upload.release.set()
    future.result(timeout=30)
    return optimizer


def test_the_training_step_an_upload_ended_in_wakes_the_builder_when_it_ends(
        tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """An async save is measured against the training step its upload ended in: the optimizer hook wakes the
    builder when that step ends (once a checkpoint), where it looked every 50 ms before."""
    from dcp_otel.tracing import builder as building
    from dcp_otel.tracing import interference

    monkeypatch.setattr(building, "_LOOK_EVERY_S", 60.0)
    monkeypatch.setattr(interference, "WAIT_BOUNDS_S", (60.0, 60.0))  # (it would wait a minute for that step)
    dcp_otel.instrument(tracer_provider=TracerProvider(), registry=CollectorRegistry())
    builder = dcp_otel.DCPInstrumentor().recorder.builder
    try:
        optimizer = _an_upload_ended_inside_a_step(tmp_path)
        assert builder.drain(0.3, hurry=False) is False  # it waits for that step to end
        optimizer.step()
        assert builder.drain(20, hurry=False)
    finally:
        HeldWriter.release_all()
        dcp_otel.uninstrument()


def test_a_scrape_while_the_builder_waits_for_that_step_does_not_cut_its_measure_short(
        tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """A Prometheus scrape and an OTel collection from another thread (a metrics server's, a periodic reader's)
    wait, bounded, for what is queued, but never hurry an async save's build past the step its upload ended in.
    Hurried, the span said one step fewer than the histogram, whose later fold found that step overlapping the
    upload (a CI run: 43 against 44)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from dcp_otel import semconv
    from dcp_otel.tracing import builder as building
    from dcp_otel.tracing import interference

    monkeypatch.setattr(building, "_LOOK_EVERY_S", 60.0)
    monkeypatch.setattr(interference, "WAIT_BOUNDS_S", (60.0, 60.0))  # (it would wait a minute for that step)
    exporter, registry, reader = InMemorySpanExporter(), CollectorRegistry(), InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    dcp_otel.instrument(tracer_provider=provider, registry=registry, meter_provider=MeterProvider([reader]))
    builder = dcp_otel.DCPInstrumentor().recorder.builder
    try:
        optimizer = _an_upload_ended_inside_a_step(tmp_path)
        assert builder.drain(30, metrics_only=True, hurry=False)  # (its metrics recorded: now it waits for the step)
        _elsewhere(lambda: (generate_latest(registry), reader.get_metrics_data()))  # a scrape, an OTel collection
        assert builder.drain(0.3, hurry=False) is False  # it still waits for that step to end
        optimizer.step()
        assert dcp_otel.flush(timeout_s=30)
        counted = _steps_beside_a_checkpoint(registry)
    finally:
        HeldWriter.release_all()
        dcp_otel.uninstrument()
    (op,) = [s for s in exporter.get_finished_spans() if s.name == semconv.span_name("async_save")]
    assert op.attributes is not None and op.attributes[semconv.ATTR_INTERFERENCE_STEPS] == 1  # the step it ran in
    assert counted == 1  # the histogram says as many


def test_a_reader_that_would_lose_something_by_waiting_for_that_step_hurries_it(
        tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """A scrape while a save is queued behind that wait sees the save (waiting, it missed it and took 1 s), though a
    scrape before it waited its second in vain (a review found the later one then waited no more, nor hurried, and
    missed the save); a read on the training thread, whose step cannot end while it waits, builds at once (it took
    1 s, and missed it)."""
    from dcp_otel import semconv
    from dcp_otel.tracing import builder as building
    from dcp_otel.tracing import interference

    monkeypatch.setattr(building, "_LOOK_EVERY_S", 60.0)
    monkeypatch.setattr(interference, "WAIT_BOUNDS_S", (60.0, 60.0))
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=TracerProvider(), registry=registry)
    builder = dcp_otel.DCPInstrumentor().recorder.builder
    saves = f"{semconv.METRIC_OPERATION_DURATION}_count"
    try:
        _an_upload_ended_inside_a_step(tmp_path / "one")
        assert builder.drain(30, metrics_only=True, hurry=False)
        first: list[bool] = []
        _elsewhere(lambda: first.append(builder.drain_for_reader()))  # a scrape with nothing queued: its second
        assert first == [False]  # waited for the step, in vain
        dcp.save(STATE, checkpoint_id=str(tmp_path / "queued"))  # queued behind the wait for the step
        seen: list[float | None] = []
        _elsewhere(lambda: seen.append(registry.get_sample_value(saves, {"operation": "save", "status": "success", "rank": "0"})))
        assert seen == [1.0]
        _an_upload_ended_inside_a_step(tmp_path / "two")
        assert builder.drain(30, metrics_only=True, hurry=False)
        registry.get_sample_value(saves, {"operation": "save", "status": "success", "rank": "0"})  # the training thread's
        assert builder.drain(0.3, hurry=False)  # built: the read did not wait for the step
    finally:
        HeldWriter.release_all()
        dcp_otel.uninstrument()


def _elsewhere(read: Callable[[], object]) -> None:
    """``read`` on a thread of its own (a metrics server's, a periodic reader's), waited for."""
    thread = threading.Thread(target=read)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()


def _steps_beside_a_checkpoint(registry: CollectorRegistry) -> float:
    from dcp_otel import semconv

    return sum(s.value for m in registry.collect() for s in m.samples
               if s.name == f"{semconv.METRIC_TRAINING_STEP}_count" and s.labels.get(semconv.LABEL_OVERLAPS) == semconv.OVERLAPS_CHECKPOINT)  # fmt: skip
