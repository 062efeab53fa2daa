"""Read spans the way the tests check them: from files written by real exporters.

``ConsoleSpanExporter`` with ``ReadableSpan.to_json`` writes one JSON object per
line; :func:`load_spans` turns those into :class:`SpanRecord` values, and
:func:`from_readable` does the same for spans held by an in-memory exporter, so
single-process and multi-process tests assert on one shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan


@dataclass(frozen=True)
class SpanRecord:
    name: str
    trace_id: str  # 32 lowercase hex digits
    span_id: str  # 16 lowercase hex digits
    parent_id: str | None
    start_ns: int
    end_ns: int
    status: str  # UNSET, OK, ERROR
    status_description: str | None
    attributes: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return int(self.attributes["dcp.rank"])


def _hex(value: str | None) -> str | None:
    return None if value is None else value.removeprefix("0x")


def _iso_to_ns(text: str) -> int:
    from datetime import datetime

    # to_json writes e.g. 2026-11-22T08:20:00.123456Z (microseconds)
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1e9)


def load_spans(paths: Iterable[Path]) -> list[SpanRecord]:
    spans = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            raw = json.loads(line)
            spans.append(
                SpanRecord(
                    name=raw["name"],
                    trace_id=_hex(raw["context"]["trace_id"]),
                    span_id=_hex(raw["context"]["span_id"]),
                    parent_id=_hex(raw["parent_id"]),
                    start_ns=_iso_to_ns(raw["start_time"]),
                    end_ns=_iso_to_ns(raw["end_time"]),
                    status=raw["status"]["status_code"],
                    status_description=raw["status"].get("description"),
                    attributes=raw["attributes"],
                    events=raw["events"],
                    links=[
                        {"trace_id": _hex(link["context"]["trace_id"]), "span_id": _hex(link["context"]["span_id"]),
                         "attributes": link["attributes"]}  # fmt: skip
                        for link in raw["links"]
                    ],
                )
            )
    return spans


def from_readable(spans: Iterable[ReadableSpan]) -> list[SpanRecord]:
    return [
        SpanRecord(
            name=s.name,
            trace_id=format(s.context.trace_id, "032x"),
            span_id=format(s.context.span_id, "016x"),
            parent_id=None if s.parent is None else format(s.parent.span_id, "016x"),
            start_ns=s.start_time,
            end_ns=s.end_time,
            status=s.status.status_code.name,
            status_description=s.status.description,
            attributes=dict(s.attributes),
            events=[{"name": e.name, "attributes": dict(e.attributes)} for e in s.events],
            links=[
                {"trace_id": format(link.context.trace_id, "032x"), "span_id": format(link.context.span_id, "016x"),
                 "attributes": dict(link.attributes)}  # fmt: skip
                for link in s.links
            ],
        )
        for s in spans
    ]


def by_trace(spans: Iterable[SpanRecord]) -> dict[str, list[SpanRecord]]:
    traces: dict[str, list[SpanRecord]] = {}
    for span in spans:
        traces.setdefault(span.trace_id, []).append(span)
    return traces


def named(spans: Iterable[SpanRecord], name: str) -> list[SpanRecord]:
    return [s for s in spans if s.name == name]
