"""Saves while the OTLP endpoint is down or hung, then exits (run by tests/test_faults.py).

The SDK is configured as users do, from OTEL_* variables: spans through a
batch processor, and the checkpoint metrics pushed by a periodic metric reader
(OTLP/HTTP both). Prints one JSON line: saves done, their median time, resident
memory after a warm-up and at the end, dcp-otel's diagnostics, and the time it
finished (the test measures how long the exit then takes), and how many spans are still alive.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import dcp_otel
from tests.workers import rss_kib


def main(saves: int) -> None:
    warnings.simplefilter("ignore")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint, timeout from OTEL_*
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
    print(json.dumps({"saves": saves, "median_s": statistics.median(times), "rss_warm_kib": warm,
                      "rss_end_kib": rss_kib(), "live_spans": live_spans, "diagnostics": dcp_otel.diagnostics(),
                      "done_at": time.time()}), flush=True)  # fmt: skip
    # Now exit, as a training script does: the exit flush (spans and metrics) is dcp-otel's,
    # bounded by DCP_OTEL_FLUSH_TIMEOUT_S.


if __name__ == "__main__":
    main(int(sys.argv[1]))
