"""`dcp-otel report`: the answers in a recorded run's spans, in three forms, and clear errors.

tests/data/demo-3-ranks holds the OTLP JSON spans of a recorded 3-rank demo run
with known answers (see tests/data/README.md): rank 2 is slow, rank 1's disk
fills up at the third checkpoint.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from dcp_otel.report import SpanFileError, build
from tests.report_invariants import assert_times_add_up

RECORDED = Path(__file__).parent / "data" / "demo-3-ranks"
SLOW, FAILING = 2, 1


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dcp_otel", "report", *args], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parent.parent)  # fmt: skip


def test_the_report_names_the_slow_rank_the_failure_and_the_uploads() -> None:
    report = build([RECORDED])
    assert [c.operation for c in report.checkpoints] == ["save", "async_save", "save", "async_save", "load"]
    for ckpt in report.checkpoints:
        assert [r.rank for r in ckpt.ranks] == [0, 1, 2]
        assert ckpt.straggler == SLOW and ckpt.straggler_skew > 5
        io_step = "read_data" if ckpt.operation == "load" else "write_data"
        (io,) = [s for s in ckpt.steps if s.name == io_step]
        assert io.slowest_rank == SLOW and io.by_rank[SLOW] >= 0.5  # it slept 0.5 s per write and read
        # The others wait for it: waiting is where a fast rank's time goes.
        fast = [r for r in ckpt.ranks if r.rank != SLOW]
        if ckpt.operation != "async_save":
            assert all(r.wait_s > r.busy_s for r in fast)
    failed = report.checkpoints[2]
    assert failed.failed_ranks == [FAILING] and "No space left on device" in (failed.error or "")
    assert all(c.error is None for i, c in enumerate(report.checkpoints) if i != 2)
    for ckpt in (report.checkpoints[1], report.checkpoints[3]):
        assert [r.upload for r in ckpt.ranks] == ["completed"] * 3
        assert all(r.bytes > 1_000_000 and r.throughput_bps for r in ckpt.ranks)


def test_every_row_adds_up_and_an_async_saves_two_sides_stay_apart() -> None:
    report = build([RECORDED])
    assert_times_add_up(report.checkpoints)
    for ckpt in (report.checkpoints[1], report.checkpoints[3]):  # the async saves
        slow = next(r for r in ckpt.ranks if r.rank == SLOW)
        assert slow.duration_s < 0.1 < 0.5 <= slow.upload_busy_s  # it returned at once; the upload was slow
        assert slow.io_s >= 0.5 and ckpt.straggler == SLOW


def test_the_terminal_table_says_it_in_words() -> None:
    shown = run_cli(str(RECORDED))
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert text.startswith("5 checkpoint operations (2 save, 2 async_save, 1 load) on 3 ranks: 1 failed\n")
    assert f"\nFAILED  save /tmp/demo1/checkpoints/step-9 (operation 3 of 5) on rank {FAILING}:\n" in text
    assert "\n        OSError: [Errno 28] No space left on device\n" in text  # the rank's own exception, in full
    assert f"\nstraggler: rank {SLOW} was the slowest in 5 of 5 checkpoints, " in text
    assert text.count(f"straggler: rank {SLOW},") == 5  # and in each checkpoint's details
    assert f"failed on rank {FAILING}: OSError: [Errno 28] No space left on device" in text
    assert "most skewed step: read_data on rank 2" in text and "completed" in text
    # Per step: the slowest rank, its time, the median across ranks and the skew.
    assert len(re.findall(r"\n  write_data +2 +0\.5\d\ds +0\.0\d\ds +\d+\.\dx", text)) == 4
    assert len(re.findall(r"\n  read_data +2 +0\.5\d\ds", text)) == 1


def test_the_perfetto_trace_has_one_process_per_rank_and_nested_events(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert run_cli(str(RECORDED), "--perfetto", str(out)).returncode == 0
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0 (vm)", 1: "rank 1 (vm)", 2: "rank 2 (vm)"}  # with the host.name they ran on
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in spans} >= {"save", "async_save", "load", "write_data", "read_data", "async_upload"}
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)
    # The trace format requires events on one thread to nest: each starts after, and ends
    # before, the one it starts in, or starts after it ended.
    threads: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for event in spans:
        threads[(event["pid"], event["tid"])].append(event)
    for events_of_thread in threads.values():
        open_ends: list[float] = []
        for event in sorted(events_of_thread, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and event["ts"] >= open_ends[-1]:
                open_ends.pop()
            assert not open_ends or event["ts"] + event["dur"] <= open_ends[-1] + 1  # 1 us of rounding
            open_ends.append(event["ts"] + event["dur"])


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "the file is empty"),
        ("not json at all\n", "rank.jsonl:1: not JSON"),
        ('{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}\n', "not an OTLP JSON trace request"),
        ('{"something": "else"}\n', "not an OTLP JSON trace request"),
        ("[1, 2]\n", "expected a JSON object"),
        ('{"resourceSpans": []}\n', "no dcp-otel checkpoint spans"),
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deep"),
    ],
)  # fmt: skip
def test_a_bad_trace_file_is_a_clear_error_not_a_traceback(tmp_path: Path, content: str, expected: str) -> None:
    bad = tmp_path / "rank.jsonl"
    bad.write_text(content)
    shown = run_cli(str(bad))
    assert shown.returncode == 2
    assert expected in shown.stderr and "Traceback" not in shown.stderr
    with pytest.raises(SpanFileError, match=expected.split(":")[-1].strip()):
        build([bad])


def _as_api_answer(request: dict[str, Any], form: str) -> dict[str, Any]:
    """One OTLP request as a trace backend's API answers it: base64 ids, legacy field names, a wrapper."""
    for resource_spans in request["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
        if form == "tempo-v1":  # Tempo before 2.0 wrote the older name
            resource_spans["instrumentationLibrarySpans"] = resource_spans.pop("scopeSpans")
    if form == "tempo-v1":
        return {"batches": request["resourceSpans"]}
    if form == "tempo-v2":
        return {"trace": request, "status": "COMPLETE"}
    return {"result": request}  # Jaeger v2's /api/v3/traces/<id>


@pytest.mark.parametrize("form", ["tempo-v1", "tempo-v2", "jaeger-v3"])
def test_a_trace_fetched_from_tempo_or_jaeger_reports_as_the_span_files_do(tmp_path: Path, form: str) -> None:
    fetched = tmp_path / form
    fetched.mkdir()
    for rank_file in sorted(RECORDED.glob("*.jsonl")):
        answers = [json.dumps(_as_api_answer(json.loads(line), form)) for line in rank_file.read_text().splitlines()]
        (fetched / rank_file.name).write_text("\n".join(answers) + "\n")
    shown, expected = run_cli(str(fetched), "--all"), run_cli(str(RECORDED), "--all")
    assert shown.returncode == 0 and not shown.stderr, shown.stderr
    assert shown.stdout == expected.stdout


def test_an_output_path_that_cannot_be_written_is_a_one_line_error(tmp_path: Path) -> None:
    nowhere = run_cli(str(RECORDED), "--html", str(tmp_path / "missing" / "report.html"))
    assert nowhere.returncode == 2 and nowhere.stdout == "", nowhere.stdout  # said before any work is done
    assert nowhere.stderr == f"dcp-otel report: error: cannot write {tmp_path / 'missing' / 'report.html'}: its folder " \
        f"{tmp_path / 'missing'} does not exist\n"
    (tmp_path / "taken").mkdir()  # a folder where the file should go
    taken = run_cli(str(RECORDED), "--perfetto", str(tmp_path / "taken"))
    assert taken.returncode == 2 and "Traceback" not in taken.stderr
    assert taken.stderr.splitlines() == [f"dcp-otel report: error: cannot write {tmp_path / 'taken'}: Is a directory"]


def test_version_prints_the_packages_version() -> None:
    from dcp_otel.version import __version__

    shown = subprocess.run([sys.executable, "-m", "dcp_otel", "--version"], capture_output=True, text=True, timeout=60,
                           cwd=Path(__file__).parent.parent)  # fmt: skip
    assert shown.returncode == 0 and shown.stdout == f"dcp-otel {__version__}\n"


def test_attributes_of_the_wrong_type_read_as_absent_not_as_a_traceback(tmp_path: Path) -> None:
    """A summary whose step names are a number, failed ranks that are not a list, a world size that is text."""

    def span(name: str, span_id: str, parent: str, attributes: dict[str, dict[str, str]]) -> dict[str, object]:
        return {"traceId": "0" * 31 + "1", "spanId": span_id, "parentSpanId": parent, "name": name,
                "startTimeUnixNano": "1000000000", "endTimeUnixNano": "2000000000", "status": {"code": 2, "message": "x"},
                "attributes": [{"key": k, "value": v} for k, v in attributes.items()]}  # fmt: skip

    odd = {"dcp.operation": {"stringValue": "save"}, "dcp.rank": {"intValue": "0"}, "dcp.group_rank": {"intValue": "0"},
           "dcp.detail": {"stringValue": "summary"}, "dcp.steps.names": {"intValue": "5"},
           "dcp.steps.seconds": {"stringValue": "no"}, "dcp.failed_ranks": {"intValue": "3"},
           "dcp.wait_seconds": {"stringValue": "x"}, "dcp.world_size": {"stringValue": "many"},
           "dcp.collective_seconds": {"boolValue": True}, "dcp.written_bytes": {"stringValue": "lots"}}  # fmt: skip
    spans = [span("dcp.checkpoint", "0000000000000001", "", {"dcp.operation": {"stringValue": "save"}}),
             span("dcp.save", "0000000000000002", "0000000000000001", odd)]  # fmt: skip
    odd_file = tmp_path / "odd.jsonl"
    odd_file.write_text(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}) + "\n")
    shown = run_cli(str(odd_file))
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert shown.stdout.splitlines()[0] == "1 checkpoint operations (1 save) on 1 ranks: 1 failed"


def test_what_a_killed_writer_leaves_is_read_past_with_a_warning(tmp_path: Path) -> None:
    """A rank killed mid-checkpoint leaves an empty file or a last line cut short: the others' spans are the answer."""
    whole = run_cli(str(RECORDED))
    files = tmp_path / "traces"
    files.mkdir()
    for rank in range(3):
        (files / f"rank-{rank}.jsonl").write_text((RECORDED / f"rank-{rank}.jsonl").read_text())
    text = (RECORDED / "rank-0.jsonl").read_text()
    lines = text.count(chr(10))
    (files / "rank-0.jsonl").write_text(text[: len(text) - 500])  # its writer died mid-line
    (files / "rank-3.jsonl").write_text("")  # a process that died before its first export
    shown = run_cli(str(files))
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr.splitlines() == [
        f"dcp-otel report: warning: {files / 'rank-0.jsonl'}:{lines}: the last line is cut short (its writer ended "
        "mid-write); read up to it",
        f"dcp-otel report: warning: {files / 'rank-3.jsonl'}: the file is empty (its process ended before it exported "
        "a span?); skipped",
    ]
    # The checkpoints are all there (rank 0's part of the last, in the line cut short, is not).
    assert shown.stdout.split(" on ")[0] == whole.stdout.split(" on ")[0]
    # A cut in the middle of a file is not what a killed writer leaves: an error, with its line.
    middle = tmp_path / "middle.jsonl"
    middle.write_text(text.replace(chr(10), "\n{" + chr(10), 1))
    broken = run_cli(str(middle))
    assert broken.returncode == 2 and "Traceback" not in broken.stderr and f"{middle}:2: not JSON" in broken.stderr
    missing = run_cli(str(tmp_path / "nowhere.jsonl"))
    assert missing.returncode == 2 and "cannot read it" in missing.stderr


# --- the HTML page, in a real browser ---------------------------------------------
def test_the_html_report_draws_one_lane_per_rank_and_highlights_the_straggler(browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    page = tmp_path / "report.html"
    assert run_cli(str(RECORDED), "--html", str(page)).returncode == 0
    browser.get(page.as_uri())  # offline: a file, no server, nothing fetched
    assert browser.execute_script("return document.body.dataset.rendered") == "5"
    lanes = browser.execute_script("""
        return [...document.querySelectorAll('.timeline-host')].map(host =>
            [...host.querySelectorAll('g.lane')].map(g => ({
                rank: g.dataset.rank, straggler: g.classList.contains('straggler'),
                label: g.querySelector('.lane-label').textContent,
                bars: g.querySelectorAll('rect.bar').length,
                ioFill: [...g.querySelectorAll('rect.bar.io')].map(r => getComputedStyle(r).fill)})))""")
    assert len(lanes) == 5
    for timeline in lanes:
        assert [lane["rank"] for lane in timeline] == ["0", "1", "2"]
        assert [lane["straggler"] for lane in timeline] == [False, False, True]
        assert timeline[SLOW]["label"] == f"rank {SLOW} (straggler)"
        assert all(lane["bars"] >= 3 for lane in timeline)
        # Highlighted: the straggler's write/read bars are orange, the others' blue.
        assert set(timeline[SLOW]["ioFill"]) == {"rgb(212, 91, 0)"}
        assert set(timeline[0]["ioFill"]) == {"rgb(50, 116, 217)"}
    failed = browser.execute_script("return document.querySelectorAll('#timeline-2 rect.bar.error').length")
    assert failed >= 1
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []


def test_the_html_report_opens_with_the_runs_summary_and_a_trend_chart(browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    page = tmp_path / "report.html"
    assert run_cli(str(RECORDED), "--html", str(page)).returncode == 0
    browser.get(page.as_uri())
    top = browser.execute_script("""
        const summary = document.querySelector('#summary');
        const chart = summary.querySelector('svg.trend');
        return {first: document.querySelector('h1').nextElementSibling.id, text: summary.innerText,
                cause: summary.querySelector('pre.cause').innerText,
                lines: [...chart.querySelectorAll('polyline.trend-line')].map(p => p.dataset.operation),
                yTicks: chart.querySelectorAll('text.tick[text-anchor="end"]').length,
                failedDots: chart.querySelectorAll('circle.trend-failed').length,
                sectionTop: document.querySelector('section.checkpoint').getBoundingClientRect().top,
                summaryBottom: summary.getBoundingClientRect().bottom}""")
    assert top["first"] == "summary"  # the first thing under the title
    assert "5 checkpoint operations" in top["text"] and "1 failed" in top["text"]
    assert f"rank {SLOW} was the slowest in 5 of 5 checkpoints" in top["text"]
    assert top["cause"] == "OSError: [Errno 28] No space left on device"  # the failing rank's own, in full
    assert top["lines"] == ["save", "async_save", "load"] and top["yTicks"] >= 4 and top["failedDots"] == 1
    assert top["summaryBottom"] <= top["sectionTop"]  # above every checkpoint's details


def check_timelines(browser) -> dict:  # type: ignore[no-untyped-def]
    """Every drawn timeline: labels never clipped, every bar colour in the legend, at least 4 axis ticks."""
    seen = browser.execute_script("""
        const legend = new Set([...document.querySelectorAll('.timeline-legend i')]
            .map(i => getComputedStyle(i).backgroundColor));
        return [...document.querySelectorAll('.timeline-host svg')].map(svg => {
            const bars = [...svg.querySelectorAll('rect.bar')];
            const firstBar = Math.min(...bars.map(b => b.getBBox().x));
            const labels = [...svg.querySelectorAll('.lane-label')].map(t => {
                const box = t.getBBox();
                return {text: t.textContent, right: box.x + box.width, chars: t.getNumberOfChars(),
                        shown: t.getSubStringLength(0, t.getNumberOfChars()), width: box.width};
            });
            return {firstBar, svgWidth: svg.getBBox().width, labels,
                    fills: [...new Set(bars.map(b => getComputedStyle(b).fill))],
                    missing: [...new Set(bars.map(b => getComputedStyle(b).fill))].filter(f => !legend.has(f)),
                    ticks: svg.querySelectorAll('text.tick').length,
                    tickLabels: [...svg.querySelectorAll('text.tick')].map(t => t.textContent)};
        });""")
    assert seen
    for timeline in seen:
        for label in timeline["labels"]:
            assert label["right"] < timeline["firstBar"], (label, timeline["firstBar"])  # ends before the bars
        assert timeline["missing"] == [], timeline["fills"]
        assert timeline["ticks"] >= 4, timeline["tickLabels"]
    return {"timelines": len(seen), "labels": [label["text"] for t in seen for label in t["labels"]]}


def test_the_html_timelines_have_unclipped_labels_a_legend_for_every_colour_and_a_ticked_axis(browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    page = tmp_path / "report.html"
    assert run_cli(str(RECORDED), "--html", str(page)).returncode == 0
    browser.get(page.as_uri())
    seen = check_timelines(browser)
    assert seen["timelines"] == 5 and f"rank {SLOW} (straggler)" in seen["labels"]
    orange = browser.execute_script(
        "return [...document.querySelectorAll('.lane.straggler rect.bar.io')].map(b => getComputedStyle(b).fill)")
    assert set(orange) == {"rgb(212, 91, 0)"}  # the straggler's colour, which the legend names


# --- a large run: 500 checkpoints on 64 ranks (tests/generated_run.py; its time is in benchmarks/report_scale.py)
@pytest.fixture(scope="module")
def large_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.generated_run import write_run

    return write_run(tmp_path_factory.mktemp("large-run"), checkpoints=500, ranks=64)


def test_a_large_runs_summary_names_its_failure_straggler_and_trend(large_run: Path) -> None:
    from dcp_otel.report.summary import summarize
    from tests import generated_run as run

    report = build([large_run])
    summary = summarize(report.checkpoints)
    assert summary.operations == 500 and summary.ranks == 64
    assert summary.by_operation == {"save": 250, "async_save": 125, "load": 125}
    (failure,) = summary.failures
    assert (failure.index, failure.ranks) == (run.FAILED_AT, [run.FAILING])
    assert failure.cause == run.ERROR + " (full text)"  # from the failing step's exception event
    assert summary.straggler is not None
    assert (summary.straggler.rank, summary.straggler.slowest_in, summary.straggler.of) == (run.SLOW, 450, 500)
    assert all(t.change() is not None and t.change() > 1.5 for t in summary.trends)  # the run slowed down
    assert_times_add_up(report.checkpoints)
    text = report.text()
    assert len(text.splitlines()) < 250  # readable: the summary and the 10 worst, the ranks worth reading
    assert text.splitlines()[1].startswith(f"FAILED  load /ckpt/step-{run.FAILED_AT * 10} (operation 124 of 500) on rank 5")


def test_a_large_runs_html_page_opens_on_its_summary_with_the_worst_checkpoints_drawn(browser, large_run: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from tests import generated_run as run

    page = tmp_path / "large.html"
    assert run_cli(str(large_run), "--html", str(page)).returncode == 0
    browser.get(page.as_uri())
    assert browser.execute_script("return document.body.dataset.rendered") == "500"
    state = browser.execute_script("""
        const sections = [...document.querySelectorAll('section.checkpoint')];
        const svg = document.querySelector('.timeline-host svg');
        return {open: sections.filter(s => s.querySelector('details.ckpt').open).map(s => s.id),
                drawn: document.querySelectorAll('.timeline-host svg').length,
                lanes: [...svg.querySelectorAll('g.lane')].map(g => Number(g.dataset.rank)),
                bands: [...svg.querySelectorAll('g.band .lane-label')].map(t => Number(t.textContent.match(/\\((\\d+)\\)/)[1])),
                summary: document.querySelector('#summary').innerText}""")
    assert state["open"][0] == f"checkpoint-{run.FAILED_AT}"  # the worst (the failure) first
    assert len(state["open"]) == state["drawn"] == 5  # the rest are collapsed, drawn when opened
    assert f"rank {run.SLOW} was the slowest in 450 of 500" in state["summary"]
    # 64 ranks fold: the ranks worth reading (coordinator, the failing rank, the straggler, the slowest) are lanes,
    # every other rank is in one of the bands of alike ranks.
    assert {0, run.FAILING, run.SLOW} <= set(state["lanes"]) and len(state["lanes"]) <= 8
    assert len(state["bands"]) == 6 and len(state["lanes"]) + sum(state["bands"]) == 64
    check_timelines(browser)
    drawn = browser.execute_async_script("""
        const done = arguments[arguments.length - 1], details = document.querySelector('#checkpoint-0 details.ckpt');
        details.addEventListener('toggle', () => done(document.querySelectorAll('.timeline-host svg').length));
        details.open = true;  // the page's own toggle listener was added first: it has drawn when this one runs""")
    assert drawn == 6


def test_the_html_report_marks_the_rank_where_the_failure_started(browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Rank 1's own disk filled up: its lane and row say "failed here"; the others' rows name torch's report once."""
    page = tmp_path / "report.html"
    assert run_cli(str(RECORDED), "--html", str(page)).returncode == 0
    browser.get(page.as_uri())
    seen = browser.execute_script("""
        const section = document.getElementById('checkpoint-2');
        return {labels: [...section.querySelectorAll('g.lane .lane-label')].map(t => t.textContent),
                origin: [...section.querySelectorAll('tr.failed-origin td:first-child')].map(td => td.textContent),
                errors: [...section.querySelectorAll('table:not(.steps) tr')].slice(1).map(tr => tr.lastChild.textContent),
                notes: section.innerText}""")
    assert "rank 1 (failed here)" in seen["labels"] and seen["origin"] == ["1"]
    assert sorted(seen["errors"])[:2] == ["CheckpointException (rank 1's failure)"] * 2
    assert "It started on rank 1; every other rank raised torch's CheckpointException reporting it." in seen["notes"]
