"""A real OTLP/HTTP receiver on 127.0.0.1 that decodes what it gets.

It accepts ``POST /v1/traces`` and ``POST /v1/metrics`` (protobuf, optionally
gzip), decodes each body with ``opentelemetry-proto`` and keeps the spans, with
their resource attributes, and every metric as received, for the test to check.

Usage::

    with OtlpReceiver() as receiver:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        ...
        receiver.spans     # list of ReceivedSpan
        receiver.metrics   # list of ReceivedMetric, one per metric per request
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.message import Message
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric

from dcp_otel.otlp_file import FileSpan, spans_of

#: A decoded span, as dcp-otel's own OTLP decoding reads it.
ReceivedSpan = FileSpan


@dataclass
class ReceivedMetric:
    """One metric of one export request, with its resource's and scope's attributes."""

    resource: dict[str, Any]
    scope: str
    metric: Metric  # the decoded protobuf: name, unit, and one of histogram / sum / gauge


def value_of(value: AnyValue) -> Any:
    """The Python value of an OTLP ``AnyValue`` (scalars)."""
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind is not None else None


def attributes_of(pairs: Any) -> dict[str, Any]:
    """``{key: value}`` of repeated OTLP ``KeyValue``."""
    return {kv.key: value_of(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.metrics: list[ReceivedMetric] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                reply_message: Message
                if self.path == "/v1/traces":
                    receiver._add(ExportTraceServiceRequest.FromString(body))
                    reply_message = ExportTraceServiceResponse()
                elif self.path == "/v1/metrics":
                    receiver._add_metrics(ExportMetricsServiceRequest.FromString(body))
                    reply_message = ExportMetricsServiceResponse()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                reply = reply_message.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def _add(self, request: ExportTraceServiceRequest) -> None:
        with self._lock:
            self.requests += 1
            self.spans.extend(spans_of(request))

    def _add_metrics(self, request: ExportMetricsServiceRequest) -> None:
        received = [
            ReceivedMetric(attributes_of(rm.resource.attributes), sm.scope.name, metric)
            for rm in request.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
        ]
        with self._lock:
            self.requests += 1
            self.metrics.extend(received)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
