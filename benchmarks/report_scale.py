"""The report of a large run: 500 checkpoints on 64 ranks (152,500 spans), in seconds.

Generates the run's OTLP JSON files (``tests/generated_run.py``), then times each
stage of ``dcp-otel report``: reading the files, building the model, the
terminal text (summary and the 10 worst) and the HTML page. Side by side, the
same files read through protobuf's JSON parser, which the report used before.
Goal: the whole report in seconds.

Usage::

    .venv/bin/python benchmarks/report_scale.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dcp_otel.otlp_file import _documents, from_otlp_json, read_spans, spans_of  # noqa: E402
from dcp_otel.report import Report  # noqa: E402
from dcp_otel.report.model import checkpoints  # noqa: E402
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


if __name__ == "__main__":
    main()
