"""The report of a large run: 500 checkpoints on 64 ranks (152,500 spans), and 50 on 1,024 ranks, in seconds.

Generates the run's OTLP JSON files (``tests/generated_run.py``), then times each
stage of ``dcp-otel report``: reading the files, building the model, the
terminal text (summary and the 10 worst) and the HTML page. Side by side, the
same files read through protobuf's JSON parser, which the report used before.
Goal: the whole report in seconds; the Perfetto trace of 4 checkpoints on 1,024 ranks in at most twice
the HTML page's time. For the wide run: the HTML page's size, and
the time headless Chromium takes to open it and draw its open timelines (when
chromium-driver is installed).

Usage::

    .venv/bin/python benchmarks/report_scale.py
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dcp_otel.otlp_file import _documents, from_otlp_json, read_spans, spans_of  # noqa: E402
from dcp_otel.report import Report  # noqa: E402
from dcp_otel.report.model import checkpoints  # noqa: E402
from tests.browser import start  # noqa: E402
from tests.generated_run import write_run  # noqa: E402


def timed(label: str, fn, rows: list[tuple[str, float]]):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    result = fn()
    rows.append((label, time.perf_counter() - t0))
    return result


def main() -> None:
    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = timed("generate the files (not part of the report)", lambda: write_run(Path(tmp), 500, 64), rows)
        size = sum(p.stat().st_size for p in folder.iterdir())
        spans = timed("read the span files", lambda: read_spans([folder]), rows)
        found = timed("build the model", lambda: checkpoints(spans), rows)
        report = Report(found)
        text = timed("terminal text (summary + 10 worst)", report.text, rows)
        page = timed("HTML page", report.html, rows)
        report_s = sum(seconds for label, seconds in rows[1:])

        def protobuf_read() -> int:
            count = 0
            for path in sorted(folder.iterdir()):
                for _, document in _documents(path, path.read_text()):
                    count += sum(1 for _ in spans_of(from_otlp_json(document)))
            return count

        old = timed("read through protobuf's JSON parser (before)", protobuf_read, rows)
    print(f"500 checkpoints x 64 ranks: {len(spans):,} spans, {size / 1e6:.0f} MB of OTLP JSON")
    for label, seconds in rows:
        print(f"  {label:<48} {seconds:7.2f} s")
    print(f"  {'the whole report':<48} {report_s:7.2f} s")
    print(f"  read: {rows[1][1] / rows[-1][1]:.3f} of protobuf's time ({old:,} spans either way); "
          f"terminal {len(text.splitlines())} lines; HTML {len(page) / 1e6:.1f} MB")


def first_render_s(page: Path) -> float | None:
    """Seconds headless Chromium takes to open ``page`` and draw it (``None`` without chromium-driver)."""
    driver_path = shutil.which("chromedriver")
    if driver_path is None:
        return None
    driver = start(driver_path)
    try:
        driver.get("about:blank")  # the browser's own start-up is not the page's
        started = time.perf_counter()
        driver.get(page.as_uri())  # returns once the page has loaded: its script has drawn by then
        assert driver.execute_script("return document.body.dataset.rendered")
        return time.perf_counter() - started
    finally:
        driver.quit()


def wide(count: int = 50, ranks: int = 1024) -> None:
    """The wide run: the HTML page's time, size and first render."""
    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = timed("generate the files (not part of the report)", lambda: write_run(Path(tmp), count, ranks), rows)
        size = sum(p.stat().st_size for p in folder.iterdir())
        spans = timed("read the span files", lambda: read_spans([folder]), rows)
        found = timed("build the model", lambda: checkpoints(spans), rows)
        page_text = timed("HTML page", Report(found).html, rows)
        page = Path(tmp) / "wide.html"
        page.write_text(page_text)
        render_s = first_render_s(page)
    print(f"\n{count} checkpoints x {ranks} ranks: {len(spans):,} spans, {size / 1e6:.0f} MB of OTLP JSON")
    for label, seconds in rows:
        print(f"  {label:<48} {seconds:7.2f} s")
    print(f"  {'HTML page size':<48} {len(page_text) / 1e6:7.1f} MB")
    shown = "not measured (no chromium-driver)" if render_s is None else f"{render_s:7.2f} s"
    print(f"  {'first render in headless Chromium':<48} {shown}")


def perfetto_against_html(count: int = 4, ranks: int = 1024) -> None:
    """The Perfetto export against the HTML page, of the same checkpoints, side by side (goal: at most 2x)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Report(checkpoints(read_spans([write_run(Path(tmp), count, ranks)])))
        rows: list[tuple[str, float]] = []
        timed("HTML page", report.html, rows)
        timed("Perfetto trace", report.perfetto, rows)
    print(f"\n{count} checkpoints x {ranks} ranks: the Perfetto trace {rows[1][1]:.2f} s, the HTML page "
          f"{rows[0][1]:.2f} s: {rows[1][1] / rows[0][1]:.2f}x")


if __name__ == "__main__":
    main()
    wide()
    perfetto_against_html()
