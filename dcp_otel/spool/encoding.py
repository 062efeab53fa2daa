"""A finished span as compact JSON and back: how the record keeps the spans its process built.

What the SDK's ``ReadableSpan`` holds (ids, parent, times, kind, status,
attributes, events, links), as one JSON list per span; :func:`decode` gives
back a ``ReadableSpan`` of the resource a survivor names (the dead
process's). The builder encodes each span as it ends it (so no span object
outlives its export), a survivor decodes the lines of ``spans.jsonl`` that no
exporter confirmed (:mod:`dcp_otel.spool.spans`).

Usage::

    item = encode(span)          # or encode_parts(name, trace_id, span_id, ...) where no SDK span was made
    spans = decode_lines(text, exported_through, resource)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags


def encode_parts(name: str, trace_id: int, span_id: int, flags: int, parent: SpanContext | None,
                 start_ns: int | None, end_ns: int | None, kind: SpanKind, status: StatusCode, description: str | None,
                 attributes: Mapping[str, Any], events: list[list[Any]], links: Sequence[Link]) -> list[Any]:  # fmt: skip
    """The compact JSON form of one finished span, from its parts (``events``: ``[name, time, attributes]`` each): the
    one place the form is written, for an SDK span (:func:`encode`) and for one built with no SDK span."""
    return [
        name, trace_id, span_id, parent.span_id if parent is not None else 0, flags, start_ns, end_ns, kind.value,
        status.value, description, attributes, events,
        [[link.context.trace_id, link.context.span_id, int(link.context.trace_flags), dict(link.attributes or {})]
         for link in links],
        bool(parent.is_remote) if parent is not None else False,
    ]  # fmt: skip


def encode(span: ReadableSpan) -> list[Any]:
    """The compact JSON form of one finished span (what :func:`decode` reads back)."""
    status = span.status
    ctx = span.context
    return encode_parts(span.name, ctx.trace_id, ctx.span_id, int(ctx.trace_flags), span.parent, span.start_time,
                        span.end_time, span.kind, status.status_code, status.description, dict(span.attributes or {}),
                        [[e.name, e.timestamp, dict(e.attributes or {})] for e in span.events], span.links)  # fmt: skip


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
    """The spans of a dead process's ``spans.jsonl`` after the mark ``exported_through``; a line cut by the death is
    skipped (and added to ``damaged``)."""
    return _decode(text.splitlines(), exported_through, resource, damaged)[0]


def decode_sent_lines(text: str, exported_through: int, resource: Resource) -> tuple[list[ReadableSpan], int]:
    """The spans of a live process's ``spans.jsonl`` after the mark, and the last line's number they reach. A last
    line with no newline yet is the one its process is writing now: read next time; a damaged whole line is skipped."""
    return _decode(text.split("\n")[:-1], exported_through, resource, None)  # (after the last newline: not whole yet)


def _decode(lines: list[str], exported_through: int, resource: Resource,
            damaged: list[str] | None) -> tuple[list[ReadableSpan], int]:  # fmt: skip
    spans: list[ReadableSpan] = []
    through = exported_through
    for line in lines:
        try:
            if int(line[1 : line.index(",")]) <= exported_through:  # (a line is "[seq, ...": sent, read no further)
                continue
            seq, scope, items = json.loads(line)
            found = InstrumentationScope(str(scope[0]), str(scope[1]) if scope[1] else None)
            decoded = [decode(one, resource, found) for one in items]
        except (ValueError, TypeError, KeyError, IndexError):
            if damaged is not None:
                damaged.append(line[:80])
            continue
        spans.extend(decoded)
        through = max(through, int(seq))
    return spans, through
