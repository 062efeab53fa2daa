"""OTelMetricHandler: torchelastic's metrics API into Prometheus and OpenTelemetry."""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from torch.distributed.elastic import metrics
from torch.distributed.elastic.metrics.api import MetricData, NullMetricHandler

import dcp_otel
from dcp_otel import OTelMetricHandler, _selftelemetry, semconv
from tests.spans_io import from_readable, named


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(autouse=True)
def _restore_torch_handlers() -> Iterator[None]:
    _selftelemetry.reset()
    yield
    metrics.configure(NullMetricHandler())  # torch's default
    metrics.api._metrics_map.clear()


@metrics.prof
def rendezvous() -> None:
    pass


@metrics.prof(group="agent")
def restart() -> None:
    raise RuntimeError("worker died")


def value(registry: CollectorRegistry, metric: str, /, **labels: str) -> float | None:
    return registry.get_sample_value(metric, labels)


def test_put_metric_and_prof_map_to_the_contract(registry, provider) -> None:
    metrics.configure(OTelMetricHandler(registry=registry, tracer_provider=provider[0]))

    rendezvous()
    with pytest.raises(RuntimeError):
        restart()
    metrics.put_metric("workers.failed", 3)
    metrics.put_metric("workers.failed", 2)

    name = "test_elastic.rendezvous"  # torch names @prof functions <module>.<function>
    assert value(registry, "torchelastic_calls_total", group="torchelastic", name=name, status="success") == 1
    assert value(registry, "torchelastic_duration_seconds_count", group="torchelastic", name=name) == 1
    assert value(registry, "torchelastic_calls_total", group="agent", name="test_elastic.restart", status="failure") == 1
    assert value(registry, "torchelastic_events_total", group="torchelastic", name="workers.failed") == 5
    assert value(registry, "torchelastic_last_value", group="torchelastic", name="workers.failed") == 2


def test_a_duration_becomes_a_span_ending_at_the_metrics_timestamp(registry, provider) -> None:
    tp, exporter = provider
    handler = OTelMetricHandler(registry=registry, tracer_provider=tp)
    with tp.get_tracer("agent").start_as_current_span("agent.run"):
        handler.emit(MetricData(1_800_000_000.0, "agent", "SimpleElasticAgent._rendezvous.duration.ms", 1500))

    spans = from_readable(exporter.get_finished_spans())
    (span,) = named(spans, "torchelastic.SimpleElasticAgent._rendezvous")
    (parent,) = named(spans, "agent.run")
    assert span.parent_id == parent.span_id  # under the current context
    assert span.end_ns == 1_800_000_000 * 10**9
    assert span.end_ns - span.start_ns == 1_500_000_000
    assert span.attributes == {semconv.ATTR_ELASTIC_GROUP: "agent", semconv.ATTR_ELASTIC_NAME: "SimpleElasticAgent._rendezvous"}
    assert value(registry, "torchelastic_duration_seconds_sum", group="agent", name="SimpleElasticAgent._rendezvous") == 1.5
    exposition = generate_openmetrics(registry).decode()
    exemplars = [s.exemplar for f in text_string_to_metric_families(exposition) for s in f.samples if s.exemplar]
    assert exemplars and {e.labels["trace_id"] for e in exemplars} == {span.trace_id}


def test_a_handler_for_one_group_and_the_deprecated_api(registry) -> None:
    metrics.configure(OTelMetricHandler(registry=registry), group="agent")
    metrics.put_metric("restarts", 1, "agent")
    metrics.put_metric("ignored", 1, "other-group")  # goes to torch's default handler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        metrics.publish_metric("agent", "restarts", 1)

        @metrics.profile("agent")
        def step() -> None:
            pass

        step()
    assert value(registry, "torchelastic_events_total", group="agent", name="restarts") == 2
    assert value(registry, "torchelastic_events_total", group="other-group", name="ignored") is None
    assert value(registry, "torchelastic_calls_total", group="agent", name="step", status="success") == 1


@pytest.mark.parametrize(
    ("bad_value", "reason"),
    [(None, "bad_value"), (math.nan, "bad_value"), (math.inf, "bad_value"), (True, "bad_value"),
     ("12", "bad_value"), (10**30, "bad_value"), (-1, "negative_value")],  # fmt: skip
)
def test_bad_values_are_dropped_and_counted_never_raised(registry, bad_value: object, reason: str) -> None:
    handler = OTelMetricHandler(registry=registry)
    handler.emit(MetricData(time.time(), "g", "m", bad_value))
    handler.emit(MetricData(time.time(), "g", "m.duration.ms", bad_value))

    assert value(registry, "torchelastic_dropped_metrics_total", reason=reason) >= 1
    assert dcp_otel.diagnostics()[f"torchelastic_{reason}"] >= 1
    assert value(registry, "torchelastic_duration_seconds_count", group="g", name="m") is None
    assert value(registry, "torchelastic_events_total", group="g", name="m") is None


def test_odd_names_are_sanitized_or_dropped(registry) -> None:
    handler = OTelMetricHandler(registry=registry)
    handler.emit(MetricData(time.time(), "g", "with space.and.dots", 1))
    handler.emit(MetricData(time.time(), "g", "ünïcødé\n", 1))
    handler.emit(MetricData(time.time(), "g", 42, 1))
    handler.emit(MetricData(time.time(), None, "no group", 1))
    handler.emit(MetricData(time.time(), "g", object(), 1))
    handler.emit(MetricData(time.time(), "g", "x" * 1000, 1))
    handler.emit(None)  # not even MetricData

    assert value(registry, "torchelastic_events_total", group="g", name="with space.and.dots") == 1
    assert value(registry, "torchelastic_events_total", group="g", name="ünïcødé") == 1  # control char removed
    assert value(registry, "torchelastic_events_total", group="g", name="42") == 1
    assert value(registry, "torchelastic_events_total", group="default", name="no group") == 1
    assert value(registry, "torchelastic_events_total", group="g", name="x" * 128) == 1  # capped
    assert value(registry, "torchelastic_dropped_metrics_total", reason="bad_name") == 1  # object()
    assert value(registry, "torchelastic_dropped_metrics_total", reason="bad_value") == 1  # None: no value either


def test_series_are_capped_with_an_overflow_bucket(registry) -> None:
    handler = OTelMetricHandler(registry=registry, max_series=3)
    for i in range(10):
        handler.emit(MetricData(time.time(), "g", f"request.{i}", 1))

    assert value(registry, "torchelastic_events_total", group="g", name="request.2") == 1
    assert value(registry, "torchelastic_events_total", group="g", name="request.3") is None
    assert value(registry, "torchelastic_events_total", group=semconv.OVERFLOW, name=semconv.OVERFLOW) == 7
    assert value(registry, "torchelastic_dropped_metrics_total", reason="series_limit") == 7


def test_emit_is_thread_safe(registry) -> None:
    handler = OTelMetricHandler(registry=registry)
    start = threading.Barrier(8)

    def work() -> None:
        start.wait()
        for _ in range(1000):
            handler.emit(MetricData(time.time(), "g", "ticks", 1))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert value(registry, "torchelastic_events_total", group="g", name="ticks") == 8000


def test_custom_rules_run_first(registry) -> None:
    seen = []

    def bytes_rule(group: str, name: str, amount: float, timestamp: float) -> bool:
        if name.endswith(".bytes"):
            seen.append((group, name, amount))
            return True
        return False

    handler = OTelMetricHandler(registry=registry, rules=[bytes_rule])
    handler.emit(MetricData(time.time(), "g", "upload.bytes", 1024))
    handler.emit(MetricData(time.time(), "g", "other", 1))
    assert seen == [("g", "upload.bytes", 1024.0)]
    assert value(registry, "torchelastic_events_total", group="g", name="upload.bytes") is None
    assert value(registry, "torchelastic_events_total", group="g", name="other") == 1


def test_bad_configuration_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="max_series"):
        OTelMetricHandler(max_series=0)
    with pytest.raises(ValueError, match="callable"):
        OTelMetricHandler(rules=["not a rule"])  # type: ignore[list-item]


def test_two_handlers_can_share_a_registry(registry) -> None:
    OTelMetricHandler(registry=registry).emit(MetricData(time.time(), "a", "n", 1))
    OTelMetricHandler(registry=registry).emit(MetricData(time.time(), "a", "n", 1))
    assert value(registry, "torchelastic_events_total", group="a", name="n") == 2
