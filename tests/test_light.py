"""Light spans: the shortcuts the hot path takes give exactly what OpenTelemetry's API gives."""

from __future__ import annotations

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from dcp_otel.tracing import light

FLAGS = TraceFlags(TraceFlags.SAMPLED)


def test_a_light_span_context_is_the_apis_span_context() -> None:
    made, expected = light.span_context(0xABC, 0x123, FLAGS), SpanContext(0xABC, 0x123, False, FLAGS)
    assert type(made) is SpanContext and made == expected and made.is_valid and not made.is_remote
    assert made.trace_state == expected.trace_state and made.trace_flags.sampled


def test_a_light_span_made_current_is_what_the_api_reads_as_the_current_span() -> None:
    token = light.attach(light.with_span(light.get_current(), NonRecordingSpan(light.span_context(0xABC, 0x456, FLAGS))))
    try:
        current = trace.get_current_span()
        assert current.get_span_context().span_id == 0x456 and current.get_span_context().trace_id == 0xABC
        assert context_api.get_current() is light.get_current()
    finally:
        light.detach(token)
    assert trace.get_current_span() is trace.INVALID_SPAN
