"""The report as one self-contained HTML page: tables, and a timeline per checkpoint.

Works offline: no external script, style or font. The tables are written here;
the timelines are drawn in the browser (SVG) from the data embedded in the page:
one lane per rank, each span a bar nested by depth, failed spans outlined in
red, and the straggler's lane highlighted.

Usage::

    Path("report.html").write_text(render(checkpoints(spans)))
"""

from __future__ import annotations

import html
import json
from typing import Any

from dcp_otel import semconv
from dcp_otel.report.model import Checkpoint
from dcp_otel.report.terminal import format_bytes

_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 24px; color: #1d2330; background: #fafbfc; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin: 28px 0 6px; }
.meta { color: #5a6270; font-size: 12px; margin-bottom: 8px; }
.failed { color: #c4162a; font-weight: 600; }
table { border-collapse: collapse; margin: 6px 0 10px; font-size: 13px; }
th, td { padding: 3px 10px; text-align: right; border-bottom: 1px solid #e3e6ea; }
th:first-child, td:first-child, th:last-child, td:last-child { text-align: left; }
table.steps td:last-child { text-align: right; }
details { margin: 4px 0; font-size: 13px; } summary { cursor: pointer; color: #3274d9; }
tr.straggler td { background: #fff1e6; font-weight: 600; }
.timeline { background: #fff; border: 1px solid #e3e6ea; border-radius: 4px; }
.lane-label { font-size: 12px; fill: #1d2330; }
.lane.straggler .lane-bg { fill: #fff1e6; }
.lane.straggler .lane-label { fill: #d45b00; font-weight: 700; }
.bar { stroke: #fff; stroke-width: 0.5; }
.bar.error { stroke: #c4162a; stroke-width: 2; }
.lane.straggler .bar.io { fill: #d45b00; }
.legend span { display: inline-block; margin-right: 14px; font-size: 12px; }
.legend i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: middle; }
"""

# Draws every checkpoint's timeline from the embedded data; no library needed.
_SCRIPT = """
const data = JSON.parse(document.getElementById("report-data").textContent);
const colors = {operation: "#8ab8ff", io: "#3274d9", upload: "#a78bfa", other: "#73bf69"};
const NS = "http://www.w3.org/2000/svg";
function el(name, attrs, parent) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}
for (const ckpt of data.checkpoints) {
  const host = document.getElementById("timeline-" + ckpt.index);
  const width = 1100, label = 110, row = 14;
  const depth = Math.max(1, ...ckpt.lanes.map(l => l.depth + 1));
  const laneHeight = depth * row + 8;
  const svg = el("svg", {class: "timeline", width: width, height: ckpt.lanes.length * laneHeight + 24}, host);
  const scale = (width - label - 10) / Math.max(ckpt.duration_ms, 1e-6);
  ckpt.lanes.forEach((lane, i) => {
    const y0 = 4 + i * laneHeight;
    const g = el("g", {class: "lane" + (lane.rank === ckpt.straggler ? " straggler" : ""),
                       "data-rank": lane.rank}, svg);
    el("rect", {class: "lane-bg", x: 0, y: y0, width: width, height: laneHeight, fill: i % 2 ? "#fff" : "#f6f7f9"}, g);
    el("text", {class: "lane-label", x: 6, y: y0 + 14}, g).textContent =
      "rank " + lane.rank + (lane.rank === ckpt.straggler ? " (straggler)" : "");
    for (const bar of lane.bars) {
      const rect = el("rect", {
        class: "bar " + bar.kind + (bar.error ? " error" : ""), "data-name": bar.name,
        x: label + bar.start_ms * scale, y: y0 + 4 + bar.depth * row,
        width: Math.max(1, bar.dur_ms * scale), height: row - 2, fill: colors[bar.kind]}, g);
      el("title", {}, rect).textContent = `rank ${lane.rank} ${bar.name}: ${bar.dur_ms.toFixed(2)} ms` +
        (bar.error ? " (failed: " + bar.error + ")" : "");
    }
  });
  const axisY = ckpt.lanes.length * laneHeight + 18;
  el("text", {x: label, y: axisY, class: "lane-label"}, svg).textContent = "0 ms";
  el("text", {x: width - 90, y: axisY, class: "lane-label"}, svg).textContent = ckpt.duration_ms.toFixed(1) + " ms";
}
document.body.setAttribute("data-rendered", String(data.checkpoints.length));
"""


def _kind(name: str) -> str:
    step = name.removeprefix(semconv.SPAN_PREFIX)
    if step in {"write_data", "read_data"}:
        return "io"
    if name in (semconv.SPAN_ASYNC_UPLOAD, semconv.SPAN_ASYNC_STAGING):
        return "upload"
    if step in semconv.OPERATIONS:
        return "operation"
    return "other"


def _lanes(ckpt: Checkpoint) -> list[dict[str, Any]]:
    lanes: dict[int, dict[str, Any]] = {}
    for rank, span, ancestors in ckpt.rank_spans():
        depth = len(ancestors)
        lane = lanes.setdefault(rank, {"rank": rank, "depth": 0, "bars": []})
        lane["depth"] = max(lane["depth"], depth)
        lane["bars"].append({
            "name": span.name.removeprefix(semconv.SPAN_PREFIX), "kind": _kind(span.name), "depth": depth,
            "start_ms": (span.start_ns - ckpt.start_ns) / 1e6, "dur_ms": (span.end_ns - span.start_ns) / 1e6,
            "error": span.status_message if span.error else None,
        })  # fmt: skip
    return [lanes[rank] for rank in sorted(lanes)]


#: Column names, each with the definition shown on hover. The parts add up: total = busy + waiting.
_HEADERS = (
    ("rank", ""), ("total s", "the rank's operation span"), ("busy s", "in its own steps"),
    ("waiting s", "the rest of total: waiting for other ranks"), ("bytes", ""), ("MB/s", "bytes / write or read time"),
    ("error", "the first error among the rank's spans"),
)  # fmt: skip
#: An async save's two sides: the caller's (returned = busy + waiting; staging is part of busy) and
#: the upload's (write is part of upload busy, which is part of upload).
_ASYNC_HEADERS = (
    *_HEADERS[:1], ("returned s", "time for async_save to return to the caller"),
    ("busy s", "the caller's own steps (staging included)"), ("waiting s", "the rest of returned"),
    ("staging s", "copying the state dict for the upload"), ("upload s", "from hand-off to the upload's end"),
    ("upload busy s", "in the background save's steps"), ("write s", "in write_data, during the upload"),
    *_HEADERS[4:],
)  # fmt: skip


def _summary(index: int, ckpt: Checkpoint) -> str:
    e = html.escape
    is_async = ckpt.operation == "async_save"
    rows = []
    for r in ckpt.ranks:
        mbps = f"{r.throughput_bps / 1e6:.1f}" if r.throughput_bps else "-"
        cls = ' class="straggler"' if r.rank == ckpt.straggler else ""
        cells = [str(r.rank), f"{r.duration_s:.3f}", f"{r.busy_s:.3f}", f"{r.wait_s:.3f}"]
        if is_async:
            upload = f"{r.upload_s:.3f} {r.upload}" if r.upload else "-"
            cells += [f"{r.staging_s:.3f}", upload, f"{r.upload_busy_s:.3f}", f"{r.io_s:.3f}"]
        cells += [format_bytes(r.bytes), mbps, r.error or ""]
        rows.append(f"<tr{cls}>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
    headers = _ASYNC_HEADERS if is_async else _HEADERS
    step_rows = "".join(
        f"<tr><td>{e(step.name)}</td><td>{step.slowest_rank}</td><td>{step.by_rank[step.slowest_rank]:.3f}</td>"
        f"<td>{step.median_s:.3f}</td><td>{step.skew:.1f}x</td></tr>"
        for step in sorted(ckpt.steps, key=lambda s: -s.by_rank[s.slowest_rank])
    )
    notes = []
    if ckpt.straggler is not None:
        notes.append(f"Straggler: <b>rank {ckpt.straggler}</b>, busy {ckpt.straggler_skew:.1f}x the median rank.")
    if ckpt.failed_ranks:
        ranks = ", ".join(map(str, ckpt.failed_ranks))
        notes.append(f'<span class="failed">Failed on rank {ranks}: {e(ckpt.error or "")}</span>')
    status = '<span class="failed">FAILED</span>' if ckpt.error else "ok"
    return (
        f'<section class="checkpoint" id="checkpoint-{index}">'
        f"<h2>{e(ckpt.operation)} {e(ckpt.checkpoint_id)} &mdash; {ckpt.duration_s:.3f} s, {status}</h2>"
        f'<div class="meta">trace {e(ckpt.trace_id)}</div>'
        "<table><tr>" + "".join(f'<th title="{e(why)}">{e(name)}</th>' for name, why in headers) + "</tr>"
        + "".join(rows) + "</table>"
        '<details><summary>steps</summary><table class="steps"><tr><th>step</th><th>slowest rank</th>'
        "<th>its time s</th><th>median s</th><th>skew</th></tr>" + step_rows + "</table></details>"
        f"<p>{' '.join(notes)}</p>"
        f'<div class="timeline-host" id="timeline-{index}"></div></section>'
    )


def render(checkpoints: list[Checkpoint]) -> str:
    data = {
        "checkpoints": [
            {"index": i, "operation": c.operation, "straggler": c.straggler,
             "duration_ms": (c.end_ns - c.start_ns) / 1e6, "lanes": _lanes(c)}
            for i, c in enumerate(checkpoints)
        ]
    }  # fmt: skip
    # "</" would end the script element early; JSON allows "<\\/" for it.
    payload = json.dumps(data).replace("</", "<\\/")
    legend = "".join(f'<span><i style="background:{c}"></i>{name}</span>' for name, c in (
        ("operation", "#8ab8ff"), ("write/read", "#3274d9"), ("async", "#a78bfa"), ("other steps", "#73bf69")))  # fmt: skip
    sections = "".join(_summary(i, c) for i, c in enumerate(checkpoints))
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        "<title>dcp-otel checkpoint report</title>"
        f"<style>{_STYLE}</style></head><body>"
        f"<h1>dcp-otel checkpoint report</h1><div class=\"meta\">{len(checkpoints)} checkpoint operations</div>"
        f'<div class="legend">{legend}</div>{sections}'
        f'<script type="application/json" id="report-data">{payload}</script>'
        f"<script>{_SCRIPT}</script></body></html>\n"
    )
