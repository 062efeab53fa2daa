"""The offline checkpoint report: ``dcp-otel report <trace files>``.

Reads spans from OTLP JSON files (what ``dcp-otel demo`` writes, or a
Collector's ``file`` exporter) and answers, per checkpoint operation: how long
each rank and step took, which rank was the straggler and by how much, how long
each rank waited in collectives, bytes and throughput, whether async uploads
completed, and which rank failed with what. Three outputs: a terminal table,
a self-contained HTML page with a timeline per checkpoint (one lane per rank,
the straggler highlighted), and a Chrome/Perfetto trace JSON.

Usage::

    dcp-otel report out/demo/traces --html report.html --perfetto trace.json
    dcp-otel report out/demo/traces --html report.html --trace-url 'https://tempo.example/trace/{trace_id}'

    from dcp_otel.report import build
    report = build(["out/demo/traces"])       # SpanFileError on a malformed file; report.damaged: read past
    print(report.text())
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from dcp_otel.otlp_file import SpanFileError, read_spans
from dcp_otel.report.life import Life, lives
from dcp_otel.report.model import Checkpoint, checkpoints
from dcp_otel.report.summary import DETAIL_LIMIT

__all__ = ["DETAIL_LIMIT", "Life", "Report", "SpanFileError", "build"]


@dataclass
class Report:
    checkpoints: list[Checkpoint]
    #: What a killed writer left in the files, read past (an empty file, a last line cut short).
    damaged: list[str] = field(default_factory=list)
    #: Each run across its generations: restarts, what they restored and lost, what checkpointing cost them.
    runs: list[Life] = field(default_factory=list)

    def text(self, limit: int | None = DETAIL_LIMIT) -> str:
        """The summary, the runs' generations, then the worst ``limit`` checkpoints in detail (``None``: every one)."""
        from dcp_otel.report.terminal import render

        return render(self.checkpoints, limit, self.runs)

    def summary_text(self) -> str:
        """The summary, then the runs' generations and what checkpointing cost them (where their spans say)."""
        from dcp_otel.report.summary import summarize
        from dcp_otel.report.terminal import render_lives, render_summary

        life = render_lives(self.runs)
        return render_summary(summarize(self.checkpoints)) + (f"\n{life}" if life else "")

    def details_text(self, limit: int | None = DETAIL_LIMIT) -> str:
        from dcp_otel.report.terminal import render_details

        return render_details(self.checkpoints, limit)

    def html(self, trace_url: str | None = None) -> str:
        """The self-contained page; ``trace_url`` (``{trace_id}``, ``{span_id}``) links each span to your trace UI."""
        from dcp_otel.report.html import render

        return render(self.checkpoints, trace_url, self.runs)

    def perfetto(self) -> dict[str, object]:
        from dcp_otel.report.perfetto import render

        return render(self.checkpoints)


def build(paths: Iterable[str | os.PathLike[str]]) -> Report:
    """The report of the checkpoints in these trace files (or folders of them).

    What a killed rank's writer leaves (an empty file, a last line cut short) is read past and listed in
    :attr:`Report.damaged`: the other ranks' spans are the answer to why it died.
    """
    damaged: list[str] = []
    spans = read_spans(paths, damaged)
    found = checkpoints(spans)
    if not found:
        said = "".join(f"; {note}" for note in damaged)
        raise SpanFileError(f"the files hold no dcp-otel checkpoint spans{said}")
    return Report(found, damaged, lives(found, spans))
