"""Property-based: whatever torch logs, and whatever torchelastic emits, nothing raises
into the caller and bookkeeping stays bounded (hypothesis generates the input)."""

from __future__ import annotations

import math

import pytest
import torch.distributed.checkpoint.logger as dcp_log
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from torch.distributed.elastic.metrics.api import MetricData

import dcp_otel
from dcp_otel import OTelMetricHandler, semconv

MAX_OPEN = 32
T0 = 1_700_000_000_000_000_000
FUNCS = ["save", "async_save", "load", "local_step", "global_step", "write_data", "read_data",
         "_stateful_to_state_dict", "_stateful_to_state_dict.model", "finish_checkpoint", "x" * 300, ""]  # fmt: skip

#: A DCP log record, as torch writes it or anything near it: missing fields, wrong types,
#: ends without starts, duplicate and out-of-order ids, times that go backwards.
records = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "event": st.sampled_from(["start", "end", "exception", "begin", 7]),
            "uuid": st.one_of(st.sampled_from([f"u{i}" for i in range(6)]), st.integers(), st.none()),
            "func_name": st.one_of(st.sampled_from(FUNCS), st.integers()),
            "time": st.one_of(st.integers(min_value=-10, max_value=10**6).map(lambda d: T0 + d), st.text(max_size=3)),
            "checkpoint_id": st.one_of(st.none(), st.text(max_size=20), st.just("s3://k:secret@b/c?sig=x")),
            "error": st.text(max_size=50),
            "log_exceptions": st.booleans(),
        },
    ),
    st.text(max_size=20),
    st.integers(),
    st.lists(st.integers(), max_size=3),
    st.none(),
)


@pytest.fixture(scope="module")
def instrumented():  # type: ignore[no-untyped-def]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry(), max_open_spans=MAX_OPEN)
    yield exporter
    dcp_otel.uninstrument()
    provider.shutdown()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(records, max_size=60))
def test_any_sequence_of_dcp_log_records_never_raises_and_stays_bounded(instrumented, msgs: list[object]) -> None:  # type: ignore[no-untyped-def]
    recorder = dcp_otel.DCPInstrumentor().recorder
    for msg in msgs:
        dcp_log._dcp_logger.debug(msg)  # through torch's real logger: a raise would reach the caller
        assert recorder.open_count() <= MAX_OPEN
    # Whatever was left open closes when its end comes: bookkeeping returns to empty.
    for uuid in [f"u{i}" for i in range(6)]:
        dcp_log._dcp_logger.debug({"event": "end", "uuid": uuid, "func_name": "save", "time": T0 + 10**7})
    assert recorder.open_count() == 0 and recorder.stack_depth() == 0
    instrumented.clear()


names = st.one_of(st.text(max_size=40), st.sampled_from(["a.duration.ms", "b.success", "c.failure", "workers.x"]))
values = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none(), st.text(max_size=5), st.just([1]),
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=10), names, values, st.floats(allow_nan=True)), max_size=40))
def test_any_metric_emitted_to_the_handler_never_raises_and_series_stay_capped(emitted: list[tuple]) -> None:  # type: ignore[type-arg]
    registry = CollectorRegistry()
    handler = OTelMetricHandler(registry=registry, max_series=8)
    for group, name, value, timestamp in emitted:
        handler.emit(MetricData(timestamp, group, name, value))  # type: ignore[arg-type]
    pairs = {
        (s.labels[semconv.LABEL_GROUP], s.labels[semconv.LABEL_NAME])
        for metric in registry.collect()
        for s in metric.samples
        if semconv.LABEL_NAME in s.labels
    }
    assert len(pairs) <= 8 + 1  # the cap, plus the one "_overflow" pair
    for metric in registry.collect():
        for sample in metric.samples:
            assert not math.isnan(sample.value) and not math.isinf(sample.value), sample
            assert all(len(v) <= 128 for v in sample.labels.values())
