"""The report as one self-contained HTML page: a trace explorer for a run of any width.

Works offline: no external script, style or font (``page.js`` and ``page.css``
are embedded). At the top, the summary (unfinished and failed checkpoints with
their causes in full, the run's straggler) and a chart of each operation kind's
duration over the run. Then a search box, the compare view (two checkpoints side
by side, per step and per rank), and one section per checkpoint, worst first,
the first few open and the rest collapsed: a table, the straggler and the most
skewed step, and a timeline drawn in the browser from the data embedded in the
page (:mod:`dcp_otel.report.page_data`): the ranks worth reading as lanes, the
rest folded into bands of alike ranks (expandable), each span a bar that shows
all it carries when clicked (with a link to the trace in your Tempo, Jaeger or
Grafana when ``trace_url`` is given), zoom and pan along time, and a legend for
every colour used.

Usage::

    Path("report.html").write_text(render(checkpoints(spans), trace_url="https://tempo/trace/{trace_id}"))
"""

from __future__ import annotations

import html
import json
import math
from importlib.resources import files

from dcp_otel import semconv
from dcp_otel.report.life import Life
from dcp_otel.report.model import WRAPPER, Checkpoint
from dcp_otel.report.page_data import page_data
from dcp_otel.report.summary import FAILURES_SHOWN, Summary, summarize, worst_first
from dcp_otel.report.terminal import (
    error_cell,
    format_bytes,
    innermost_frames,
    ranks_worth_showing,
    render_lives,
    skew_line,
    wall_clock,
)

#: The page's style and script, beside this module (package data), embedded whole: the page works offline.
_ASSETS = files("dcp_otel.report")



#: Column names, each with the definition shown on hover. The parts add up: total = busy + waiting.
_HEADERS = (
    ("rank", ""), ("total s", "the rank's operation span"), ("busy s", "in its own steps"),
    ("waiting s", "the rest of total: waiting for other ranks"), ("bytes", ""), ("I/O MB/s", "the rank's bytes / its write or read time (10^6 bytes/s)"),
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


_HOST_HEADER = ("host", "where the rank ran: its resource's host.name, and its pod or container")


def _section(index: int, ckpt: Checkpoint, open_: bool) -> str:
    e = html.escape
    is_async = ckpt.operation in semconv.ASYNC_OPERATIONS
    rows = []
    shown = ranks_worth_showing(ckpt)
    hosts = any(r.where for r in ckpt.ranks)  # a host column, where the files say where ranks ran
    for r in (r for r in ckpt.ranks if r.rank in shown):
        mbps = f"{r.throughput_bps / 1e6:.1f}" if r.throughput_bps else "-"
        classes = [c for c, on in (("straggler", r.rank == ckpt.straggler), ("failed-origin", r.rank in ckpt.origins)) if on]
        cls = f' class="{" ".join(classes)}"' if classes else ""
        cells = [str(r.rank), *([r.where or "-"] if hosts else []), f"{r.duration_s:.3f}", f"{r.busy_s:.3f}",
                 f"{r.wait_s:.3f}"]  # fmt: skip
        if is_async:
            upload = f"{r.upload_s:.3f} {r.upload}" if r.upload else "-"
            cells += [f"{r.staging_s:.3f}", upload, f"{r.upload_busy_s:.3f}", f"{r.io_s:.3f}"]
        cells += [format_bytes(r.bytes), mbps, error_cell(r, ckpt)]
        rows.append(f"<tr{cls}>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
    headers = _ASYNC_HEADERS if is_async else _HEADERS
    if hosts:
        headers = (headers[0], _HOST_HEADER, *headers[1:])
    rows += [f'<tr class="silent"><td>{rank}</td><td colspan="{len(headers) - 1}">no spans</td></tr>'
             for rank in ckpt.silent_ranks[:_UNFINISHED_SHOWN]]  # fmt: skip
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
    skew = skew_line(ckpt)
    if skew:
        notes.append(f'<span class="skew">{e(skew[0].upper() + skew[1:])}.</span>')
    if ckpt.failed_ranks and not ckpt.is_unfinished:
        ranks = ", ".join(map(str, ckpt.failed_ranks))
        notes.append(f'<span class="failed">Failed on rank {ranks}: {e(ckpt.error or "")}</span>')
        if ckpt.origins and ckpt.failed_waiting:
            notes.append(f"It started on rank {', '.join(map(str, ckpt.origins))}; rank "
                         f"{', '.join(map(str, ckpt.failed_waiting))} failed waiting for it.")  # fmt: skip
        elif ckpt.origins:
            notes.append(f"It started on rank {', '.join(map(str, ckpt.origins))}; every other rank raised torch's "
                         f"{WRAPPER} reporting it.")  # fmt: skip
        lost = ckpt.lost_peer()
        if lost:
            notes.append(e(lost[0].upper() + lost[1:]) + ".")
    status = ('<span class="failed">UNFINISHED</span>' if ckpt.is_unfinished else
              '<span class="failed">FAILED</span>' if ckpt.error else "ok")  # fmt: skip
    if len(shown) < len(ckpt.ranks):
        rest = [r for r in ckpt.ranks if r.rank not in shown]
        notes.insert(0, f"{len(rest)} other ranks not listed: total {min(r.duration_s for r in rest):.3f} to "
                        f"{max(r.duration_s for r in rest):.3f} s (in the timeline: bands of alike ranks, each "
                        "expanded by a click; or search for one).")  # fmt: skip
    return (
        f'<section class="checkpoint" id="checkpoint-{index}"><details class="ckpt"{" open" if open_ else ""}>'
        f"<summary>{e(ckpt.title)} &mdash; {ckpt.duration_s:.3f} s, {status}</summary>"
        f'<div class="meta">started {wall_clock(ckpt.start_ns)}, trace {e(ckpt.trace_id)}</div>'
        "<table><tr>" + "".join(f'<th title="{e(why)}">{e(name)}</th>' for name, why in headers) + "</tr>"
        + "".join(rows) + "</table>"
        '<details><summary>steps</summary><table class="steps"><tr><th>step</th><th>slowest rank</th>'
        "<th>its time s</th><th>median s</th><th>skew</th></tr>" + step_rows + "</table></details>"
        f"<p>{' '.join(notes)}</p>"
        f'<div class="timeline-host" id="timeline-{index}"></div></details></section>'
    )


#: Every colour a timeline uses, and what it means (the straggler's write/read bars are orange).
LEGEND = (("operation", "#8ab8ff"), ("write/read", "#3274d9"), ("straggler's write/read", "#d45b00"),
          ("async upload/staging", "#a78bfa"), ("other steps", "#73bf69"), ("stall report", "#e0b400"),
          ("DCP's collectives (waiting)", "#b7bcc4"))  # fmt: skip
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
             f"({e(summary.kinds)}) on {summary.ranks_said} ranks: {unfinished}{failed}.</p>"]  # fmt: skip
    if summary.silent_said:
        parts.append(f'<p class="failed">{e(summary.silent_said[0].upper() + summary.silent_said[1:])}.</p>')
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
                     + (f'<p class="lost-peer">{e(f.lost_peer[0].upper() + f.lost_peer[1:])}.</p>' if f.lost_peer else "")
                     + f'<pre class="cause">{e(f.cause)}</pre>')  # fmt: skip
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


def _compare(checkpoints: list[Checkpoint], order: list[int]) -> str:
    """Two checkpoints side by side: by default the worst one, and the one of its kind just before it."""
    e = html.escape
    a = order[0]
    same = [i for i in range(len(checkpoints)) if i != a and checkpoints[i].operation == checkpoints[a].operation]
    earlier = [i for i in same if i < a]
    b = earlier[-1] if earlier else (same[0] if same else (order[1] if len(order) > 1 else a))

    def options(selected: int) -> str:
        return "".join(f'<option value="{i}"{" selected" if i == selected else ""}>#{i + 1} {e(c.operation)} '
                       f"{e(c.checkpoint_id)} ({c.duration_s:.3f} s)</option>" for i, c in enumerate(checkpoints))  # fmt: skip

    return ('<section id="compare"><h2>Compare two checkpoints</h2><p>'
            f'<select id="compare-a">{options(a)}</select> against <select id="compare-b">{options(b)}</select></p>'
            '<div id="compare-result"></div></section>')  # fmt: skip


def render(checkpoints: list[Checkpoint], trace_url: str | None = None, runs: list[Life] | None = None) -> str:
    """The page; ``trace_url`` (with ``{trace_id}``, optionally ``{span_id}``) links each span to your trace UI;
    ``runs``: the runs' generations, in the terminal's words."""
    data = page_data(checkpoints, trace_url)
    lives = render_lives(runs or [])
    generations = (f'<section id="generations"><h2>Generations and restarts</h2><pre>{html.escape(lives)}</pre>'
                   "</section>" if lives else "")  # fmt: skip
    # "</" would end the script element early, and "<!--" would start a script comment that swallows the
    # page's script: no "<" at all, as JSON's own escape for it.
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    legend = "".join(f'<span><i style="background:{c}"></i>{name}</span>' for name, c in LEGEND)
    legend += ('<span><i class="outline"></i>failed span</span>'
               '<span><i style="background:#c9d6ea"></i>band of alike ranks: spread (median darker)</span>')  # fmt: skip
    order = worst_first(checkpoints)
    sections = "".join(_section(i, checkpoints[i], n < OPEN_SECTIONS) for n, i in enumerate(order))
    toolbar = ('<div id="toolbar"><input type="search" id="search" placeholder="rank 7, write_data, failed, '
               'unfinished, a checkpoint id..." aria-label="search the checkpoints">'
               '<span class="hint" id="search-count"></span><span class="hint">click a bar for everything its span '
               "carries</span></div>")  # fmt: skip
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        "<title>dcp-otel checkpoint report</title>"
        f"<style>{_ASSETS.joinpath('page.css').read_text(encoding='utf-8')}</style></head><body>"
        "<h1>dcp-otel checkpoint report</h1>"
        f"{_run_summary(summarize(checkpoints), checkpoints)}"
        f"{generations}{toolbar}{_compare(checkpoints, order)}"
        f'<h2>Checkpoints, worst first</h2><div class="legend timeline-legend">{legend}</div>{sections}'
        '<aside id="span-details" hidden></aside>'
        f'<script type="application/json" id="report-data">{payload}</script>'
        f"<script>{_ASSETS.joinpath('page.js').read_text(encoding='utf-8')}</script></body></html>\n"
    )
