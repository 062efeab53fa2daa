"""Pictures of the dashboards' main panels, drawn from real Prometheus query results.

Grafana is what users run; this draws, with matplotlib, what its panels would
show: each picture takes panels of a committed dashboard by title, sends their
own queries (variables set to "All") to a Prometheus, and plots the answers.
The documentation's pictures come from ``scripts/pictures.sh``, which points it at a
live run of our stack (tests/stack.py).

Usage::

    from mixin.pictures import render
    drawn = render(PrometheusAPI(url), dashboard_json, ["Operation duration"], start, end, Path("out.png"))
    drawn["Operation duration"]   # -> number of series drawn in that panel
"""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or servers

import matplotlib.pyplot as plt  # noqa: E402

from mixin.dashboards import panels, render_expr  # noqa: E402
from mixin.promapi import PrometheusAPI  # noqa: E402

#: Panels shown in docs/receiving-stack.md, per dashboard file.
MAIN_PANELS = {
    "dcp-otel-checkpoints.json": [
        "Operations by status", "Operation duration", "Step duration p95", "Bytes per second",
        "Async save phases p95", "Age of the last successful checkpoint",
    ],
    "dcp-otel-ranks.json": [
        "Top 5 slowest ranks in write_data / read_data", "Skew: slowest rank / median rank",
        "Step duration per rank", "Collective wait per rank",
    ],
    "dcp-otel-torchelastic.json": ["Rendezvous duration", "Run results", "Agent calls", "Calls by status"],
}  # fmt: skip
MAX_LINES = 8
_MAX_LABEL = 40
_UNITS = {"s": "seconds", "Bps": "bytes/s", "ops": "per second", "bytes": "bytes", "none": "", "short": ""}


def _legend(template: str, labels: dict[str, str]) -> str:
    text = template or ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__")
    for key, value in labels.items():
        text = text.replace("{{" + key + "}}", value)
    # Long: the start (what tells the series of a run apart) and the end (the run, last), the middle cut.
    half = (_MAX_LABEL - 3) // 2
    return text if len(text) <= _MAX_LABEL else text[:half] + "..." + text[-half:]


def _finite(pairs: list[list[Any]]) -> tuple[list[dt.datetime], list[float]]:
    xs, ys = [], []
    for t, v in pairs:
        value = float(v)
        if math.isfinite(value):
            xs.append(dt.datetime.fromtimestamp(float(t), tz=dt.timezone.utc))
            ys.append(value)
    return xs, ys


def _draw(ax: Any, api: PrometheusAPI, panel: dict[str, Any], start: float, end: float, **render: Any) -> int:
    drawn = 0
    bars: list[tuple[str, float]] = []
    lines: list[tuple[float, str, list[dt.datetime], list[float]]] = []
    for target in panel["targets"]:
        expr = render_expr(target["expr"], **render)
        legend = target.get("legendFormat", "")
        if target.get("instant"):
            for series in api.query(expr, at=end):
                value = float(series["value"][1])
                if math.isfinite(value):
                    bars.append((_legend(legend, series["metric"]), value))
        else:
            step = max(1.0, (end - start) / 300)
            for series in api.query_range(expr, start, end, step):
                xs, ys = _finite(series["values"])
                if ys:
                    lines.append((max(ys), _legend(legend, series["metric"]), xs, ys))
    # A picture, unlike Grafana, cannot hover: the series that matter are the highest ones.
    lines.sort(key=lambda line: -line[0])
    for _, label, xs, ys in lines[:MAX_LINES]:
        ax.plot(xs, ys, label=label, linewidth=1.6)
    drawn += len(lines)
    if len(lines) > MAX_LINES:
        ax.set_title(f"(highest {MAX_LINES} of {len(lines)} series)", fontsize=8, loc="right")
    if bars:
        bars.sort(key=lambda bar: bar[1])
        bars = bars[-MAX_LINES * 2 :]
        ax.barh([b[0] for b in bars], [b[1] for b in bars], color="#5794f2")
        drawn += len(bars)
    elif drawn:
        ax.legend(fontsize=7, loc="upper left")
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    ax.set_title(panel["title"], fontsize=10, loc="left")
    ax.set_xlabel(_UNITS.get(panel.get("fieldConfig", {}).get("defaults", {}).get("unit", ""), "") if bars else "")
    ax.grid(alpha=0.3)
    return drawn


def render(
    api: PrometheusAPI,
    model: dict[str, Any],
    titles: list[str],
    start: float,
    end: float,
    out: Path,
    *,
    rate_interval: str = "5m",
    time_range: str | None = None,
) -> dict[str, int]:
    """Draw the panels titled ``titles`` of dashboard ``model`` for ``start..end`` into ``out`` (PNG).

    Variables are set to "All" (each one's ``allValue``). Returns the number
    of series (or bars) drawn per panel: 0 means the query returned nothing.
    """
    by_title = {p["title"]: p for p in panels(model)}
    variables = {v["name"]: v.get("allValue") or ".+" for v in model["templating"]["list"] if v["type"] == "query"}
    macros = {"rate_interval": rate_interval, "time_range": time_range or f"{max(1, int(end - start))}s"}
    columns = 2
    rows = math.ceil(len(titles) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(13, 3.4 * rows), squeeze=False)
    fig.suptitle(model["title"], fontsize=13, x=0.01, ha="left")
    drawn = {}
    for ax, title in zip(axes.flat, titles, strict=False):
        drawn[title] = _draw(ax, api, by_title[title], start, end, variables=variables, **macros)
    for ax in list(axes.flat)[len(titles) :]:
        ax.axis("off")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return drawn
