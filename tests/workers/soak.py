"""Soak: thousands of save/load cycles with dcp-otel on; prints what the test checks, as JSON.

Spans go through a real BatchSpanProcessor to an exporter that keeps nothing;
metrics into a registry. Resident memory (from /proc) and Python's allocated blocks
are read after a warm-up, halfway and at the end, each once the builder, the
exporter and the spool are done (``dcp_otel.flush``, then the spool's confirming
thread idle), with the builder's peak backlog.
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

#: Cycles between two drains of the builder and the exporter.
DRAIN_EVERY = 50


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
            if i % DRAIN_EVERY == DRAIN_EVERY - 1:
                # Back to back, saves outrun the builder (a job saves minutes apart): its backlog, up to
                # ~1,200 operations of ~8 KiB here, grows the heap in whichever half it peaks. Drained
                # now and then, the backlog stays small and only a leak can grow the heap.
                dcp_otel.flush(tracer_provider=provider)

        def settled() -> tuple[int, int]:
            """Resident KiB and Python's allocated blocks, the builder and the exporter done, and the spool's
            confirming thread too: the spans it keeps until a flush confirms them (up to a second's, ~750 blocks
            here) would otherwise be counted or not by chance."""
            dcp_otel.flush(tracer_provider=provider)
            spool = dcp_otel.DCPInstrumentor()._spool
            if spool is not None and not spool.keep.wait_idle(30):  # (None: DCP_OTEL_SPOOL_DIR=off, no spool)
                raise RuntimeError("the spool's confirming thread was still busy after 30 s")
            gc.collect()
            return rss_kib(), sys.getallocatedblocks()

        for i in range(warmup):
            cycle(i)
        (before, blocks_before), series_before = settled(), series(registry)
        recorder = dcp_otel.DCPInstrumentor().recorder
        recorder.builder.peak_depth = 0
        for i in range(cycles // 2):
            cycle(i)
        middle, _ = settled()
        for i in range(cycles // 2, cycles):
            cycle(i)
        (after, blocks_after), series_after = settled(), series(registry)
    print(json.dumps({
        "cycles": cycles, "rss_before_kib": before, "rss_middle_kib": middle, "rss_after_kib": after,
        "blocks_before": blocks_before, "blocks_after": blocks_after, "builder_peak": recorder.builder.peak_depth,
        "series_before": series_before, "series_after": series_after,
        "open_spans": recorder.open_count(), "exported_spans": Discard.exported,
        "diagnostics": dcp_otel.diagnostics(),
    }))  # fmt: skip
    dcp_otel.uninstrument()
    provider.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
