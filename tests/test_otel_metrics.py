"""The metric catalogue through the OpenTelemetry metrics API, for users who push instead of being scraped.

The same facts that feed prometheus-client feed OTel instruments named after
:data:`dcp_otel.semconv.CHECKPOINT_METRICS` and :data:`~dcp_otel.semconv.ELASTIC_METRICS`;
exported to Prometheus they must give exactly today's names, labels, buckets
and values, and pushed over OTLP they must carry units, attributes, bounds,
exemplars of the checkpoint's trace, and the rank and run on the resource.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from prometheus_client import CollectorRegistry, Metric
from torch.distributed.elastic.metrics.api import MetricData

import dcp_otel
from dcp_otel import OTelMetricHandler, _selftelemetry, semconv
from dcp_otel.metrics.prometheus import FanOut
from tests.spans_io import named

CATALOGUE = semconv.CHECKPOINT_METRICS + semconv.ELASTIC_METRICS


def state() -> dict[str, Any]:
    return {"w": torch.ones(1000), "model": torch.nn.Linear(10, 10)}


class GatedWriter(dcp.FileSystemWriter):
    """An upload that waits for its gate: the training loop steps beside it for sure."""

    def __init__(self, path: str, gate: threading.Event) -> None:
        super().__init__(path)
        self.gate = gate

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.gate.wait(30)
        return super().write_data(plan, planner)


def every_kind_of_event(tmp_path: Path, handler: OTelMetricHandler) -> None:
    """A save, a load, an async save with training steps around it, a failed save, and each kind of torchelastic
    metric (one dropped)."""
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
    dcp.load(state(), checkpoint_id=str(tmp_path / "c"))
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    for _ in range(8):  # training steps (told by the optimizer hook), then two beside the upload: interference
        optimizer.step()
    gate = threading.Event()
    future = dcp.async_save(state(), storage_writer=GatedWriter(str(tmp_path / "a"), gate))
    optimizer.step()
    optimizer.step()
    gate.set()
    future.result()
    optimizer.step()
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(BaseException):  # noqa: B017 - whatever torch raises for it, unchanged
        dcp.save(state(), checkpoint_id=str(tmp_path / "file" / "c"))
    for name, value in (("rdzv.duration.ms", 1250), ("rdzv.success", 1), ("rdzv.failure", 1), ("restarts", 3),
                        ("bad", math.nan)):  # fmt: skip
        handler.emit(MetricData(1_700_000_000.0, "agent", name, value))
    assert dcp_otel.flush(timeout_s=30)


@pytest.fixture
def meter_and_spans() -> Iterator[tuple[MeterProvider, InMemoryMetricReader, TracerProvider]]:
    reader = InMemoryMetricReader()
    meters = MeterProvider([reader])
    tracer = TracerProvider()
    yield meters, reader, tracer
    dcp_otel.uninstrument()
    meters.shutdown()
    tracer.shutdown()


def families(registry: CollectorRegistry) -> dict[str, Metric]:
    return {m.name: m for m in registry.collect()}


def comparable(metric: Metric) -> tuple[str, str, set[tuple[str, tuple[tuple[str, str], ...], float]]]:
    """A family as Prometheus stores it: type and samples (OTel's scope labels and prometheus-client's
    ``_created`` series set aside)."""
    samples = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope_"))), s.value)
        for s in metric.samples
        if not s.name.endswith("_created")
    }
    return metric.type, metric.documentation, samples


def test_every_metric_exported_to_prometheus_has_todays_name_labels_buckets_and_values(
    tmp_path: Path, meter_and_spans: tuple[MeterProvider, InMemoryMetricReader, TracerProvider]
) -> None:
    """The OTel side, through the real OTel Prometheus exporter, equals the prometheus-client side, metric by metric."""
    _, _, tracer = meter_and_spans
    _selftelemetry.reset()
    direct, via_otel = CollectorRegistry(), CollectorRegistry()
    exporter = PrometheusMetricReader(registry=via_otel, disable_target_info=True)
    meters = MeterProvider([exporter])
    try:
        dcp_otel.instrument(tracer_provider=tracer, registry=direct, meter_provider=meters)
        every_kind_of_event(tmp_path, OTelMetricHandler(registry=direct, tracer_provider=tracer, meter_provider=meters))
        ours, theirs = families(direct), families(via_otel)
    finally:
        dcp_otel.uninstrument()
        meters.shutdown()
    for spec in CATALOGUE:
        assert spec.prometheus in ours, spec  # every metric was recorded by the events above
        assert spec.prometheus in theirs, f"{spec.otel} ({spec.unit}) is not exported as {spec.prometheus}"
        assert comparable(theirs[spec.prometheus]) == comparable(ours[spec.prometheus]), spec.prometheus
    # Nothing else either: the OTel side adds no metric of its own (the collection barrier reports no value).
    assert set(theirs) == {spec.prometheus for spec in CATALOGUE}


def points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    return [
        point
        for rm in (data.resource_metrics if data else ())
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


@pytest.mark.parametrize("instrumented", ["once", "again"])
def test_a_collection_right_after_a_save_sees_it_with_an_exemplar_of_the_operation_span(
    tmp_path: Path, meter_and_spans: tuple[MeterProvider, InMemoryMetricReader, TracerProvider], instrumented: str
) -> None:
    """Also after uninstrument() and instrument() again into the same provider (whose SDK keeps
    the instruments, and the collection callbacks, of the first time)."""
    meters, reader, tracer = meter_and_spans
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans = InMemorySpanExporter()
    tracer.add_span_processor(SimpleSpanProcessor(spans))
    if instrumented == "again":
        dcp_otel.instrument(tracer_provider=tracer, registry=CollectorRegistry(), meter_provider=meters)
        dcp_otel.uninstrument()
    dcp_otel.instrument(tracer_provider=tracer, registry=CollectorRegistry(), meter_provider=meters)
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
    # No flush: the SDK's collection itself waits for the builder (the collection barrier).
    recorder = dcp_otel.DCPInstrumentor().recorder
    assert recorder is not None
    drained: list[bool] = []
    drain = recorder.builder.drain

    def watched(timeout_s: float, metrics_only: bool = False, hurry: bool = True) -> bool:
        drained.append(metrics_only)
        return drain(timeout_s, metrics_only, hurry)

    recorder.builder.drain = watched  # type: ignore[method-assign]
    (duration,) = points(reader, semconv.OPERATION_DURATION.otel)
    assert drained == [True]  # the collection asked this instrumentation's builder for its metrics first
    assert duration.count == 1 and dict(duration.attributes) == {"operation": "save", "status": "success", "rank": "0"}
    assert list(duration.explicit_bounds) == list(semconv.DURATION_BUCKETS)
    tracer.force_flush()  # the spans are built after the metrics
    (save,) = [s for s in spans.get_finished_spans() if s.name == "dcp.save"]
    (exemplar,) = duration.exemplars
    assert (exemplar.trace_id, exemplar.span_id) == (save.context.trace_id, save.context.span_id)


def test_no_exemplar_points_at_a_trace_that_was_not_recorded(tmp_path: Path) -> None:
    reader = InMemoryMetricReader()
    meters = MeterProvider([reader])
    dcp_otel.instrument(tracer_provider=TracerProvider(sampler=ALWAYS_OFF), registry=CollectorRegistry(),
                        meter_provider=meters)  # fmt: skip
    try:
        dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
        found = points(reader, semconv.STEP_DURATION.otel)
    finally:
        dcp_otel.uninstrument()
        meters.shutdown()
    assert found and not any(p.exemplars for p in found)


@pytest.mark.parametrize("sinks", ["prometheus", "opentelemetry", "none", "prometheus,opentelemetry"])
def test_each_side_can_be_turned_off(tmp_path: Path, sinks: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(semconv.ENV_METRICS, sinks)  # as a job would, with no code
    reader = InMemoryMetricReader()
    meters, registry = MeterProvider([reader]), CollectorRegistry()
    dcp_otel.instrument(registry=registry, meter_provider=meters)
    try:
        dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
        handler = OTelMetricHandler(registry=registry, meter_provider=meters)
        handler.emit(MetricData(1_700_000_000.0, "agent", "restarts", 1))
        assert dcp_otel.flush(timeout_s=30)
        in_prometheus = {m.name for m in registry.collect() if m.samples}
        data = reader.get_metrics_data()  # None: nothing recorded at all
        in_otel = {m.name for rm in (data.resource_metrics if data else ()) for sm in rm.scope_metrics
                   for m in sm.metrics}  # fmt: skip
    finally:
        dcp_otel.uninstrument()
        meters.shutdown()
    want = sinks.split(",")
    assert ("dcp_operations" in in_prometheus) == ("prometheus" in want)
    assert ("torchelastic_events" in in_prometheus) == ("prometheus" in want)
    assert (semconv.OPERATION_COUNT.otel in in_otel) == ("opentelemetry" in want)
    assert (semconv.ELASTIC_EVENTS.otel in in_otel) == ("opentelemetry" in want)


@pytest.mark.parametrize(
    ("meter_provider", "exporter", "expected"),
    [(False, None, ("prometheus",)), (False, "none", ("prometheus",)), (True, None, semconv.ALL_METRIC_SINKS),
     (False, "otlp", semconv.ALL_METRIC_SINKS), (False, "console", semconv.ALL_METRIC_SINKS)],
)
def test_the_opentelemetry_side_is_on_when_opentelemetry_metrics_are_asked_for(
    monkeypatch: pytest.MonkeyPatch, meter_provider: bool, exporter: str | None, expected: tuple[str, ...]
) -> None:
    """A scraped job under ``opentelemetry-instrument`` (whose distro defaults to an OTLP metric
    exporter) must not start pushing a second copy of its metrics unless it asks to."""
    monkeypatch.delenv(semconv.ENV_METRICS, raising=False)
    if exporter is None:
        monkeypatch.delenv(semconv.ENV_OTEL_METRICS_EXPORTER, raising=False)
    else:
        monkeypatch.setenv(semconv.ENV_OTEL_METRICS_EXPORTER, exporter)
    options = {"meter_provider": NoOpMeterProvider()} if meter_provider else {}
    dcp_otel.instrument(registry=CollectorRegistry(), **options)
    try:
        instrumentor = dcp_otel.DCPInstrumentor()
        assert instrumentor.recorder is not None and instrumentor.recorder.options.metrics == expected
        assert (instrumentor.otel_metrics is not None) == ("opentelemetry" in expected)
    finally:
        dcp_otel.uninstrument()


def test_bad_metric_options_fail_at_configuration_and_a_bad_variable_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for bad in ({"meter_provider": TracerProvider()}, {"meter_provider": "otlp"}, {"metrics": "prometheus,otlp"},
                {"metrics": 3}):  # fmt: skip
        with pytest.raises(ValueError, match="meter_provider|metrics"):
            dcp_otel.instrument(registry=CollectorRegistry(), **bad)
        assert not dcp_otel.DCPInstrumentor().is_instrumented_by_opentelemetry
    with pytest.raises(ValueError, match="MeterProvider"):
        OTelMetricHandler(meter_provider=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown metrics sink"):
        OTelMetricHandler(metrics="statsd")
    # Any MeterProvider of the API is accepted, the no-op one too.
    dcp_otel.instrument(registry=CollectorRegistry(), meter_provider=NoOpMeterProvider())
    dcp_otel.uninstrument()

    monkeypatch.setenv(semconv.ENV_METRICS, "prometheus,statsd")
    with caplog.at_level(logging.WARNING, logger="dcp_otel"):
        dcp_otel.instrument(registry=CollectorRegistry(), meter_provider=NoOpMeterProvider())
    try:
        recorder = dcp_otel.DCPInstrumentor().recorder
        assert recorder is not None and recorder.options.metrics == semconv.ALL_METRIC_SINKS  # the default (a provider)
    finally:
        dcp_otel.uninstrument()
    assert f"ignoring {semconv.ENV_METRICS}='prometheus,statsd'" in caplog.text


class Broken:
    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any) -> None:
            raise RuntimeError("sink down")

        return fail


class Kept:
    def __init__(self) -> None:
        self.facts: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.facts.append((name, args))


def test_one_failing_sink_neither_starves_the_other_nor_raises() -> None:
    _selftelemetry.reset()
    kept = Kept()
    fan = FanOut([Broken(), kept])  # type: ignore[list-item]
    fan.step_done("save", "write_data", "0", 0.5, None)
    fan.bytes_written("0", 10)
    assert kept.facts == [("step_done", ("save", "write_data", "0", 0.5, None)), ("bytes_written", ("0", 10))]
    assert _selftelemetry.counts()["metrics_error"] == 2


def test_after_uninstrument_nothing_more_is_recorded(
    tmp_path: Path, meter_and_spans: tuple[MeterProvider, InMemoryMetricReader, TracerProvider]
) -> None:
    meters, reader, tracer = meter_and_spans
    dcp_otel.instrument(tracer_provider=tracer, registry=CollectorRegistry(), meter_provider=meters)
    dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
    dcp_otel.uninstrument()
    dcp.save(state(), checkpoint_id=str(tmp_path / "d"))
    _selftelemetry.report("test_problem", "a problem after uninstrument")
    (count,) = [p for p in points(reader, semconv.OPERATION_COUNT.otel) if p.attributes["status"] == "success"]
    assert count.value == 1
    assert not points(reader, semconv.TELEMETRY_PROBLEMS.otel)


def test_handlers_share_a_providers_instruments_and_never_keep_a_dropped_provider_alive() -> None:
    meters = MeterProvider(metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False)  # no atexit reference
    first = OTelMetricHandler(registry=CollectorRegistry(), meter_provider=meters, metrics="opentelemetry")
    second = OTelMetricHandler(registry=CollectorRegistry(), meter_provider=meters, metrics="opentelemetry")
    assert first._otel is second._otel is not None  # one set of instruments per provider
    gone = weakref.ref(meters)
    meters.shutdown()
    del meters, first, second
    gc.collect()
    assert gone() is None


# --- two real ranks, no code, metrics pushed over OTLP -------------------------------------
def test_opentelemetry_instrument_pushes_every_metric_over_otlp_from_two_ranks_and_their_agent(tmp_path: Path) -> None:
    """``opentelemetry-instrument dcp-otel-run`` with ``OTEL_METRICS_EXPORTER=otlp`` and the Prometheus side off.

    Nothing calls a flush and the metric reader's period is ten minutes, so every
    metric that arrives was pushed as the processes exited (the ranks, their
    checkpoint daemons' relayed observations, and the agent).
    """
    from tests.otlp_receiver import OtlpReceiver, attributes_of
    from tests.ranks import WORKERS, rank_env

    bindir = Path(sys.executable).parent
    with OtlpReceiver() as receiver:
        env = rank_env(OTEL_TRACES_EXPORTER="otlp", OTEL_METRICS_EXPORTER="otlp", OTEL_LOGS_EXPORTER="none",
                       OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                       OTEL_METRIC_EXPORT_INTERVAL="600000", OTEL_SERVICE_NAME="otlp-metrics",
                       **{semconv.ENV_METRICS: "opentelemetry", semconv.ENV_AGENT_METRICS_PORT: "0",
                          semconv.ENV_METRICS_ADDR: "127.0.0.1"},
                       CKPT=str(tmp_path / "c"), OUT_DIR=str(tmp_path))  # fmt: skip
        env.pop(semconv.ENV_METRICS_PORT, None)
        run = subprocess.run(
            [str(bindir / "opentelemetry-instrument"), str(bindir / "dcp-otel-run"), "--standalone",
             "--nproc-per-node", "2", str(WORKERS / "otel_metrics_train.py")],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    # The checkpoint is what it would be without us, and prometheus-client got nothing.
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert result == {"saved": "Metadata", "uploaded": "Metadata", "loaded_ok": True, "prometheus_client": []}

    received = receiver.metrics
    by_name: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    for item in received:
        kind = item.metric.WhichOneof("data")
        assert item.scope == semconv.SCOPE_NAME
        for point in getattr(item.metric, kind).data_points:
            by_name.setdefault(item.metric.name, []).append((item.resource, point))
        spec = next((s for s in CATALOGUE if s.otel == item.metric.name), None)
        assert spec is not None, f"an unknown metric arrived: {item.metric.name}"
        assert item.metric.unit == spec.unit
        expected_kind = {semconv.KIND_HISTOGRAM: "histogram", semconv.KIND_GAUGE: "gauge"}.get(spec.kind, "sum")
        assert kind == expected_kind, spec
        if kind == "sum":
            assert item.metric.sum.is_monotonic == (spec.kind == semconv.KIND_COUNTER), spec
    assert set(by_name) == {spec.otel for spec in CATALOGUE}  # every metric, checkpoint and torchelastic

    for spec in CATALOGUE:
        for resource, point in by_name[spec.otel]:
            attributes = attributes_of(point.attributes)
            if spec is semconv.ELASTIC_EVENTS or spec is semconv.ELASTIC_LAST_VALUE or spec is semconv.ELASTIC_DURATION:
                assert set(attributes) == {"group", "name"}, spec
            else:
                assert set(attributes) == set(spec.labels), (spec, attributes)
            if spec.kind == semconv.KIND_HISTOGRAM:
                assert tuple(point.explicit_bounds) == spec.buckets
            if spec in semconv.CHECKPOINT_METRICS:  # recorded by a rank: its rank and run on the resource
                assert resource["service.name"] == "otlp-metrics"
                assert str(resource["dcp.rank"]) == attributes["rank"]
    runs = {resource["dcp.run_id"] for resource, _ in by_name[semconv.OPERATION_COUNT.otel]}
    assert len(runs) == 1

    def last(name: str, **attrs: str) -> Any:
        matching = [p for _, p in by_name[name] if attributes_of(p.attributes).items() >= attrs.items()]
        assert matching, (name, attrs)
        return max(matching, key=lambda p: p.time_unix_nano)

    def value(point: Any) -> float:
        return float(getattr(point, point.WhichOneof("value")))

    for rank in ("0", "1"):
        for operation in ("save", "load", "async_save"):
            assert value(last(semconv.OPERATION_COUNT.otel, operation=operation, status="success", rank=rank)) == 1
        assert value(last(semconv.ASYNC_IN_FLIGHT.otel, rank=rank)) == 0  # the daemon's upload, relayed
        assert last(semconv.ASYNC_PHASE_DURATION.otel, phase="upload", rank=rank).count == 1
        assert value(last(semconv.TELEMETRY_PROBLEMS.otel, reason="torchelastic_bad_value", rank=rank)) == 1
    for rank in ("0", "1"):  # the failing save: each rank's own exception (its folder is a file), counted once there
        assert value(last(semconv.OPERATION_COUNT.otel, operation="save", status="failure", rank=rank)) == 1
        failed = last(semconv.FAILURES.otel, operation="save", rank=rank)
        assert value(failed) == 1 and attributes_of(failed.attributes)["error_type"].endswith("Error")
    written = sum(value(last(semconv.WRITTEN_BYTES.otel, rank=r)) for r in ("0", "1"))
    assert written == sum(f.stat().st_size for f in tmp_path.glob("c*/*.distcp"))
    assert value(last(semconv.ELASTIC_DROPPED.otel, reason="bad_value")) == 1
    # The agent's own phases, from the launcher process (no rank on its resource).
    agent = [attributes_of(p.attributes) for resource, p in by_name[semconv.ELASTIC_DURATION.otel]
             if "dcp.rank" not in resource]  # fmt: skip
    assert {"group": "torchelastic", "name": "SimpleElasticAgent._rendezvous"} in agent

    # Exemplars: each rank's save duration points at that rank's dcp.save span, in the checkpoint's one trace.
    saves = {s.attributes["dcp.rank"]: s for s in named(receiver.spans, "dcp.save")
             if s.attributes["dcp.operation"] == "save" and not s.error}  # fmt: skip  # (not the failing save)
    assert len({s.trace_id for s in saves.values()}) == 1
    for rank, span in saves.items():
        exemplars = [e for _, p in by_name[semconv.OPERATION_DURATION.otel]
                     if attributes_of(p.attributes) == {"operation": "save", "status": "success", "rank": str(rank)}
                     for e in p.exemplars]  # fmt: skip
        assert exemplars, rank
        assert {(e.trace_id.hex(), e.span_id.hex()) for e in exemplars} == {(span.trace_id, span.span_id)}


def test_duration_buckets_resolve_a_trend_from_10_ms_to_an_hour() -> None:
    """Neighbouring bounds at most 2.5x apart: a checkpoint growing from 100 s to 200 s moves its quantiles
    (with bounds at 60 s and 300 s, every checkpoint between read p50 = 180 s)."""
    bounds = semconv.DURATION_BUCKETS
    inside = [b for b in bounds if 0.01 <= b <= 3600]
    assert inside[0] == 0.01 and inside[-1] == 3600 and list(bounds) == sorted(bounds)
    assert max(b / a for a, b in zip(inside, inside[1:], strict=False)) <= 2.5
    assert bounds[0] <= 0.005 and bounds[-1] >= 7200  # planning in milliseconds, writes of hours


def test_over_otlp_the_histograms_can_be_exponential_with_the_standard_variable(
    tmp_path: Path, meter_and_spans: tuple[MeterProvider, InMemoryMetricReader, TracerProvider]
) -> None:
    """OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=base2_exponential_bucket_histogram makes the OTLP
    exporter prefer exponential histograms: a reader preferring them gets them, our bucket advisory notwithstanding."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.export import ExponentialHistogram

    env = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
    previous = os.environ.get(env)
    os.environ[env] = "base2_exponential_bucket_histogram"
    try:
        preferred = OTLPMetricExporter(endpoint="http://127.0.0.1:9/v1/metrics")._preferred_aggregation[Histogram]
    finally:
        if previous is None:
            del os.environ[env]
        else:
            os.environ[env] = previous
    _, _, tracer = meter_and_spans
    reader = InMemoryMetricReader(preferred_aggregation={Histogram: preferred})
    meters = MeterProvider([reader])
    try:
        dcp_otel.instrument(tracer_provider=tracer, registry=CollectorRegistry(), meter_provider=meters)
        dcp.save(state(), checkpoint_id=str(tmp_path / "c"))
        data = reader.get_metrics_data()
        kinds = {m.name: type(m.data) for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    finally:
        dcp_otel.uninstrument()
        meters.shutdown()
    assert kinds[semconv.STEP_DURATION.otel] is ExponentialHistogram
    assert kinds[semconv.OPERATION_DURATION.otel] is ExponentialHistogram
