"""Light spans: the cheapest way to make a chosen span id current, checked once against the API.

A DCP step makes a non-recording span with a chosen id current while it
runs. Through OpenTelemetry's public functions that is some ten Python
frames (``get_current``, ``set_span_in_context``, ``attach``, ``detach`` and
``SpanContext.__new__``, which validates ids ours have by construction). When
the runtime context is the SDK's default (one ``ContextVar``), the same
operations go straight to that variable and to the tuple ``SpanContext`` is;
each shortcut is used only if, tried once at import, it gives exactly what the
public API gives. Otherwise the public functions are used.

Usage (what the tracker does for every step)::

    ctx = get_current()
    token = attach(with_span(ctx, NonRecordingSpan(span_context(trace_id, span_id, flags))))
    ...
    detach(token)
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation import _SPAN_KEY  # the key trace.get_current_span reads
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from dcp_otel.live.signal_exceptions import reraise_if_signalled

#: The key of the current span in a Context (read directly: ``ctx.get(SPAN_KEY)``).
SPAN_KEY = _SPAN_KEY


def _span_context_builder() -> Callable[[int, int, TraceFlags], SpanContext]:
    """``SpanContext(trace_id, span_id, False, flags)``, built as the tuple it is, if that is the same."""

    def fast(trace_id: int, span_id: int, flags: TraceFlags) -> SpanContext:
        return tuple.__new__(SpanContext, (trace_id, span_id, False, flags, DEFAULT_TRACE_STATE, True))

    def public(trace_id: int, span_id: int, flags: TraceFlags) -> SpanContext:
        return SpanContext(trace_id, span_id, False, flags)

    try:
        flags = TraceFlags(TraceFlags.SAMPLED)
        built, expected = fast(0x1234, 0x5678, flags), public(0x1234, 0x5678, flags)
        same = tuple(built) == tuple(expected) and built.is_valid and built.span_id == 0x5678
    except Exception as exc:  # noqa: BLE001 - an API that changed shape: use the constructor
        reraise_if_signalled(exc)
        same = False
    return fast if same else public


def _context_functions() -> tuple[Callable[[], Context], Callable[[Context], Any], Callable[[Any], None]]:
    """(get_current, attach, detach): the runtime context's ContextVar methods, or the public functions."""
    var = getattr(getattr(context_api, "_RUNTIME_CONTEXT", None), "_current_context", None)
    public = (context_api.get_current, context_api.attach, context_api.detach)
    if not isinstance(var, ContextVar):
        return public
    try:
        probe = Context({"dcp_otel.probe": 1})
        token = var.set(probe)
        same = context_api.get_current() is probe
        var.reset(token)
        same = same and context_api.get_current() is not probe
    except Exception as exc:  # noqa: BLE001
        reraise_if_signalled(exc)
        return public
    return (var.get, var.set, var.reset) if same else public


def with_span(ctx: Context, span: trace.Span) -> Context:
    """``trace.set_span_in_context(span, ctx)``, in one frame."""
    return Context({**ctx, SPAN_KEY: span})


span_context = _span_context_builder()
get_current, attach, detach = _context_functions()
__all__ = ["NonRecordingSpan", "SPAN_KEY", "attach", "detach", "get_current", "span_context", "with_span"]
