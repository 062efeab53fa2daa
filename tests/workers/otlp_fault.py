"""Saves while the OTLP endpoint is down or hung, then exits (run by tests/test_faults.py).

The SDK is configured as users do, from OTEL_* variables: spans through a
batch processor, and the checkpoint metrics pushed by a periodic metric reader
(OTLP/HTTP both). Prints one JSON line: saves done, their median time, resident
memory after a warm-up and at the end, dcp-otel's diagnostics, and the time it
finished (the test measures how long the exit then takes), how many spans are still alive, and the
spans' fate: how many ended, and how many the batch processor handed the exporter.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence

import torch
import torch.distributed.checkpoint as dcp
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

import dcp_otel
from tests.workers import rss_kib


class Ended(SpanProcessor):
    """Counts the spans that end (the builder thread ends them all)."""

    count = 0

    def on_end(self, span: ReadableSpan) -> None:
        Ended.count += 1


class Handed(OTLPSpanExporter):
    """The real OTLP exporter, counting the spans the batch processor hands it (its one worker thread)."""

    count = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        Handed.count += len(spans)
        return super().export(spans)


def main(saves: int) -> None:
    warnings.simplefilter("ignore")
    provider = TracerProvider()
    provider.add_span_processor(Ended())  # first: a span is counted before the batch processor takes or drops it
    provider.add_span_processor(BatchSpanProcessor(Handed()))  # endpoint, timeout from OTEL_*
    trace.set_tracer_provider(provider)
    meters = MeterProvider([PeriodicExportingMetricReader(OTLPMetricExporter())])  # interval from OTEL_*
    dcp_otel.instrument(meter_provider=meters)
    state = {"w": torch.ones(64)}
    times = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        for i in range(saves):
            if i == saves // 3:  # the span queue (2048) is long full: memory must stop growing
                warm = rss_kib()
            started = time.perf_counter()
            dcp.save(state, checkpoint_id=f"{root}/c{i % 4}")
            times.append(time.perf_counter() - started)
    gc.collect()
    live_spans = sum(1 for o in gc.get_objects() if isinstance(o, ReadableSpan))
    # The builder may still be ending spans and the exporter taking them: read in this order, every count
    # only grows, and the test's bounds on the drops hold whatever happens between two reads.
    ended_before = Ended.count
    diagnostics = dcp_otel.diagnostics()
    handed = Handed.count
    ended_after = Ended.count
    print(json.dumps({"saves": saves, "median_s": statistics.median(times), "rss_warm_kib": warm,
                      "rss_end_kib": rss_kib(), "live_spans": live_spans, "diagnostics": diagnostics,
                      "ended_before": ended_before, "handed": handed, "ended_after": ended_after,
                      "done_at": time.time()}), flush=True)  # fmt: skip
    # Now exit, as a training script does: the exit flush (spans and metrics) is dcp-otel's,
    # bounded by DCP_OTEL_FLUSH_TIMEOUT_S.


if __name__ == "__main__":
    main(int(sys.argv[1]))
