"""Reading a span's attributes from a file that can hold anything: a wrong type reads as absent, never as a traceback.

Usage::

    from dcp_otel.report.values import count, rank_of

    rank, written = rank_of(span), count(span, semconv.ATTR_BYTES_WRITTEN)
"""

from __future__ import annotations

from typing import Final

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan

#: The spans of a rank's operation (dcp.save, dcp.load, ...).
OPERATION_SPANS: Final = frozenset(semconv.span_name(op) for op in semconv.OPERATIONS)


def rank_of(span: FileSpan) -> int | None:
    rank = span.attributes.get(semconv.ATTR_RANK)
    return int(rank) if isinstance(rank, int) else None


def as_number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def count(span: FileSpan, key: str) -> int:
    """An integer attribute (bytes, a size), 0 when absent or not a number."""
    value = as_number(span.attributes.get(key))
    return int(value) if value is not None else 0


def as_list(value: object) -> list[object]:
    return list(value) if isinstance(value, (list, tuple)) else []


def collective_key(span: FileSpan) -> tuple[str, str]:
    """A collective span's method and torch's step ("" when DCP called it directly)."""
    return span.name.removeprefix(semconv.SPAN_COLLECTIVE_PREFIX), str(span.attributes.get(semconv.ATTR_COLLECTIVE_STEP) or "")


def collective_label(method: str, step: str) -> str:
    """How the report names a collective: ``gather_object (plan)``."""
    return f"{method} ({step})" if step else method


#: Resource attributes that say where a rank ran, most telling first: its host, then its pod or container.
_WHERE: Final = ("host.name", "k8s.pod.name", "container.id")


def where(span: FileSpan) -> str:
    """Where the span's process ran, from its resource: ``"node-7"``, ``"node-7/trainer-0-3"``; "" when unsaid.
    (A container id is cut to 12 characters, as ``docker ps`` shows it.)"""
    found = [str(v)[:12] if key == "container.id" else str(v) for key in _WHERE
             if isinstance(v := span.resource.get(key), (str, int)) and str(v)]  # fmt: skip
    return "/".join(found[:2])


def interference_of(span: FileSpan) -> tuple[int, float, float, float] | None:
    """(steps, usual step seconds, ratio, seconds lost) of an async save's interference, where all four are said."""
    said = [as_number(span.attributes.get(key)) for key in (semconv.ATTR_INTERFERENCE_STEPS, semconv.ATTR_USUAL_STEP,
                                                            semconv.ATTR_INTERFERENCE_RATIO,
                                                            semconv.ATTR_INTERFERENCE_LOST)]  # fmt: skip
    if any(v is None or v < 0 for v in said):
        return None
    steps, usual, ratio, lost = said
    return int(steps), float(usual), float(ratio), float(lost)  # type: ignore[arg-type]
