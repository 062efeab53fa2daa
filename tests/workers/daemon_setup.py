"""A ``DCP_OTEL_PROCESS_SETUP`` hook: the exporter the test's rank configured in code.

Runs in torch's async checkpoint daemon; the endpoint comes from a variable
only this test sets (no ``OTEL_*`` variable names it).
"""

from __future__ import annotations

import os

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor


def provider() -> TracerProvider:
    endpoint = os.environ["TEST_DAEMON_OTLP"]
    result = TracerProvider(resource=Resource.create({"service.name": "process-async-daemon"}))
    result.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
    return result
