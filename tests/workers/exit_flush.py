"""A script that never flushes: ``exit_flush.py MODE OUT``.

The provider neither exports on its own (one-hour batch delay) nor shuts down
at exit (``shutdown_on_exit=False``): only dcp-otel's exit flush can get the
spans out. MODE ``file`` writes them to ``OUT/spans.jsonl``; MODE ``hung`` uses
an exporter that never returns, and the process must still exit (within
``$DCP_OTEL_FLUSH_TIMEOUT_S``); MODE ``hung-simple`` the same exporter through a
``SimpleSpanProcessor``, which exports on the thread that ends a span (``hung-simple-plain``:
the same job, not instrumented). An atexit hook registered before dcp-otel's runs
after it and prints the diagnostics.
"""

from __future__ import annotations

import atexit
import json
import sys
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

import dcp_otel


class HungExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        threading.Event().wait()  # a collector that never answers
        return SpanExportResult.SUCCESS


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    mode, out = sys.argv[1], Path(sys.argv[2])
    atexit.register(lambda: print(json.dumps(dcp_otel.diagnostics()), flush=True))
    spans_file = open(out / "spans.jsonl", "w")  # noqa: SIM115 - the process exits with it open
    exporter = HungExporter() if mode.startswith("hung") else ConsoleSpanExporter(
        out=spans_file, formatter=lambda s: s.to_json(indent=None) + "\n")  # fmt: skip
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter) if mode.startswith("hung-simple") else
                                BatchSpanProcessor(exporter, schedule_delay_millis=3_600_000))  # fmt: skip
    if not mode.endswith("-plain"):
        dcp_otel.instrument(tracer_provider=provider)
    dcp.async_save({"w": torch.ones(4)}, checkpoint_id=tempfile.mkdtemp()).result()
    # No dcp_otel.flush(), no provider.shutdown(): the upload span ends just
    # after result() returned, and everything is still queued.
