"""A finished span as compact JSON and back: how the record keeps the spans its process built.

What the SDK's ``ReadableSpan`` holds (ids, parent, times, kind, status,
attributes, events, links), as one JSON list per span; :func:`decode` gives
back a ``ReadableSpan`` of the resource a survivor names (the dead
process's). The builder encodes each span as it ends it (so no span object
outlives its export), a survivor decodes the lines of ``spans.jsonl`` that no
exporter confirmed (:mod:`dcp_otel.spool.spans`).

Usage::

    item = encode(span)
    spans = decode_lines(text, exported_through, resource)
"""

from __future__ import annotations

import json
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags


def encode(span: ReadableSpan) -> list[Any]:
    """The compact JSON form of one finished span (what :func:`decode` reads back)."""
    ctx = span.context
    parent = span.parent
    status = span.status
    return [
        span.name, ctx.trace_id, ctx.span_id, parent.span_id if parent is not None else 0,
        int(ctx.trace_flags), span.start_time, span.end_time, span.kind.value, status.status_code.value,
        status.description, dict(span.attributes or {}),
        [[e.name, e.timestamp, dict(e.attributes or {})] for e in span.events],
        [[link.context.trace_id, link.context.span_id, int(link.context.trace_flags), dict(link.attributes or {})]
         for link in span.links],
        bool(parent.is_remote) if parent is not None else False,
    ]  # fmt: skip


def _attributes(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {}
    return {str(k): tuple(v) if isinstance(v, list) else v for k, v in value.items()}


def decode(item: list[Any], resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    """A span :func:`encode` wrote, as a ``ReadableSpan`` of ``resource`` (raises on a malformed item)."""
    (name, trace_id, span_id, parent_id, flags, start, end, kind, code, description, attributes, events, links,
     remote) = item  # fmt: skip
    context = SpanContext(int(trace_id), int(span_id), False, TraceFlags(int(flags)))
    parent = SpanContext(int(trace_id), int(parent_id), bool(remote), TraceFlags(int(flags))) if parent_id else None
    return ReadableSpan(
        name=str(name), context=context, parent=parent, resource=resource, attributes=_attributes(attributes),
        events=[Event(str(n), _attributes(a), int(t)) for n, t, a in events],
        links=[Link(SpanContext(int(t), int(s), False, TraceFlags(int(f))), _attributes(a)) for t, s, f, a in links],
        kind=SpanKind(int(kind)), status=Status(StatusCode(int(code)), description),
        start_time=int(start), end_time=int(end), instrumentation_scope=scope,
    )  # fmt: skip


def decode_lines(text: str, exported_through: int, resource: Resource, damaged: list[str] | None = None) -> list[ReadableSpan]:
    """The spans of ``spans.jsonl`` after the mark ``exported_through``; a line cut by the death is skipped."""
    spans: list[ReadableSpan] = []
    for line in text.splitlines():
        try:
            seq, scope, items = json.loads(line)
            if int(seq) <= exported_through:
                continue
            found = InstrumentationScope(str(scope[0]), str(scope[1]) if scope[1] else None)
            spans.extend(decode(item, resource, found) for item in items)
        except (ValueError, TypeError, KeyError, IndexError):
            if damaged is not None:
                damaged.append(line[:80])
    return spans


def decode_sent_lines(text: str, exported_through: int, resource: Resource) -> tuple[list[ReadableSpan], int]:
    """The spans of a live process's ``spans.jsonl`` after the mark, and the last line's number they reach. A last
    line with no newline yet is the one its process is writing now: read next time; a damaged whole line is skipped."""
    spans: list[ReadableSpan] = []
    through = exported_through
    lines = text.split("\n")[:-1]  # (what follows the last newline is not whole yet)
    for line in lines:
        try:
            if int(line[1 : line.index(",")]) <= exported_through:  # (sent: read no further, every look)
                continue
            seq, scope, items = json.loads(line)
            found = InstrumentationScope(str(scope[0]), str(scope[1]) if scope[1] else None)
            decoded = [decode(item, resource, found) for item in items]
        except (ValueError, TypeError, KeyError, IndexError):
            continue
        spans.extend(decoded)
        through = max(through, int(seq))
    return spans, through
