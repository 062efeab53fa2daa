"""The report as one self-contained HTML page: the run's summary and trend, then each checkpoint.

Works offline: no external script, style or font. At the top, the summary (each
failure with its cause in full, the run's straggler) and a chart of each
operation kind's duration over the run, drawn here as SVG. Then one section per
checkpoint, worst first, the first few open and the rest collapsed: a table,
and a timeline drawn in the browser (SVG) from the data embedded in the page
when its section is opened: one lane per rank (labels sized to fit), each span
a bar nested by depth, failed spans outlined in red, the straggler's lane
highlighted, a time axis with ticks, and a legend for every colour used.

Usage::

    Path("report.html").write_text(render(checkpoints(spans)))
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

from dcp_otel import semconv
from dcp_otel.report.model import Checkpoint
from dcp_otel.report.summary import FAILURES_SHOWN, Summary, summarize, worst_first
from dcp_otel.report.terminal import format_bytes, innermost_frames, ranks_worth_showing

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
.legend i.outline { background: #fff; border: 2px solid #c4162a; width: 8px; height: 8px; }
.tick { font-size: 11px; fill: #5a6270; } .tick-line { stroke: #d5d9de; stroke-width: 1; }
.summary { background: #fff; border: 1px solid #e3e6ea; border-radius: 4px; padding: 10px 16px; margin: 10px 0 18px; }
.summary pre { background: #fff6f6; border-left: 3px solid #c4162a; padding: 6px 10px; white-space: pre-wrap;
  font-size: 12px; margin: 4px 0 10px; }
.trend-line { fill: none; stroke-width: 1.5; }
section.checkpoint > details > summary { font-size: 15px; font-weight: 600; color: #1d2330; margin: 14px 0 4px; }
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
function niceStep(total, ticks) {  // 1, 2 or 5 times a power of ten, giving at least `ticks` ticks
  const raw = total / ticks, power = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [5, 2, 1]) if (m * power <= raw) return m * power;
  return power / 2;
}
function draw(ckpt) {
  const host = document.getElementById("timeline-" + ckpt.index);
  if (!host || host.dataset.drawn) return;
  host.dataset.drawn = "1";
  const width = 1100, row = 14;
  const depth = Math.max(1, ...ckpt.lanes.map(l => l.depth + 1));
  const laneHeight = depth * row + 8;
  const svg = el("svg", {class: "timeline", width: width, height: ckpt.lanes.length * laneHeight + 34}, host);
  // Labels first, measured, so the bars start after the longest one: never clipped.
  const labels = ckpt.lanes.map((lane, i) => {
    const g = el("g", {class: "lane" + (lane.rank === ckpt.straggler ? " straggler" : ""), "data-rank": lane.rank}, svg);
    el("rect", {class: "lane-bg", x: 0, y: 4 + i * laneHeight, width: width, height: laneHeight,
                fill: i % 2 ? "#fff" : "#f6f7f9"}, g);
    const text = el("text", {class: "lane-label", x: 6, y: 4 + i * laneHeight + 14}, g);
    text.textContent = "rank " + lane.rank + (lane.rank === ckpt.straggler ? " (straggler)" : "");
    return [g, text];
  });
  const label = 16 + Math.max(40, ...labels.map(([, t]) => t.getComputedTextLength()));
  const scale = (width - label - 16) / Math.max(ckpt.duration_ms, 1e-6);
  ckpt.lanes.forEach((lane, i) => {
    const y0 = 4 + i * laneHeight, g = labels[i][0];
    for (const bar of lane.bars) {
      const rect = el("rect", {
        class: "bar " + bar.kind + (bar.error ? " error" : ""), "data-name": bar.name,
        x: label + bar.start_ms * scale, y: y0 + 4 + bar.depth * row,
        width: Math.max(1, bar.dur_ms * scale), height: row - 2, fill: colors[bar.kind]}, g);
      el("title", {}, rect).textContent = `rank ${lane.rank} ${bar.name}: ${bar.dur_ms.toFixed(2)} ms` +
        (bar.error ? " (failed: " + bar.error + ")" : "");
    }
  });
  const axisY = ckpt.lanes.length * laneHeight + 8, step = niceStep(ckpt.duration_ms, 5);
  for (let t = 0; t <= ckpt.duration_ms + 1e-9; t += step) {
    const x = label + t * scale;
    el("line", {class: "tick-line", x1: x, x2: x, y1: 4, y2: axisY + 4}, svg);
    const tick = el("text", {class: "tick", x: x, y: axisY + 18, "text-anchor": "middle"}, svg);
    tick.textContent = (step < 1 ? t.toFixed(1) : t.toFixed(0)) + " ms";
  }
}
for (const ckpt of data.checkpoints) {
  const section = document.getElementById("checkpoint-" + ckpt.index);
  const details = section && section.querySelector("details.ckpt");
  if (!details || details.open) draw(ckpt);
  if (details) details.addEventListener("toggle", () => { if (details.open) draw(ckpt); });
}
document.body.setAttribute("data-rendered", String(data.checkpoints.length));
"""


def _kind(name: str) -> str:
    step = name.removeprefix(semconv.SPAN_PREFIX)
    if step in semconv.IO_STEPS:
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


def _section(index: int, ckpt: Checkpoint, open_: bool) -> str:
    e = html.escape
    is_async = ckpt.operation in semconv.ASYNC_OPERATIONS
    rows = []
    shown = ranks_worth_showing(ckpt)
    for r in (r for r in ckpt.ranks if r.rank in shown):
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
    for u in ckpt.unfinished[:_UNFINISHED_SHOWN]:
        notes.append(f'<span class="failed">Unfinished on rank {u.rank}: {e(u.description)}.</span>')
    if len(ckpt.unfinished) > _UNFINISHED_SHOWN:
        notes.append(f"... and {len(ckpt.unfinished) - _UNFINISHED_SHOWN} more unfinished ranks.")
    if ckpt.straggler is not None:
        notes.append(f"Straggler: <b>rank {ckpt.straggler}</b>, busy {ckpt.straggler_skew:.1f}x the median rank.")
    if ckpt.failed_ranks and not ckpt.is_unfinished:
        ranks = ", ".join(map(str, ckpt.failed_ranks))
        notes.append(f'<span class="failed">Failed on rank {ranks}: {e(ckpt.error or "")}</span>')
    status = ('<span class="failed">UNFINISHED</span>' if ckpt.is_unfinished else
              '<span class="failed">FAILED</span>' if ckpt.error else "ok")  # fmt: skip
    if len(shown) < len(ckpt.ranks):
        rest = [r for r in ckpt.ranks if r.rank not in shown]
        notes.insert(0, f"{len(rest)} other ranks not listed: total {min(r.duration_s for r in rest):.3f} to "
                        f"{max(r.duration_s for r in rest):.3f} s (their lanes are in the timeline).")  # fmt: skip
    return (
        f'<section class="checkpoint" id="checkpoint-{index}"><details class="ckpt"{" open" if open_ else ""}>'
        f"<summary>{e(ckpt.operation)} {e(ckpt.checkpoint_id)} &mdash; {ckpt.duration_s:.3f} s, {status}</summary>"
        f'<div class="meta">trace {e(ckpt.trace_id)}</div>'
        "<table><tr>" + "".join(f'<th title="{e(why)}">{e(name)}</th>' for name, why in headers) + "</tr>"
        + "".join(rows) + "</table>"
        '<details><summary>steps</summary><table class="steps"><tr><th>step</th><th>slowest rank</th>'
        "<th>its time s</th><th>median s</th><th>skew</th></tr>" + step_rows + "</table></details>"
        f"<p>{' '.join(notes)}</p>"
        f'<div class="timeline-host" id="timeline-{index}"></div></details></section>'
    )


#: Every colour a timeline uses, and what it means (the straggler's write/read bars are orange).
LEGEND = (("operation", "#8ab8ff"), ("write/read", "#3274d9"), ("straggler's write/read", "#d45b00"),
          ("async upload/staging", "#a78bfa"), ("other steps", "#73bf69"))  # fmt: skip
#: Sections open when the page loads (the worst first); the others draw their timeline when opened.
OPEN_SECTIONS = 5
#: Unfinished ranks named in a checkpoint's section (the timeline shows every one).
_UNFINISHED_SHOWN = 16
_TREND_COLORS = ("#3274d9", "#a78bfa", "#73bf69", "#d45b00", "#8ab8ff", "#5a6270")


def _ticks(high: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``high``: at least ``count - 1`` of them."""
    if high <= 0:
        return [0.0, 1.0, 2.0, 3.0]
    raw = high / count
    power = 10 ** math.floor(math.log10(raw))
    step = next((m * power for m in (1, 2, 5, 10) if m * power >= raw), 10 * power)
    return [i * step for i in range(int(high / step) + 2)]


def _trend_chart(checkpoints: list[Checkpoint]) -> str:
    """Each operation kind's duration over the run, as an SVG line chart with ticked axes and a legend."""
    width, height, left, bottom, top = 900, 220, 60, 30, 10
    durations = [c.duration_s for c in checkpoints]
    y_ticks = _ticks(max(durations))
    # Checkpoint numbers: whole ones only (a run of 2 has ticks #1 and #2, not #1, #1.2, ...).
    x_ticks = sorted({round(t) for t in _ticks(max(1, len(checkpoints) - 1)) if t <= max(1, len(checkpoints) - 1)})
    y_max, x_max = y_ticks[-1], max(1, len(checkpoints) - 1)

    def x(i: float) -> float:
        return left + (width - left - 10) * i / x_max

    def y(v: float) -> float:
        return top + (height - top - bottom) * (1 - v / y_max)

    parts = [f'<svg class="trend" width="{width}" height="{height}" role="img" '
             'aria-label="checkpoint duration over the run, per operation kind">']  # fmt: skip
    for v in y_ticks:
        parts.append(f'<line class="tick-line" x1="{left}" x2="{width - 10}" y1="{y(v):.1f}" y2="{y(v):.1f}"/>'
                     f'<text class="tick" x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g} s</text>')  # fmt: skip
    for t in x_ticks:
        parts.append(f'<text class="tick" x="{x(t):.1f}" y="{height - 10}" text-anchor="middle">#{int(t) + 1}</text>')
    legend = []
    for n, op in enumerate(dict.fromkeys(c.operation for c in checkpoints)):
        color = _TREND_COLORS[n % len(_TREND_COLORS)]
        points = " ".join(f"{x(i):.1f},{y(c.duration_s):.1f}" for i, c in enumerate(checkpoints) if c.operation == op)
        parts.append(f'<polyline class="trend-line" data-operation="{html.escape(op)}" stroke="{color}" points="{points}"/>')
        if len(checkpoints) <= 100:  # each checkpoint a dot too (a kind seen once has no line)
            parts += [f'<circle cx="{x(i):.1f}" cy="{y(c.duration_s):.1f}" r="2.5" fill="{color}"/>'
                      for i, c in enumerate(checkpoints) if c.operation == op]
        legend.append(f'<span><i style="background:{color}"></i>{html.escape(op)}</span>')
    for i, c in enumerate(checkpoints):
        if c.error:
            parts.append(f'<circle class="trend-failed" cx="{x(i):.1f}" cy="{y(c.duration_s):.1f}" r="4" fill="#c4162a">'
                         f"<title>#{i + 1} {html.escape(c.operation)} failed</title></circle>")  # fmt: skip
    if any(c.error for c in checkpoints):
        legend.append('<span><i style="background:#c4162a"></i>failed</span>')
    parts.append("</svg>")
    return f'<div class="legend trend-legend">{"".join(legend)}</div>{"".join(parts)}'


def _run_summary(summary: Summary, checkpoints: list[Checkpoint]) -> str:
    e = html.escape
    failed = f'<span class="failed">{len(summary.failures)} failed</span>' if summary.failures else "none failed"
    unfinished = f'<span class="failed">{len(summary.unfinished)} unfinished</span>, ' if summary.unfinished else ""
    parts = [f'<div class="summary" id="summary"><p><b>{summary.operations} checkpoint operations</b> '
             f"({e(summary.kinds)}) on {summary.ranks} ranks: {unfinished}{failed}.</p>"]  # fmt: skip
    for u in summary.unfinished[:FAILURES_SHOWN]:
        parts.append(f'<p class="failed unfinished"><a href="#checkpoint-{u.index}">{e(u.operation)} '
                     f"{e(u.checkpoint_id)}</a> (operation {u.index + 1} of {summary.operations}) never finished: "
                     f"{e(u.headline())}.</p>")  # fmt: skip
        for rank in u.stuck[:2]:
            if rank.stack:
                parts.append(f'<p>Rank {rank.rank}, where it was (innermost last):</p>'
                             f'<pre class="cause stack">{e(chr(10).join(innermost_frames(rank.stack)))}</pre>')  # fmt: skip
    if len(summary.unfinished) > FAILURES_SHOWN:
        parts.append(f"<p>... and {len(summary.unfinished) - FAILURES_SHOWN} more unfinished operations, first below.</p>")
    for f in summary.failures[:FAILURES_SHOWN]:
        ranks = ", ".join(map(str, f.ranks)) or "?"
        parts.append(f'<p class="failed"><a href="#checkpoint-{f.index}">{e(f.operation)} {e(f.checkpoint_id)}</a> '
                     f"(operation {f.index + 1} of {summary.operations}) failed on rank {ranks}:</p>"
                     f'<pre class="cause">{e(f.cause)}</pre>')  # fmt: skip
    if len(summary.failures) > FAILURES_SHOWN:
        parts.append(f"<p>... and {len(summary.failures) - FAILURES_SHOWN} more failed operations, first below.</p>")
    st = summary.straggler
    parts.append(f'<p class="straggler-summary">Straggler: <b>rank {st.rank}</b> was the slowest in {st.slowest_in} of '
                 f"{st.of} checkpoints, {st.median_skew:.1f}x the median rank.</p>" if st is not None
                 else "<p>No rank was the slowest in most checkpoints.</p>")  # fmt: skip
    trends = []
    for t in summary.trends:
        change = t.change()
        trends.append(f"{e(t.operation)}: median {t.median_s:.3f} s over {len(t.durations_s)}"
                      + ("" if change is None else f", {(change - 1) * 100:+.0f}% from the first fifth to the last"))  # fmt: skip
    if trends:
        parts.append(f"<p>Duration, oldest to newest &mdash; {'; '.join(trends)}.</p>")
    parts.append(_trend_chart(checkpoints) + "</div>")
    return "".join(parts)


def render(checkpoints: list[Checkpoint]) -> str:
    data = {
        "checkpoints": [
            {"index": i, "operation": c.operation, "straggler": c.straggler,
             "duration_ms": (c.end_ns - c.start_ns) / 1e6, "lanes": _lanes(c)}
            for i, c in enumerate(checkpoints)
        ]
    }  # fmt: skip
    # "</" would end the script element early; JSON allows "<\\/" for it.
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    legend = "".join(f'<span><i style="background:{c}"></i>{name}</span>' for name, c in LEGEND)
    legend += '<span><i class="outline"></i>failed span</span>'
    order = worst_first(checkpoints)
    sections = "".join(_section(i, checkpoints[i], n < OPEN_SECTIONS) for n, i in enumerate(order))
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        "<title>dcp-otel checkpoint report</title>"
        f"<style>{_STYLE}</style></head><body>"
        "<h1>dcp-otel checkpoint report</h1>"
        f"{_run_summary(summarize(checkpoints), checkpoints)}"
        f'<h2>Checkpoints, worst first</h2><div class="legend timeline-legend">{legend}</div>{sections}'
        f'<script type="application/json" id="report-data">{payload}</script>'
        f"<script>{_SCRIPT}</script></body></html>\n"
    )
