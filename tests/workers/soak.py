"""Soak: thousands of save/load cycles with dcp-otel on; prints what the test checks, as JSON.

Spans go through a real BatchSpanProcessor to an exporter that keeps nothing;
metrics into a registry. Resident memory is read from /proc after a warm-up and
at the end.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import warnings
from collections.abc import Sequence

import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry

import dcp_otel
from tests.workers import rss_kib


class Discard(SpanExporter):
    exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        Discard.exported += len(spans)
        return SpanExportResult.SUCCESS


def series(registry: CollectorRegistry) -> int:
    return sum(len(metric.samples) for metric in registry.collect())


def main(cycles: int, warmup: int) -> None:
    warnings.simplefilter("ignore")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=provider, registry=registry)
    state = {"w": torch.ones(16), "b": torch.zeros(4)}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        def cycle(i: int) -> None:
            path = f"{root}/c{i % 4}"  # distinct ids, few files
            dcp.save(state, checkpoint_id=path)
            dcp.load(state, checkpoint_id=path)

        for i in range(warmup):
            cycle(i)
        provider.force_flush()
        gc.collect()
        before, series_before = rss_kib(), series(registry)
        for i in range(cycles):
            cycle(i)
        provider.force_flush()
        gc.collect()
        after, series_after = rss_kib(), series(registry)
    recorder = dcp_otel.DCPInstrumentor().recorder
    print(json.dumps({
        "cycles": cycles, "rss_before_kib": before, "rss_after_kib": after,
        "series_before": series_before, "series_after": series_after,
        "open_spans": recorder.open_count(), "exported_spans": Discard.exported,
        "diagnostics": dcp_otel.diagnostics(),
    }))  # fmt: skip
    dcp_otel.uninstrument()
    provider.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
