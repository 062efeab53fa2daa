"""Emit one operation's spans through the SDK with the ids its calls were given on the hot path.

The builder (:mod:`dcp_otel.tracing.builder`) hands each finished operation's
calls here, one span each, with their recorded start and end times. Spans keep
the ids chosen as their calls started, so a span a storage plugin started inside
a step nests under that step's; through a tracer that is not the SDK's, spans get
that tracer's ids and their parents are the spans emitted here.

Usage::

    emit = Emitter(op, chosen_ids_tracer(op.tracer), ended=[])
    emit.root({})
    for call in calls:
        emit.span(call, None)
    keep(emit.ended)   # encoded as they ended, kept until an exporter confirms them

    emit = DirectEmitter(op, ended=[])   # the same lines, with no SDK span: for the node's exporter
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode

from dcp_otel import semconv
from dcp_otel.spool.encoding import encode, encode_parts
from dcp_otel.tracing.records import KIND_COLLECTIVE, KIND_OPERATION, MAX_STATUS_TEXT, Call, Operation
from dcp_otel.tracing.trace_ids import DerivedIds, start_root_span, start_span_with_ids

#: The attributes a summary-only operation span keeps of its operation's.
_SUMMARY_ONLY_KEEP = (semconv.ATTR_OPERATION, semconv.ATTR_RANK, semconv.ATTR_INTERFERENCE_STEPS,
                      semconv.ATTR_USUAL_STEP, semconv.ATTR_INTERFERENCE_RATIO, semconv.ATTR_INTERFERENCE_LOST)  # fmt: skip


class Emitter:
    """Emits one operation's spans through its tracer, with the ids chosen on the hot path."""

    def __init__(self, op: Operation, twin: Any, ended: list[list[Any]] | None = None) -> None:
        self.op = op
        self.twin = twin
        self.ended = ended  # the spans emitted, encoded as they end, where they are kept until exported
        # Without chosen ids (a tracer that is not the SDK's): parents by the spans we emitted.
        self.emitted: dict[int, SpanContext] = {}

    def _start(self, name: str, span_id: int, parent: SpanContext | None, **kwargs: Any) -> trace.Span:
        op = self.op
        if self.twin is not None:
            tracer, overrides = self.twin
            ids = DerivedIds(op.trace_id, span_id)
            if parent is None:
                return start_root_span(tracer, overrides, ids, name, Context(), **kwargs)
            parent_ctx = trace.set_span_in_context(NonRecordingSpan(parent))
            return start_span_with_ids(tracer, overrides, ids, name, parent_ctx, **kwargs)
        # A tracer that is not the SDK's: the spans get its own ids, parents by the spans emitted here.
        parent = self.emitted.get(parent.span_id, parent) if parent is not None else trace.INVALID_SPAN_CONTEXT
        span = op.tracer.start_span(name, context=trace.set_span_in_context(NonRecordingSpan(parent)), **kwargs)
        self.emitted[span_id] = span.get_span_context()
        return span

    def root(self, extra: dict[str, int | float]) -> None:
        op = self.op
        links = [Link(op.caller, {semconv.ATTR_LINK_KIND: semconv.LINK_CALLER})] if op.caller is not None else []
        attributes = {**op.attributes, **extra} if extra else op.attributes
        span = self._start(semconv.SPAN_CHECKPOINT, op.root_span_id, None, attributes=attributes, links=links,
                           start_time=op.start_ns)  # fmt: skip
        if op.failed:
            span.set_status(Status(StatusCode.ERROR, op.failed[:MAX_STATUS_TEXT]))
        span.end(end_time=op.end_ns)
        if self.ended is not None and isinstance(span, ReadableSpan):
            self.ended.append(encode(span))

    def span(self, call: Call, summary: dict[str, object] | None) -> None:
        attributes, links = span_attributes(self.op, call, summary)
        failure = call.failure
        span = self._start(call.name, call.span_id, call.parent_context, attributes=attributes, links=links,
                           start_time=call.start_ns)  # fmt: skip
        if failure is not None:
            span.add_event("exception", failure.event, timestamp=call.end_ns)
            span.set_status(Status(StatusCode.ERROR, failure.description[:MAX_STATUS_TEXT]))
        span.end(end_time=call.end_ns)
        if self.ended is not None and isinstance(span, ReadableSpan):
            self.ended.append(encode(span))


def span_attributes(op: Operation, call: Call, summary: dict[str, object] | None) -> tuple[dict[str, Any], list[Link]]:
    """One call's span attributes and links (what both emitters give it)."""
    is_op = call.kind == KIND_OPERATION
    summary_only = bool(summary) and summary[semconv.ATTR_DETAIL] == semconv.DETAIL_SUMMARY  # type: ignore[index]
    if summary_only:
        # A summary-only rank (most ranks of a large job): only what differs per rank;
        # what every rank shares (checkpoint id, run id, classes) is on the root and on
        # the detailed ranks' spans of the same trace.
        attributes: dict[str, Any] = {k: op.attributes[k] for k in _SUMMARY_ONLY_KEEP if k in op.attributes}
    else:
        attributes = dict(op.attributes if is_op else call.attributes)
    if summary:
        attributes.update(summary)
    if call.extra:
        attributes.update(call.extra)
        if summary_only:  # its bytes over its write_data's (read_data's) seconds, both on the span: 46 B
            attributes.pop(semconv.ATTR_THROUGHPUT, None)
    if call.sent_bytes:  # a collective's (a class default of 0 on every other call)
        attributes[semconv.ATTR_COLLECTIVE_SENT_BYTES] = call.sent_bytes
    if call.received_bytes:
        attributes[semconv.ATTR_COLLECTIVE_RECEIVED_BYTES] = call.received_bytes
    if call.keys is not None:
        attributes.update(call.keys.to_attributes())
    if call.summary is not None:
        attributes.update(call.summary.to_attributes())
    failure = call.failure
    if failure is not None and failure.failed_ranks is not None:
        attributes[semconv.ATTR_FAILED_RANKS] = failure.failed_ranks
    if call.inferred:
        attributes[semconv.ATTR_END_INFERRED] = True
    if failure is not None and failure.in_collective and call.kind != KIND_COLLECTIVE:
        attributes[semconv.ATTR_FAILED_IN_COLLECTIVE] = True
    links = []
    if is_op and op.caller is not None:
        links.append(Link(op.caller, {semconv.ATTR_LINK_KIND: semconv.LINK_CALLER}))
    return attributes, links


#: Attribute values kept as they are (anything else is cleaned as the SDK would: a sequence as a list, None dropped,
#: another object as its text).
_PLAIN = frozenset({str, int, float, bool})


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    if all(type(value) in _PLAIN for value in attributes.values()):
        return dict(attributes)
    cleaned: dict[str, Any] = {}
    for key, value in attributes.items():
        if type(value) in _PLAIN:
            cleaned[key] = value
        elif isinstance(value, (list, tuple)):
            cleaned[key] = [v if type(v) in _PLAIN else str(v) for v in value]
        elif value is not None:
            cleaned[key] = str(value)
    return cleaned


class DirectEmitter:
    """One operation's spans written straight in the record's form (:func:`dcp_otel.spool.encoding.encode`'s), with
    the ids chosen on the hot path and no SDK span: the node's exporter sends them (``span_export="node"``)."""

    def __init__(self, op: Operation, ended: list[list[Any]]) -> None:
        self.op = op
        self.ended = ended
        self._flags = int(op.flags)

    def _add(self, name: str, span_id: int, parent: SpanContext | None, attributes: Mapping[str, Any],
             links: list[Link], start_ns: int, end_ns: int, error: str | None,
             events: list[list[Any]]) -> None:  # fmt: skip
        self.ended.append(encode_parts(name, self.op.trace_id, span_id, self._flags, parent, start_ns, end_ns,
                                       SpanKind.INTERNAL, StatusCode.ERROR if error is not None else StatusCode.UNSET,
                                       error, _clean(attributes), events, links))  # fmt: skip

    def root(self, extra: dict[str, int | float]) -> None:
        op = self.op
        links = [Link(op.caller, {semconv.ATTR_LINK_KIND: semconv.LINK_CALLER})] if op.caller is not None else []
        attributes = {**op.attributes, **extra} if extra else op.attributes
        self._add(semconv.SPAN_CHECKPOINT, op.root_span_id, None, attributes, links, op.start_ns, op.end_ns,
                  op.failed[:MAX_STATUS_TEXT] if op.failed else None, [])  # fmt: skip

    def span(self, call: Call, summary: dict[str, object] | None) -> None:
        attributes, links = span_attributes(self.op, call, summary)
        failure = call.failure
        events = [["exception", call.end_ns, _clean(failure.event)]] if failure is not None else []
        self._add(call.name, call.span_id, call.parent_context, attributes, links, call.start_ns, call.end_ns,
                  failure.description[:MAX_STATUS_TEXT] if failure is not None else None, events)  # fmt: skip
