"""A whole spool read as span files are: what ``dcp-otel report <spool dir>`` reads.

Every record under a spool directory, whoever reported it: a reported one ends
as its survivor said (``death.json``); one nobody reported ends, "how is not
known", at the last moment it shows its process alive; one whose process still
runs on this host is left out (what it has open now is not an ending).

Usage::

    spans = read_spool("/dev/shm/dcp-otel-1000", notes)    # -> list[ReadableSpan]; notes say what was skipped
"""

from __future__ import annotations

import json
import os

from opentelemetry.sdk.trace import ReadableSpan

from dcp_otel.spool import layout
from dcp_otel.spool.reader import UNKNOWN, Death, RecordError, read_record


def record_directories(path: str) -> list[str]:
    """The record directories under ``path`` (a spool), or ``[path]`` when it is one; ``[]`` when neither."""
    if os.path.isfile(os.path.join(path, layout.RECORD_FILE)):
        return [path]
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    return [os.path.join(path, name) for name in names
            if layout.parse_name(name) is not None and os.path.isfile(os.path.join(path, name, layout.RECORD_FILE))]


def read_spool(path: str, notes: list[str]) -> list[ReadableSpan]:
    """The spans of every record under ``path`` as their survivor sent them, or would have (``dcp-otel report``).

    A reported record ends as its ``death.json`` says; one nobody reported ends, "how is not known", at the
    last moment it shows its process alive. A record whose process still runs on this host is left out.
    """
    spans: list[ReadableSpan] = []
    running = unreported = 0
    for directory in record_directories(path):
        parsed = layout.parse_name(os.path.basename(directory))
        try:
            record = read_record(directory)
        except RecordError as exc:
            notes.append(f"{exc}; skipped")
            continue
        if parsed is not None and not parsed.state and parsed.host == layout.host_name() and layout.alive(parsed.pid, parsed.start):
            running += 1
            continue
        death = _death_of(directory)
        if death is None:
            unreported += 1
            death = Death(UNKNOWN, record.last_seen_ns)
        spans.extend(record.spans(death))
        notes.extend(f"{directory}: {note}: skipped (a line its process was writing as it died)" for note in record.notes)
    if running:
        notes.append(f"{path}: {running} processes still run: what they have open now is not in this report")
    if unreported:
        notes.append(f"{path}: {unreported} dead processes were reported by no survivor: read from their records "
                     "(how they died is not known)")  # fmt: skip
    return spans


def _death_of(directory: str) -> Death | None:
    try:
        with open(os.path.join(directory, layout.DEATH_FILE), encoding="utf-8") as src:
            found = json.load(src)
        code = found.get("exit_code")
        return Death(str(found["cause"]), int(found["end_ns"]), int(code) if isinstance(code, int) else None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
