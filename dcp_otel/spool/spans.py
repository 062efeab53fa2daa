"""Spans built but not yet known to be exported, kept beside the record until an exporter confirms them.

A ``BatchSpanProcessor`` holds finished spans in memory for up to its schedule
delay (5 s by default): a process killed then takes every one of them along,
the last finished checkpoints' included. So the builder also appends each
operation's spans to the record's ``spans.jsonl`` (a line per operation, a
compact JSON form of what the SDK's ``ReadableSpan`` holds), and asks for a
flush of the tracer provider on a thread of its own; once that flush says
everything went out, the record says so (``exported_through``) and the file is
emptied. A survivor exports only the lines after that mark. What a flush could
not confirm may reach the backend twice; ``dcp-otel report`` drops duplicates.

The file is bounded (:data:`MAX_BYTES`): past it, spans are not kept (counted
as ``spool_spans_full``), never waited for.

Usage::

    keep = SpanSpool(record, recorder.provider, recorder.drain, timeout_s=10)
    keep.add([encode(span) for span in spans])   # the builder, as an operation's spans end (spool.encoding)
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from dcp_otel import _forksafe
from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.semconv import SCOPE_NAME
from dcp_otel.spool import layout
from dcp_otel.spool.record import ProcessRecord
from dcp_otel.tracing.flushing import BoundedFlush
from dcp_otel.version import __version__

#: The most a process keeps unconfirmed; past it, spans are not kept (a stuck exporter).
MAX_BYTES: Final = 4 << 20


class SpanSpool:
    """The unconfirmed spans of one process (see the module); :meth:`add` never blocks on an exporter."""

    def __init__(self, record: ProcessRecord, provider: Callable[[], object], drain: Callable[[float], object],
                 timeout_s: float) -> None:  # fmt: skip
        self._record = record
        self._provider = provider
        self._drain = drain  # the builder: what it is building goes into the flush that confirms it
        self._timeout_s = timeout_s or 10.0
        self._reset()
        _forksafe.register(self)

    def _reset(self) -> None:
        self._seq = 0
        self._size = 0
        self._wanted = threading.Event()
        self._thread: threading.Thread | None = None
        self._flush: BoundedFlush | None = None
        self._stopped = False
        self._lock = threading.Lock()

    def _after_fork_in_child(self) -> None:
        self._reset()

    def add(self, items: list[list[Any]]) -> None:
        r"""Keep one operation's spans (:func:`encode`\ d by the builder as each ended) until a flush confirms them;
        never raises."""
        directory = self._record.directory
        if not items or directory is None:
            return
        try:
            with self._lock:
                seq = self._seq + 1
                line = json.dumps([seq, [SCOPE_NAME, __version__], items], separators=(",", ":"), default=str)
                if self._size + len(line) > MAX_BYTES:
                    report("spool_spans_full", "dcp_otel keeps %d MiB of unexported spans per process: these are "
                           "not kept (the span exporter is stuck or slow)", MAX_BYTES >> 20)  # fmt: skip
                    return
                with open(os.path.join(directory, layout.SPANS_FILE), "a", encoding="utf-8") as out:
                    out.write(line + "\n")
                self._seq = seq
                self._size += len(line) + 1
            self._request()
        except Exception as exc:  # noqa: BLE001 - the builder goes on
            reraise_if_signalled(exc)
            report("spool_error", "dcp_otel could not keep a checkpoint's spans in its record", exc_info=True)

    @property
    def unconfirmed(self) -> bool:
        return self._size > 0

    def _request(self) -> None:
        self._wanted.set()
        if not self._stopped and (self._thread is None or not self._thread.is_alive()):
            self._thread = threading.Thread(target=self._run, name="dcp-otel-spool-confirm", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while self._wanted.wait(_IDLE_S) and not self._stopped:  # (a process that stops checkpointing keeps no thread)
            self._wanted.clear()
            self.confirm()

    def stop(self, timeout_s: float) -> None:
        """End the confirming thread (uninstrument); what it was flushing is given ``timeout_s``."""
        self._stopped = True
        self._wanted.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def confirm(self, timeout_s: float | None = None) -> bool:
        """Flush the provider; if everything went out, mark what was kept before as exported. Never raises.

        One flush at a time: while one is stuck (a collector that never answers), no other starts, and what is
        kept waits (bounded) for the next look.
        """
        try:
            target = self._seq
            if target == 0 or (self._flush is not None and self._flush.running()):
                return False
            timeout = self._timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + timeout
            self._drain(timeout)
            self._flush = BoundedFlush(self._provider(), "span", deadline, quiet=True, hurry=False)
            if self._flush.wait() is not True:
                return False
            with self._lock:
                layout.U64.pack_into(self._record.mm, layout.OFF_EXPORTED, target)
                directory = self._record.directory
                if target == self._seq and directory is not None:  # nothing added since: empty the file
                    with open(os.path.join(directory, layout.SPANS_FILE), "w", encoding="utf-8"):
                        pass
                    self._size = 0
            return True
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("spool_error", "dcp_otel could not confirm a record's exported spans", exc_info=True)
            return False


#: How long the confirming thread waits for more before it ends (a new one starts with the next operation).
_IDLE_S: Final = 60.0
