"""The report takes what pipelines deliver: never a traceback, never a hang, and it says what it read past.

Each case starts from a generated run (``tests/generated_run.py``: its rank files, as dcp-otel writes them) and
damages it the way real pipelines do: an at-least-once exporter's retry (every span twice), a file given twice,
a killed writer's cut line with a restarted process's lines after it, numbers that are not finite, a parent
cycle, control characters in an exception message. Then the CLI's exit status for a CI step, and a closed pipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dcp_otel import semconv
from dcp_otel.report import build
from tests.generated_run import FAILED_AT, write_run
from tests.ranks import REPO

RANKS = 3


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "traces", checkpoints=4, ranks=RANKS)


def requests(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def spans_in(request: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for resource_spans in request["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            yield from scope_spans["spans"]


def rewrite(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to every span of a rank file, written back one request per line."""
    found = requests(path)
    for request in found:
        for span in spans_in(request):
            change(span)
    path.write_text("".join(json.dumps(r) + "\n" for r in found))


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dcp_otel", "report", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)  # fmt: skip


def test_spans_delivered_twice_are_counted_once_with_a_warning(run: Path) -> None:
    once = build([run])
    rank1 = run / "rank-1.jsonl"
    again = sum(1 for r in requests(rank1) + requests(run / "rank-0.jsonl") for _ in spans_in(r))
    rank1.write_text(rank1.read_text() * 2)  # an exporter's retry landed in the Collector's file again
    twice = build([run, run / "rank-0.jsonl"])  # and a file given twice
    assert twice.text() == once.text()
    assert twice.damaged == [f"{again} spans were read more than once (an exporter's retry delivered them again, "
                             "or a file was given twice): each is counted once"]  # fmt: skip


def test_a_second_operation_span_of_one_rank_in_one_trace_counts_once(run: Path) -> None:
    rank0 = run / "rank-0.jsonl"
    (request,) = requests(rank0)
    spans = request["resourceSpans"][0]["scopeSpans"][0]["spans"]
    first_op = next(s for s in spans if s["name"] == "dcp.save")
    spans.append({**first_op, "spanId": "ffffffffffffffff"})  # same trace, same rank, another span id
    rank0.write_text(json.dumps(request) + "\n")
    shown = report(str(run))
    assert shown.returncode == 0 and not shown.stderr, shown.stderr
    ckpt = next(c for c in build([run]).checkpoints if c.trace_id == first_op["traceId"])
    assert sorted(r.rank for r in ckpt.ranks) == list(range(RANKS))


def test_a_cut_line_followed_by_a_restarted_writers_lines_is_read_past_naming_it(run: Path) -> None:
    rank1 = run / "rank-1.jsonl"
    one_per_line = [{"resourceSpans": [{**r["resourceSpans"][0], "scopeSpans": [{"spans": [s]}]}]}
                    for r in requests(rank1) for s in spans_in(r)]  # fmt: skip
    lines = [json.dumps(r) for r in one_per_line]
    cut = len(lines) // 2
    rank1.write_text("\n".join(lines[:cut]) + "\n" + lines[cut][: len(lines[cut]) // 2] + "\n"
                     + "\n".join(lines[cut + 1 :]) + "\n")  # fmt: skip
    shown = report(str(run))
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr == (f"dcp-otel report: warning: {rank1}:{cut + 1}: the line is cut short and more follows (a "
                            "process ended mid-write, then another appended to the file: a restart); read past it\n")  # fmt: skip
    got = {s.span_id for s in build([run]).checkpoints[-1].spans}
    assert json.loads(lines[-1])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["spanId"] in got  # after the cut


def test_a_cut_line_with_the_restarted_writers_line_glued_onto_it_reports_like_the_intact_run(run: Path) -> None:
    """What append mode leaves when no newline follows the cut: the restarted writer's first line starts right after
    the cut prefix (dcp-otel's own exporter now starts its output on a fresh line; another writer may not)."""
    intact = build([run]).text()
    rank1 = run / "rank-1.jsonl"
    lines = rank1.read_text().splitlines()
    cut = '{"resourceSpans":[{"resource":{"attributes":[{"key":"host.na'  # a writer killed mid-line
    rank1.write_text(cut + "\n".join(lines) + "\n")  # the restarted writer appended right after it
    shown = report(str(run))
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr.count("warning") == 1 and "read the part after the cut" in shown.stderr, shown.stderr
    assert build([run]).text() == intact


def test_the_span_file_exporter_starts_its_output_on_a_fresh_line_after_a_cut_one(tmp_path: Path) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from dcp_otel.otlp_file import OTLPJsonFileExporter, read_spans

    path = tmp_path / "rank-0.jsonl"
    path.write_text('{"resourceSpans":[{"scopeSp')  # a writer killed mid-line
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPJsonFileExporter(path)))
    provider.get_tracer("t").start_span("restarted").end()
    provider.shutdown()
    assert path.read_text().splitlines()[0] == '{"resourceSpans":[{"scopeSp'  # the cut line, left alone
    damaged: list[str] = []
    assert [s.name for s in read_spans([path], damaged)] == ["restarted"] and len(damaged) == 1, damaged


def test_numbers_that_are_not_finite_are_read_as_absent_with_a_warning(run: Path) -> None:
    damaged = []

    def damage(span: dict[str, Any]) -> None:
        if span["name"] == "dcp.save":  # a save's, and an async save's background save
            damaged.append(span["spanId"])
            span["attributes"].append({"key": semconv.ATTR_WAIT_SECONDS, "value": {"doubleValue": "Infinity"}})
            span["attributes"].append({"key": semconv.ATTR_FAILED_RANKS,
                                       "value": {"arrayValue": {"values": [{"doubleValue": float("nan")}]}}})  # fmt: skip

    rewrite(run / "rank-2.jsonl", damage)
    shown = report(str(run), "--html", str(run / "page.html"))
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr == (f"dcp-otel report: warning: {2 * len(damaged)} attributes held a number that is not finite (NaN, "
                            "Infinity): read as absent\n")  # fmt: skip
    assert "NaN" not in (run / "page.html").read_text() and "Infinity" not in (run / "page.html").read_text()


def test_a_parent_cycle_ends_and_is_said(run: Path) -> None:
    spans = [s for r in requests(run / "rank-1.jsonl") for s in spans_in(r)]
    op = next(s for s in spans if s["name"] == "dcp.save")
    step = next(s for s in spans if s["parentSpanId"] == op["spanId"])
    # The operation span's parent becomes its own first step.
    rewrite(run / "rank-1.jsonl", lambda s: s.update(parentSpanId=step["spanId"]) if s["spanId"] == op["spanId"] else None)
    shown = report(str(run))
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr == "dcp-otel report: warning: 1 spans' parents led back to themselves (a parent cycle): read as roots\n"


def test_control_characters_in_span_text_reach_the_terminal_escaped(tmp_path: Path) -> None:
    run = write_run(tmp_path / "traces", checkpoints=FAILED_AT + 1, ranks=6)
    rewrite(run / "rank-5.jsonl", lambda s: s["status"].update(message="\x1b[2J\x1b]0;pwned\x07" + s["status"]["message"])
            if s["status"] else None)  # fmt: skip
    shown = report(str(run))
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout
    assert "\\x1b[2J\\x1b]0;pwned\\x07OSError: [Errno 28]" in shown.stdout


def test_exit_code_says_a_checkpoint_failed_only_when_asked(tmp_path: Path, run: Path) -> None:
    failing = write_run(tmp_path / "failing", checkpoints=FAILED_AT + 1, ranks=6)
    assert report(str(failing)).returncode == 0
    assert report(str(failing), "--exit-code").returncode == 1
    assert report(str(run), "--exit-code").returncode == 0


def test_a_closed_pipe_ends_the_report_quietly(run: Path) -> None:
    shown = subprocess.run(f"{sys.executable} -m dcp_otel report --all {run} | head -n 1", shell=True, capture_output=True,
                           text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert shown.stdout.startswith("4 checkpoint operations") and shown.stdout.count("\n") == 1
    assert shown.stderr == ""


def test_the_documented_ci_gate_runs_as_printed(tmp_path: Path) -> None:
    (line,) = [ln for ln in (REPO / "docs" / "report.md").read_text().splitlines() if "--exit-code >" in ln]
    write_run(tmp_path / "traces", checkpoints=FAILED_AT + 1, ranks=6)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert done.stdout == "a checkpoint failed: see report.txt\n", done.stderr
    assert (tmp_path / "report.txt").read_text().startswith(f"{FAILED_AT + 1} checkpoint operations")
