"""The test as a survivor: report the processes a test killed, as an agent that saw them end would.

A test that kills an instrumented process plays the part of the process that
outlives it (torchelastic's agent, a peer, the next generation): it hands
dcp-otel's own :class:`~dcp_otel.spool.survivor.Survivor` how the process
ended, and reads what the survivor sends, as OTLP would carry it.

Usage::

    spans = survive(spool_dir, {proc.pid: proc.returncode})   # -> list[FileSpan]
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan

from dcp_otel.otlp_file import FileSpan, spans_of
from dcp_otel.spool import layout
from dcp_otel.spool.survivor import Survivor


def survive(spool: Path, statuses: dict[int, int | None], default: int | None = None) -> list[FileSpan]:
    """Report the records of ``statuses``' processes (pid -> ``Popen.returncode``) from ``spool``, and with
    ``default`` every other dead process's (a job the test stopped as a whole); what was sent."""
    sent: list[ReadableSpan] = []

    def deliver(spans: Sequence[ReadableSpan]) -> bool:
        sent.extend(spans)
        return True

    # The agent that saw them end knew each by its pid and start (as torchelastic's workers are known to it).
    found = {parsed.pid: parsed.start for name in records(spool) if (parsed := layout.parse_name(name)) and not parsed.state}
    keys = {(pid, found.get(pid)): status for pid, status in statuses.items()}
    if default is not None:
        keys = {**{(pid, start): default for pid, start in found.items()}, **keys}
    survivor = Survivor(str(spool), deliver, job=None)
    survivor.expect(keys, time.time_ns())
    survivor.scan()
    return list(spans_of(encode_spans(sent))) if sent else []


def records(spool: Path) -> list[str]:
    """The names of the record directories in ``spool`` (reported or not)."""
    return sorted(os.listdir(spool)) if spool.exists() else []
