"""The report as a Chrome trace (JSON Object Format), which Perfetto and chrome://tracing open.

PyTorch users open ``torch.profiler`` traces the same way. One process per
rank, named with the host it ran on (and its pod or container, where the
resource says); the rank's operation and steps on one thread, each async
upload (which outlives its call) on a second, so every thread's events nest
properly. Each event's args hold every attribute of its span, its ids and its
exception. Linear in the spans: what looks at every rank runs once per checkpoint.

Usage::

    json.dump(render(checkpoints(spans)), open("trace.json", "w"))
"""

from __future__ import annotations

from typing import Any

from dcp_otel import semconv
from dcp_otel.report.model import Checkpoint
from dcp_otel.report.values import where

_MAIN, _UPLOAD = 0, 1


def render(checkpoints: list[Checkpoint]) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    ranks: dict[int, str] = {}  # rank -> where it ran
    for ckpt in checkpoints:
        straggler = ckpt.straggler  # once per checkpoint: it looks at every rank
        for rank, span, ancestors in ckpt.rank_spans():
            if not ranks.get(rank):
                ranks[rank] = where(span)
            under_upload = any(s.name == semconv.SPAN_ASYNC_UPLOAD for s in (span, *ancestors))
            tid = _UPLOAD if under_upload else _MAIN
            events.append({
                "name": span.name.removeprefix(semconv.SPAN_PREFIX), "cat": ckpt.operation, "ph": "X",
                "ts": span.start_ns / 1000, "dur": max(0.0, (span.end_ns - span.start_ns) / 1000),
                "pid": rank, "tid": tid,
                # Everything the span carries (its attributes, its exception), and what the report adds.
                "args": {**span.attributes, "trace_id": ckpt.trace_id, "span_id": span.span_id,
                         "checkpoint_id": ckpt.checkpoint_id, "error": span.status_message if span.error else None,
                         **({"exception": span.exception} if span.exception else {}),
                         **({"exception.stacktrace": span.stacktrace} if span.stacktrace else {}),
                         "straggler": rank == straggler},
            })  # fmt: skip
    for rank, host in sorted(ranks.items()):
        name = f"rank {rank} ({host})" if host else f"rank {rank}"
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": _MAIN, "args": {"name": "checkpoint"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": _UPLOAD, "args": {"name": "async upload"}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"producer": "dcp-otel report"}}
