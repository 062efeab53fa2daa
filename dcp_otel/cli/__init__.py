"""``dcp-otel``: the command line (also ``python -m dcp_otel``).

Usage::

    dcp-otel demo [--ranks 4] [--slow-rank R] [--fail-rank R] [--out out/demo]
    dcp-otel report out/demo/traces [--html report.html [--trace-url URL]] [--perfetto trace.json] [--all]
                                    [--exit-code]   # exit 1 when a checkpoint failed or never finished
    dcp-otel check           # would opentelemetry-instrument's set-up send spans from here? (exit 1: why not)
    dcp-otel status [--targets DIR | --prometheus URL] [--run ID]   # where each rank of a running job is
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final

from dcp_otel import demo
from dcp_otel.cli import status
from dcp_otel.cli.check import check_otel_setup
from dcp_otel.otlp_file import SpanFileError
from dcp_otel.report import DETAIL_LIMIT, build
from dcp_otel.report.page_data import check_trace_url
from dcp_otel.version import __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcp-otel", description="Observability for PyTorch Distributed Checkpoint.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser("demo", help="run a small multi-rank training job that checkpoints, and report")
    demo.add_arguments(run_demo)
    commands.add_parser("check", help="run OpenTelemetry's zero-code set-up with this environment and say whether "
                                      "spans would leave (an empty export probes the endpoint)")
    status.add_arguments(commands.add_parser(
        "status", help="where each rank of a running job's open checkpoint is (stuck ranks first, with their "
                       "stack), from its endpoints or a Prometheus; exit 1 when one is stalled"))
    report = commands.add_parser("report", help="report the checkpoints in OTLP JSON trace files")
    report.add_argument("traces", nargs="+", type=Path, help="trace files, or folders of .json/.jsonl files")
    report.add_argument("--html", type=Path, help="also write the report as a self-contained HTML page")
    report.add_argument("--perfetto", type=Path, help="also write a Chrome/Perfetto trace JSON")
    report.add_argument("--all", action="store_true", help=f"every checkpoint in detail (default: the {DETAIL_LIMIT} worst)")
    report.add_argument("--exit-code", action="store_true",
                        help="exit 1 when a checkpoint in the files failed or never finished (for a CI step to gate on)")
    report.add_argument("--trace-url", metavar="TEMPLATE",
                        help="in the HTML page, link each span to your trace UI: a URL with {trace_id} (and optionally "
                             "{span_id}), e.g. 'https://grafana.example/explore?left={\"queries\":[{\"query\":\"{trace_id}\"}]}'")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "check":
        return _check()
    try:
        if args.command == "demo":
            return demo.run(args)
        if args.command == "status":
            return status.run(args)
        check_trace_url(args.trace_url)
        for path in (args.html, args.perfetto):  # before the work, not after it
            if path is not None and not path.resolve().parent.is_dir():
                raise ValueError(f"cannot write {path}: its folder {path.resolve().parent} does not exist")
        result = build(args.traces)
    except (ValueError, SpanFileError) as exc:  # SpanFileError is a ValueError; both are the user's to fix
        parser.exit(2, f"dcp-otel {args.command}: error: {exc}\n")
    for note in result.damaged:
        print(f"dcp-otel report: warning: {printable(note)}", file=sys.stderr)
    try:
        print(printable(result.text(limit=None if args.all else DETAIL_LIMIT)), end="", flush=True)
    except BrokenPipeError:  # `dcp-otel report ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's flush at exit would fail again)
        return 1
    outputs: list[tuple[Path | None, str, Callable[[], str]]] = [
        (args.html, "report (HTML)", lambda: result.html(args.trace_url)),
        (args.perfetto, "trace (Perfetto)", lambda: json.dumps(result.perfetto())),
    ]
    for path, what, render in outputs:
        if path is None:
            continue
        try:
            path.write_text(render(), encoding="utf-8")
        except OSError as exc:  # a folder that is not there, not writable, a full disk: the user's to fix
            parser.exit(2, f"dcp-otel {args.command}: error: cannot write {path}: {exc.strerror or exc}\n")
        print(f"{what}: {path}")
    bad = [c for c in result.checkpoints if c.error or c.is_unfinished]
    return 1 if args.exit_code and bad else 0


#: Control characters a span's text may carry (an escape sequence in an exception message), shown escaped.
_CONTROLS: Final = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\n\t"}


def printable(text: str) -> str:
    """``text`` with its control characters escaped (``\\x1b``), newlines and tabs kept: safe for a terminal."""
    return text.translate(_CONTROLS)


def _check() -> int:
    found = check_otel_setup()
    for line in found.lines():
        print(f"  {line}")
    problems = found.problems()
    for problem in problems:
        print(f"dcp-otel check: problem: {problem}", file=sys.stderr)
    print("dcp-otel check: " + ("spans will not leave this process" if problems else "ok"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
