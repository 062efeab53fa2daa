"""A span exporter held at a gate: a collector down or hung for as long as a test says.

Usage::

    exporter = GatedExporter()               # every export waits for the gate (60 s at most, then fails)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    assert exporter.entered.wait(30)          # an export is stuck in it now
    exporter.gate.set()                       # the collector is back: that export and the next ones go out
    exporter.got                              # the spans it took, in order
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class GatedExporter(SpanExporter):
    """Takes spans only once ``gate`` is set; fails after 60 s, or at once where it ``refuses`` (a collector that
    answers with an error), or for its first ``fails`` exports (one that is back after them), or raises
    ``ConnectionError`` for its first ``raises`` (OTLP/HTTP before 1.45, no collector listening)."""

    def __init__(self, refuses: bool = False, fails: int = 0, raises: int = 0) -> None:
        self.gate, self.entered, self.refuses, self.fails = threading.Event(), threading.Event(), refuses, fails
        self.raises = raises
        self.got: list[ReadableSpan] = []
        self.exports = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.exports += 1
        if self.exports <= self.raises:
            raise ConnectionError("connection refused")
        if self.refuses or self.exports <= self.fails or not self.gate.wait(60):
            return SpanExportResult.FAILURE
        self.got.extend(spans)
        return SpanExportResult.SUCCESS
