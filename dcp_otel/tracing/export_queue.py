"""Count the spans the OpenTelemetry SDK drops because its export queue is full.

The SDK's ``BatchSpanProcessor`` keeps at most ``max_queue_size`` spans
(``OTEL_BSP_MAX_QUEUE_SIZE``, 2048 by default). When the exporter falls behind
(a slow, dead or hung collector), every new span is dropped. The SDK logs a
warning for each (thinned by its own duplicate filter to one per 20 s), but
counts nothing, unless ``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED`` is set and
an OTel MeterProvider is configured (its ``otel.sdk.processor.span.processed``),
which a Prometheus-scraped job may not have.

While dcp-otel is instrumented, a filter placed *before* the SDK's duplicate
filter sees every one of those warnings and turns it into a count,
``dcp_otel.diagnostics()["span_queue_full"]``, plus one warning a minute.
Warnings about other telemetry (the same batch processor carries logs) pass
untouched. SDKs older than 1.34 warn once when the queue first fills; that is
counted as one.

Usage (what :class:`dcp_otel.DCPInstrumentor` does)::

    watch = QueueFullWatch()
    ...
    watch.remove()
"""

from __future__ import annotations

import logging

from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled

#: Where the SDK's batch processor logs: the shared processor of SDK >= 1.34,
#: and the span processor's own module before it.
SDK_LOGGERS = ("opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export")
REASON = "span_queue_full"


def is_span_queue_full(record: logging.LogRecord) -> bool:
    """Whether ``record`` is the SDK saying it dropped a span (or, older SDKs, is about to)."""
    msg = record.msg
    if not isinstance(msg, str) or not msg.startswith(("Queue full", "Queue is full")):
        return False
    # The shared processor names what it drops ("Span", "Log"); older SDKs only had spans.
    args = record.args
    return not args or (isinstance(args, tuple) and args[0] == "Span")


class _QueueFullFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            if is_span_queue_full(record):
                report(
                    REASON,
                    "the OpenTelemetry SDK's span queue is full and drops spans: the exporter is slow, down or hung",
                )
                return False  # counted and logged (rate-limited) above, instead of one line per span
        except Exception as exc:  # noqa: BLE001 - a logging filter must not raise either
            reraise_if_signalled(exc)
        return True


class QueueFullWatch:
    """The filter on the SDK's loggers, from construction to :meth:`remove`."""

    def __init__(self) -> None:
        self._filter = _QueueFullFilter()
        for name in SDK_LOGGERS:
            # First in line: the SDK's own duplicate filter would hide all but one drop in 20 s.
            logging.getLogger(name).filters.insert(0, self._filter)

    def remove(self) -> None:
        for name in SDK_LOGGERS:
            logging.getLogger(name).removeFilter(self._filter)
