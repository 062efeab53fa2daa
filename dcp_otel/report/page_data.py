"""What the HTML page's script draws from: every span of every checkpoint, compactly, and which ranks to show.

A checkpoint of 1,024 ranks is about 6,000 spans, and a page holds every one of
them (a click on any bar shows that span's attributes; a search can bring any rank
back), so the data is tables, not objects:

* strings (span names, error texts, exception texts) and attribute sets are
  interned once per page; what every span of a checkpoint shares (checkpoint id,
  operation, classes, run id) is stored once per checkpoint, and the rank is the
  row's own;
* a span is one row: ``[rank, name, depth, start_ms, dur_ms, kind, error, attrs,
  span_id, exception]`` (indexes into the tables, ``-1`` for none).

Which ranks a timeline shows first: every rank of a checkpoint of up to
:data:`FOLD_ABOVE` ranks; of a wider one, the ranks worth reading (the
coordinator, the failed, the straggler, the unfinished, the slowest few, any rank
with an error of its own) as lanes, and the rest as up to :data:`BANDS` bands of
alike ranks (by their own work, in equal shares), each drawn as the spread of its
ranks and expandable. The compare view reads per-step and per-rank statistics.

Usage::

    data = page_data(checkpoints(spans), trace_url="https://grafana.example/explore?traceId={trace_id}")
    json.dumps(data)      # what render() embeds
"""

from __future__ import annotations

import json
from typing import Any, Final

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan
from dcp_otel.report.model import Checkpoint

#: A checkpoint with more ranks than this folds its ordinary ranks into bands.
FOLD_ABOVE: Final = 32
#: Bands a folded checkpoint's ordinary ranks are split into, and the slowest ranks shown as lanes.
BANDS: Final = 6
SLOWEST: Final = 5
#: Bar kinds, as the page colours them.
KINDS: Final = ("operation", "io", "upload", "other", "stall", "collective")
_OPERATION_SPANS: Final = frozenset(semconv.span_name(op) for op in semconv.OPERATIONS)
#: Where a trace template puts the ids.
TRACE_ID: Final = "{trace_id}"
SPAN_ID: Final = "{span_id}"


def kind(name: str) -> str:
    """How a span's bar is coloured: the operation, a step that moves bytes, the upload, a stall, one of DCP's
    collectives (waiting for the others), the rest."""
    if semconv.is_collective_span(name):
        return "collective"
    step = name.removeprefix(semconv.SPAN_PREFIX)
    if step in semconv.IO_STEPS:
        return "io"
    if name in (semconv.SPAN_ASYNC_UPLOAD, semconv.SPAN_ASYNC_STAGING):
        return "upload"
    if name == semconv.SPAN_STALL:
        return "stall"
    if step in semconv.OPERATIONS:
        return "operation"
    return "other"


class _Interned:
    """Values stored once, referred to by index."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self._index: dict[str, int] = {}

    def __call__(self, value: Any) -> int:
        key = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
        found = self._index.get(key)
        if found is None:
            found = self._index[key] = len(self.values)
            self.values.append(value)
        return found


def check_trace_url(template: str | None) -> str | None:
    """``template`` if it names where the trace id goes (``{trace_id}``); raises ``ValueError`` otherwise."""
    if template is not None and TRACE_ID not in template:
        raise ValueError(f"--trace-url must contain {TRACE_ID} (and may contain {SPAN_ID}), got {template!r}")
    return template


def page_data(checkpoints: list[Checkpoint], trace_url: str | None = None) -> dict[str, Any]:
    """Everything the page's script needs (see the module)."""
    names, strings, attrs = _Interned(), _Interned(), _Interned()
    found = [_checkpoint(i, c, names, strings, attrs) for i, c in enumerate(checkpoints)]
    return {"traceUrl": check_trace_url(trace_url), "kinds": list(KINDS), "names": names.values,
            "strings": strings.values, "attrs": attrs.values, "checkpoints": found}  # fmt: skip


def _checkpoint(index: int, ckpt: Checkpoint, names: _Interned, strings: _Interned, attrs: _Interned) -> dict[str, Any]:
    spans = list(ckpt.rank_spans())
    common = _common([span for _, span, _ in spans])
    rows = []
    for rank, span, ancestors in spans:
        own = {k: v for k, v in span.attributes.items() if k != semconv.ATTR_RANK and (k not in common or common[k] != v)}
        rows.append([
            rank, names(span.name.removeprefix(semconv.SPAN_PREFIX)), len(ancestors),
            round((span.start_ns - ckpt.start_ns) / 1e6, 3), round(max(0, span.end_ns - span.start_ns) / 1e6, 3),
            KINDS.index(kind(span.name)), strings(span.status_message) if span.error else -1,
            attrs(own) if own else -1, span.span_id, _exception(span, strings),
        ])  # fmt: skip
    lanes, bands = fold(ckpt)
    status = "unfinished" if ckpt.is_unfinished else "failed" if ckpt.error else "ok"
    return {
        "index": index, "operation": ckpt.operation, "id": ckpt.checkpoint_id, "trace": ckpt.trace_id,
        "status": status, "straggler": ckpt.straggler, "failed": ckpt.failed_ranks, "origins": ckpt.origins,
        "unfinished": [u.rank for u in ckpt.unfinished], "duration_ms": (ckpt.end_ns - ckpt.start_ns) / 1e6,
        "common": attrs(common), "lanes": lanes, "bands": bands, "spans": rows,
        "steps": [[s.name, s.median_s, s.by_rank[s.slowest_rank], s.slowest_rank] for s in ckpt.steps],
        "ranks": [[r.rank, r.duration_s, r.busy_s, r.wait_s, r.bytes, r.throughput_bps or 0.0] for r in ckpt.ranks],
    }  # fmt: skip


def _exception(span: FileSpan, strings: _Interned) -> int:
    if not span.exception and not span.stacktrace:
        return -1
    text = span.exception or ""
    if span.stacktrace:
        text += ("\n\n" if text else "") + span.stacktrace
    return strings(text)


def _common(spans: list[FileSpan]) -> dict[str, Any]:
    """The attributes (with their values) every one of ``spans`` has."""
    if not spans:
        return {}
    common = {k: v for k, v in spans[0].attributes.items() if k != semconv.ATTR_RANK and not isinstance(v, (list, dict))}
    for span in spans[1:]:
        attributes = span.attributes
        common = {k: v for k, v in common.items() if k in attributes and attributes[k] == v}
        if not common:
            break
    return common


def fold(ckpt: Checkpoint) -> tuple[list[int], list[dict[str, Any]]]:
    """The ranks shown as lanes, and the bands the others fold into (see the module)."""
    ranks = sorted({r.rank for r in ckpt.ranks} | {u.rank for u in ckpt.unfinished})
    if len(ranks) <= FOLD_ABOVE:
        return ranks, []
    work = {r.rank: r.work_s for r in ckpt.ranks}
    slowest = sorted(work, key=lambda r: (-work[r], r))[:SLOWEST]
    own_errors = [r.rank for r in ckpt.ranks if r.error and not r.error.startswith("CheckpointException")]
    keep = {ranks[0], *ckpt.failed_ranks, *ckpt.origins, *slowest, *own_errors, *(u.rank for u in ckpt.unfinished)}
    if ckpt.straggler is not None:
        keep.add(ckpt.straggler)
    rest = sorted((r for r in ranks if r not in keep), key=lambda r: (work.get(r, 0.0), r))
    bands = []
    count = min(BANDS, len(rest))
    for n in range(count):
        members = rest[n * len(rest) // count : (n + 1) * len(rest) // count]
        seconds = [work.get(r, 0.0) for r in members]
        bands.append({"ranks": sorted(members), "work": [min(seconds), max(seconds)]})
    return sorted(keep), bands
