"""The HTML report as a trace explorer at 1,024 ranks, in a real headless Chromium.

A generated run (``tests/generated_run.py``: 12 checkpoints on 1,024 ranks, rank 7 the
straggler of all but every tenth) is reported with ``--trace-url``; the page must open
within two screens' worth per checkpoint, show any span's attributes on a click, filter
by search, zoom, unfold a band, and compare two checkpoints, with no console error. Its
time at 1,024 ranks x 50 checkpoints is in ``benchmarks/report_scale.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By

from dcp_otel.report import build
from tests import generated_run as run
from tests.ranks import REPO

RANKS, CHECKPOINTS = 1024, 12
TRACE_URL = "https://tempo.example/explore?trace={trace_id}&span={span_id}"


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = run.write_run(tmp_path_factory.mktemp("wide-run"), checkpoints=CHECKPOINTS, ranks=RANKS)
    out = folder.parent / "wide.html"
    done = subprocess.run([sys.executable, "-m", "dcp_otel", "report", str(folder), "--html", str(out),
                           "--perfetto", str(folder.parent / "wide.perfetto.json"), "--trace-url", TRACE_URL],
                          capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def opened(browser: Any, page: Path) -> Any:
    browser.get(page.as_uri())
    assert browser.execute_script("return document.body.dataset.rendered") == str(CHECKPOINTS)
    return browser


def lanes(browser: Any) -> list[list[str]]:
    return browser.execute_script("""return [...document.querySelectorAll('section.checkpoint')]
        .filter(s => !s.hidden && s.querySelector('details.ckpt').open)
        .map(s => [...s.querySelectorAll('.timeline-host svg g.lane')].map(g => g.dataset.rank))""")


def console_errors(browser: Any) -> list[dict[str, Any]]:
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_a_thousand_ranks_open_within_a_few_screens_the_ranks_worth_reading_as_lanes(opened: Any) -> None:
    height = opened.execute_script("return document.documentElement.scrollHeight")
    assert height <= 15_000, height
    timelines = opened.execute_script("""return [...document.querySelectorAll('.timeline-host svg')].map(svg => ({
        lanes: [...svg.querySelectorAll('g.lane')].map(g => Number(g.dataset.rank)),
        bands: [...svg.querySelectorAll('g.band')].length, height: svg.getBoundingClientRect().height}))""")
    assert len(timelines) == 5  # the open sections, worst first
    for timeline in timelines:
        assert 0 in timeline["lanes"] and len(timeline["lanes"]) <= 8 and timeline["bands"] == 6
        assert timeline["height"] < 1_000  # a checkpoint of any width: within a screen
    assert any(run.SLOW in t["lanes"] for t in timelines)  # the straggler is a lane of its own
    assert console_errors(opened) == []


def test_clicking_a_bar_shows_everything_its_span_carries_and_links_to_the_trace(opened: Any) -> None:
    bar = opened.find_element(By.CSS_SELECTOR, ".lane[data-rank='7'] rect.bar.io[data-span-id]")
    span_id = bar.get_attribute("data-span-id")
    bar.click()
    panel = opened.execute_script("""const p = document.getElementById('span-details');
        return {hidden: p.hidden, rows: Object.fromEntries([...p.querySelectorAll('table.attributes tr')]
                .map(tr => [tr.cells[0].textContent, tr.cells[1].textContent])),
                link: p.querySelector('#trace-link').href}""")
    assert panel["hidden"] is False
    rows = panel["rows"]
    assert rows["dcp.rank"] == "7" and rows["rank"] == "7" and rows["span id"] == span_id
    assert rows["dcp.world_size"] == str(RANKS) and rows["dcp.operation"] in run.OPERATIONS
    assert rows["dcp.checkpoint_id"].startswith("/ckpt/step-") and rows["status"] == "OK"
    assert panel["link"] == TRACE_URL.format(trace_id=rows["trace id"], span_id=span_id)
    assert console_errors(opened) == []


def test_searching_rank_7_keeps_only_its_lane(opened: Any) -> None:
    before = sum(len(t) for t in lanes(opened))
    opened.find_element(By.CSS_SELECTOR, "input[type=search]").send_keys("rank 7")
    after = lanes(opened)
    assert after and all(t == ["7"] for t in after)
    assert sum(len(t) for t in after) < before
    # Rank 300, folded into a band when the page opened, is found too: its lane alone.
    box = opened.find_element(By.CSS_SELECTOR, "input[type=search]")
    box.clear()
    box.send_keys("rank 300")
    assert all(t == ["300"] for t in lanes(opened))
    box.clear()
    box.send_keys("no such thing at all")
    assert opened.execute_script("return [...document.querySelectorAll('section.checkpoint')].every(s => s.hidden)")
    assert console_errors(opened) == []


def test_a_search_that_every_rank_matches_keeps_the_page_folded(opened: Any) -> None:
    opened.find_element(By.CSS_SELECTOR, "input[type=search]").send_keys("write_data")
    height = opened.execute_script("return document.documentElement.scrollHeight")
    assert height <= 15_000, height  # 1,024 lanes per timeline were 179,056 px
    timelines = opened.execute_script("""return [...document.querySelectorAll('section.checkpoint')]
        .filter(s => !s.hidden && s.querySelector('details.ckpt').open).map(s => ({
            lanes: [...s.querySelectorAll('.timeline-host svg g.lane')].map(g => Number(g.dataset.rank)),
            bands: s.querySelectorAll('.timeline-host svg g.band').length}))""")
    assert timelines
    for timeline in timelines:  # the ranks worth reading first (the coordinator, the straggler), the rest in bands
        assert 0 in timeline["lanes"] and len(timeline["lanes"]) <= 24 and timeline["bands"] > 0, timeline
    assert any(run.SLOW in t["lanes"] for t in timelines)
    assert console_errors(opened) == []


def test_a_band_unfolds_into_its_ranks_lanes_on_a_click(opened: Any) -> None:
    host = opened.find_element(By.CSS_SELECTOR, "section.checkpoint details.ckpt[open] .timeline-host")
    label = host.find_element(By.CSS_SELECTOR, "g.band .lane-label")
    count = int(label.text.rsplit("(", 1)[1].rstrip(")"))
    before = len(host.find_elements(By.CSS_SELECTOR, "g.lane"))
    label.click()
    assert len(host.find_elements(By.CSS_SELECTOR, "g.lane")) == before + count


def test_zooming_narrows_the_time_axis_and_reset_restores_it(opened: Any) -> None:
    host = opened.find_element(By.CSS_SELECTOR, "section.checkpoint details.ckpt[open] .timeline-host")

    def axis() -> list[str]:
        return [t.text for t in host.find_elements(By.CSS_SELECTOR, "text.tick")]

    full = axis()
    host.find_element(By.CSS_SELECTOR, "button[data-zoom=in]").click()
    host.find_element(By.CSS_SELECTOR, "button[data-zoom=in]").click()
    zoomed = axis()
    assert zoomed != full and len(zoomed) >= 4
    assert float(zoomed[-1].split()[0]) - float(zoomed[0].split()[0]) < float(full[-1].split()[0]) / 3
    host.find_element(By.CSS_SELECTOR, "button[data-zoom=reset]").click()
    assert axis() == full


def test_comparing_a_checkpoint_with_a_straggler_to_one_without_shows_the_changed_step(opened: Any) -> None:
    # Checkpoint index 10 has no straggler (every tenth); the same operation's one before it has rank 7 slow.
    ops = [run.OPERATIONS[c % len(run.OPERATIONS)] for c in range(CHECKPOINTS)]
    newer = 10
    older = max(c for c in range(newer) if ops[c] == ops[newer])
    for first, second in ((newer, older), (older, newer)):  # whichever is picked first: newer minus older
        opened.execute_script(f"""
            const [a, b] = [document.getElementById('compare-a'), document.getElementById('compare-b')];
            a.value = '{first}'; a.dispatchEvent(new Event('change'));
            b.value = '{second}'; b.dispatchEvent(new Event('change'));""")
        top = opened.execute_script("""const row = document.querySelector('#compare-result table.compare-steps tr.changed-most');
            return [...row.cells].map(c => c.textContent)""")
        io_step = "read_data" if ops[newer] == "load" else "write_data"
        assert top[0] == io_step and f"(rank {run.SLOW})" in top[1]  # the older one's slowest rank was rank 7
        assert top[3].startswith("-")  # and the newer one's slowest takes less
        headline = opened.execute_script("return document.querySelector('#compare-result p.compare-headline').textContent")
        said = re.fullmatch(rf"#{newer + 1} {ops[newer]} /ckpt/step-{newer * 10} \(newer, [\d.]+ s, ok\) took [\d.]+ s "
                            rf"(longer|less) than #{older + 1} {ops[older]} /ckpt/step-{older * 10} \(older, [\d.]+ s, "
                            r"ok\): ([+-])[\d.]+ s \([\d.]+x\), newer minus older\.", headline)  # fmt: skip
        assert said is not None and (said.group(1) == "longer") == (said.group(2) == "+"), headline
        # Ranks by the change in their busy time: the straggler that stopped straggling first.
        first_row = opened.execute_script("""const row = document.querySelector('#compare-result table.compare-ranks').rows[1];
            return [...row.cells].map(c => c.textContent)""")
        assert first_row[0] == str(run.SLOW) and first_row[3].startswith("-") and first_row[7].endswith(" MiB")
    assert console_errors(opened) == []


def test_the_page_says_the_most_skewed_step_and_perfetto_carries_every_attribute(page: Path) -> None:
    text = page.read_text()
    assert f"Most skewed step: write_data on rank {run.SLOW}:" in text
    events = json.loads((page.parent / "wide.perfetto.json").read_text())["traceEvents"]
    write = next(e for e in events if e.get("name") == "write_data")
    assert {"dcp.rank", "dcp.world_size", "dcp.checkpoint_id", "dcp.operation", "trace_id", "span_id"} <= set(write["args"])


def test_an_exception_text_with_markup_cannot_break_the_page(browser: Any, tmp_path: Path) -> None:
    """Text from a span (an exception, an attribute) is data: '<!--<script' or '</script>' in it changes nothing."""
    from dcp_otel.otlp_file import FileSpan
    from dcp_otel.report.html import render
    from dcp_otel.report.model import checkpoints

    nasty = "boom <!--<script>alert(1)</script> </script><b>"
    spans = [FileSpan("a" * 32, "b" * 16, "", "dcp.save", 0, 10_000_000, True, nasty,
                      {"dcp.operation": "save", "dcp.rank": 0, "dcp.note": nasty}, exception=nasty)]  # fmt: skip
    page = tmp_path / "nasty.html"
    page.write_text(render(checkpoints(spans)))
    browser.get(page.as_uri())
    assert browser.execute_script("return document.body.dataset.rendered") == "1"
    assert browser.execute_script("return document.querySelectorAll('.timeline-host svg rect.bar').length") == 1
    assert console_errors(browser) == []


def test_a_trace_url_without_a_place_for_the_trace_id_is_a_clear_error(tmp_path: Path) -> None:
    folder = run.write_run(tmp_path / "run", checkpoints=1, ranks=2)
    done = subprocess.run([sys.executable, "-m", "dcp_otel", "report", str(folder), "--html", str(tmp_path / "x.html"),
                           "--trace-url", "https://tempo.example/"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)  # fmt: skip
    assert done.returncode == 2 and "--trace-url must contain {trace_id}" in done.stderr
    assert not (tmp_path / "x.html").exists()
    assert build([folder]).html().count('id="report-data"') == 1  # and without one, no link at all


def test_a_wide_checkpoints_lanes_are_the_ranks_worth_reading_the_unfinished_ones_too() -> None:
    """40 ranks: the coordinator, the slowest, and rank 33, stopped by SIGTERM, are lanes; the rest fold."""
    from dcp_otel import semconv
    from dcp_otel.otlp_file import FileSpan
    from dcp_otel.report.model import checkpoints
    from dcp_otel.report.page_data import BANDS, fold

    spans = []
    for rank in range(40):
        attributes: dict[str, Any] = {"dcp.operation": "save", "dcp.rank": rank}
        end = 10_000_000 + rank * 1000
        error = ""
        if rank == 33:
            attributes[semconv.ATTR_INTERRUPTED] = "SIGTERM"
            error = "terminated by SIGTERM during write_data"
        spans.append(FileSpan("c" * 32, f"{rank:016x}", "", "dcp.save", 0, end, bool(error), error, attributes))
        spans.append(FileSpan("c" * 32, f"{rank + 100:016x}", f"{rank:016x}", "dcp.write_data", 0, end - 1000,
                              False, "", {"dcp.operation": "save", "dcp.rank": rank}))  # (the later rank, the longer)
    (ckpt,) = checkpoints(spans)
    lanes, bands = fold(ckpt)
    assert 0 in lanes and 33 in lanes and 39 in lanes  # the coordinator, the unfinished, the slowest
    assert len(bands) == BANDS and sorted(lanes + [r for b in bands for r in b["ranks"]]) == list(range(40))


def test_a_failed_bar_is_findable_and_its_details_keep_attribute_names_whole(browser: Any, tmp_path: Path) -> None:
    folder = run.write_run(tmp_path / "failing", checkpoints=run.FAILED_AT + 1, ranks=8)
    out = tmp_path / "failing.html"
    done = subprocess.run([sys.executable, "-m", "dcp_otel", "report", str(folder), "--html", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    browser.get(out.as_uri())
    bar = browser.find_element(By.CSS_SELECTOR, f".lane[data-rank='{run.FAILING}'] rect.bar.error.io")
    assert float(bar.get_attribute("width")) >= 4  # its write lasted 0.06 s of a 1.6 s checkpoint
    browser.execute_script("arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", bar)
    cells = browser.execute_script("""return [...document.querySelectorAll('#span-details table.attributes tr')]
        .map(tr => { const range = document.createRange(); range.selectNodeContents(tr.cells[0]);
                     return {name: tr.cells[0].textContent, lines: range.getClientRects().length}; })""")
    assert cells and all(c["lines"] <= 1 for c in cells), cells  # "dcp.checkpoint_id", never "dcp.chec kpoint_id"
    assert console_errors(browser) == []
