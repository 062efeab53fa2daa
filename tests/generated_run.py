"""A large run's trace files, generated: many checkpoints on many ranks, with known answers.

Writes OTLP JSON (one request per line, one file per rank), in the shape dcp-otel
exports with ``detail="full"``: per checkpoint one root on rank 0, each rank's
operation span and its steps (an async save's background save under its
upload). The answers: ``SLOW`` is the straggler of every checkpoint but every
tenth (where nobody stands out); checkpoint ``FAILED_AT`` fails on rank
``FAILING`` with a known error; durations grow steadily over the run.

Usage::

    write_run(tmp_path, checkpoints=500, ranks=64)     # the folder holds rank-*.jsonl
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SLOW = 7
FAILING = 5
FAILED_AT = 123
ERROR = "OSError: [Errno 28] No space left on device: '/ckpt/step-1230/__5_0.distcp'"
OPERATIONS = ("save", "async_save", "save", "load")
START_NS = 1_800_000_000_000_000_000
MB = 1 << 20


def _id(*parts: object, size: int = 8) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[: size * 2]


def _attrs(values: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, value in values.items():
        if isinstance(value, list):
            v: dict[str, Any] = {"arrayValue": {"values": [{"intValue": str(x)} for x in value]}}
        elif isinstance(value, bool):
            v = {"boolValue": value}
        elif isinstance(value, int):
            v = {"intValue": str(value)}
        else:
            v = {"stringValue": str(value)}
        out.append({"key": key, "value": v})
    return out


def _span(trace: str, span: str, parent: str, name: str, start: int, end: int, attrs: dict[str, Any],
          error: str | None = None) -> dict[str, Any]:  # fmt: skip
    record: dict[str, Any] = {
        "traceId": trace, "spanId": span, "parentSpanId": parent, "name": name, "kind": 1,
        "startTimeUnixNano": str(start), "endTimeUnixNano": str(end), "attributes": _attrs(attrs),
        "status": {"code": 2, "message": error} if error else {},
    }  # fmt: skip
    if error:
        record["events"] = [{"name": "exception", "timeUnixNano": str(end),
                             "attributes": _attrs({"exception.message": error + " (full text)"})}]  # fmt: skip
    return record


def write_run(folder: Path, checkpoints: int = 500, ranks: int = 64) -> Path:
    """Write the run's rank files into ``folder``; return it."""
    folder.mkdir(parents=True, exist_ok=True)
    per_rank: list[list[dict[str, Any]]] = [[] for _ in range(ranks)]
    t = START_NS
    for c in range(checkpoints):
        operation = OPERATIONS[c % len(OPERATIONS)]
        trace, root = _id("trace", c, size=16), _id("root", c)
        io = 0.05 + 0.0001 * c  # the run slows down, steadily
        straggles = c % 10 != 0
        failed = c == FAILED_AT
        common = {"dcp.operation": operation, "dcp.checkpoint_id": f"/ckpt/step-{c * 10}", "dcp.world_size": ranks}
        ends = []
        for r in range(ranks):
            base = {**common, "dcp.rank": r}
            mine = io * (25 if straggles and r == SLOW else 1)
            spans = per_rank[r]
            op_id, start = _id("op", c, r), t + 1000 * r
            cursor = start + 1_000_000
            steps = [("local_step", 0.001), ("global_step", 0.001)]
            io_step = "read_data" if operation == "load" else "write_data"
            if operation == "async_save":
                stage = _id("stage", c, r)
                spans.append(_span(trace, stage, op_id, "dcp.stage_state_dict", cursor, cursor + 2_000_000, base))
                cursor += 2_000_000
                op_end = cursor + 500_000
                upload, bg = _id("upload", c, r), _id("bg", c, r)
                u_start = cursor
                b_cursor = u_start + 100_000
                for name, seconds in [*steps, (io_step, mine)]:
                    spans.append(_span(trace, _id(name, c, r), bg, f"dcp.{name}", b_cursor,
                                       b_cursor + int(seconds * 1e9), base))  # fmt: skip
                    b_cursor += int(seconds * 1e9)
                u_end = t + int((io * 25 + 0.01) * 1e9)  # every rank's upload ends after the slow one's writes
                spans.append(_span(trace, bg, upload, "dcp.save", u_start + 50_000, u_end - 50_000,
                                   {**base, "dcp.written_bytes": 8 * MB}))  # fmt: skip
                spans.append(_span(trace, upload, op_id, "dcp.async_upload", u_start, u_end, base))
                end = op_end
                ends.append(u_end)
            else:
                for name, seconds in [*steps, (io_step, mine)]:
                    error = ERROR if failed and r == FAILING and name == io_step else None
                    spans.append(_span(trace, _id(name, c, r), op_id, f"dcp.{name}", cursor,
                                       cursor + int(seconds * 1e9), base, error))  # fmt: skip
                    cursor += int(seconds * 1e9)
                end = t + int((io * 25 + 0.01) * 1e9)  # the collective: every rank waits for the slow one
                ends.append(end)
            key = "dcp.read_bytes" if operation == "load" else "dcp.written_bytes"
            op_error = f"CheckpointException: ranks [{FAILING}] failed; rank {FAILING}: {ERROR}" if failed else None
            attrs = {**base, "dcp.run_id": "generated", key: 8 * MB, "dcp.operation.seq": 0, "dcp.group_rank": r}
            if failed:
                attrs["dcp.failed_ranks"] = [FAILING]
            spans.append(_span(trace, op_id, root, f"dcp.{operation}", start, end, attrs, op_error))
        per_rank[0].append(_span(trace, root, "", "dcp.checkpoint", t, max(ends), {**common, "dcp.rank": 0},
                                 "failed" if failed else None))  # fmt: skip
        t = max(ends) + 2_000_000_000
    for r, spans in enumerate(per_rank):
        with (folder / f"rank-{r}.jsonl").open("w") as out:
            for i in range(0, len(spans), 512):  # a few hundred spans per request, as a batch exporter sends
                request = {"resourceSpans": [{"resource": {"attributes": _attrs({"dcp.rank": r})},
                                              "scopeSpans": [{"scope": {"name": "dcp_otel"},
                                                              "spans": spans[i : i + 512]}]}]}  # fmt: skip
                out.write(json.dumps(request) + "\n")
    return folder
