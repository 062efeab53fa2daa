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

Where the node exports the spans (``node=True``: ``span_export="node"``), this
process exports none: a survivor of the node that is no training process
(torchelastic's agent under ``dcp-otel-run`` or ``opentelemetry-instrument``)
sends the lines as they come and moves ``exported_through`` itself; this
process drops the lines through that mark as it adds more. It says so
(``spool_spans_unsent``) at its first checkpoint where its parent runs no
survivor, and each :data:`UNSENT_WARN_S` the mark stays put while lines wait.

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

from opentelemetry.sdk.resources import Resource

from dcp_otel import _forksafe
from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled, start_elsewhere
from dcp_otel.semconv import SCOPE_NAME
from dcp_otel.spool import layout
from dcp_otel.spool.delivery import span_processor
from dcp_otel.spool.encoding import decode_lines
from dcp_otel.spool.record import ProcessRecord
from dcp_otel.tracing.flushing import BoundedFlush, force_flush_said
from dcp_otel.tracing.steps import HURRY
from dcp_otel.version import __version__

#: The most a process keeps unconfirmed; past it, spans are not kept (a stuck exporter).
MAX_BYTES: Final = 4 << 20
#: The most spans left for the node that a process instrumented again in its own mode hands its span processor at once
#: (half a batch processor's default queue: what overflows it is dropped unsaid).
MAX_LEFT_SPANS: Final = 1024
#: How a line written for the node starts its scope's end (see layout.NODE_LINE).
_NODE_SCOPE: Final = f',"{layout.NODE_LINE}"],'.encode()
#: The least time between two of the confirming thread's flushes. Each flush is an export request, whose encoding
#: and round trip run beside the training steps: over OTLP/HTTP on loopback, 4.2 ms of that thread's CPU for a
#: checkpoint's 16 spans, 1.7 ms a checkpoint with this gap at a checkpoint every 0.16 s (``benchmarks/own_share.py
#: --otlp``, docs/performance.md). Checkpoints less than this apart share one (what is kept meanwhile is in the
#: record, for a survivor to send should the process die); further apart, nothing waits.
MIN_GAP_S: Final = 1.0
#: How long spans may wait in the record, the node exporting them, before this process says nobody sends them.
UNSENT_WARN_S: Final = 30.0


class SpanSpool:
    """The unconfirmed spans of one process (see the module); :meth:`add` never blocks on an exporter."""

    def __init__(self, record: ProcessRecord, provider: Callable[[], object], drain: Callable[[float], object],
                 timeout_s: float, node: bool = False) -> None:  # fmt: skip
        self._record = record
        self.node = node  # the node's exporter sends the lines and moves the mark (see the module)
        self._provider = provider
        self._drain = drain  # the builder: what it is building goes into the flush that confirms it
        self._timeout_s = timeout_s or 10.0
        # A line says whether it was written for the node to send (given to no exporter here): a later instrumentation
        # of this process in its own mode exports those it finds, and counts them with its own (see _adopt).
        self._scope = [SCOPE_NAME, __version__, layout.NODE_LINE] if node else [SCOPE_NAME, __version__]
        self._reset()
        _forksafe.register(self)

    def _reset(self) -> None:
        self._seq = 0
        self._ends: list[tuple[int, int]] = []  # (seq, the file's size through its line) of the lines kept
        self._wanted = threading.Event()
        self._hurry = threading.Event()  # cuts the gap between two flushes short (stop)
        self._thread: threading.Thread | None = None
        self._flush: BoundedFlush | None = None
        self._flushing = False  # the confirming thread is in the provider's force_flush (see confirm)
        self._stopped = False
        self._lock = threading.Lock()
        self._idle = threading.Condition()  # notified as the confirming thread finishes what was asked of it
        self._busy = False
        self._started_at = 0.0
        self._flushed_at = float("-inf")  # (monotonic) the confirming thread's last flush that went out ended
        self._mark = 0  # (node) the node exporter's mark, as last read
        self._waiting_since = 0.0  # (node, monotonic) since when kept lines wait for the mark to move

    def _after_fork_in_child(self) -> None:
        self._reset()

    def add(self, items: list[list[Any]]) -> None:
        r"""Keep one operation's spans (:func:`encode`\ d by the builder as each ended) until a flush confirms them;
        never raises."""
        directory = self._record.directory
        if not items or directory is None:
            if items and self.node:  # (the builder gave these to this process's exporters: span_export=node falls back)
                report("spool_error", "dcp_otel: span_export=node, but this process has no record: it exports its "
                       "checkpoint spans itself")  # fmt: skip
            return
        left: list[str] = []
        try:
            with self._lock:
                directory = self._record.directory  # (again: the record may have been closed meanwhile)
                if directory is None:
                    return
                if self._seq == 0:
                    left = self._adopt(os.path.join(directory, layout.SPANS_FILE))
                    if self.node and not _parent_sends(self._record.spool_dir):
                        report("spool_spans_unsent", "dcp_otel: span_export=node, but no agent of dcp-otel's started "
                               "this process (dcp-otel-run, or torchrun under opentelemetry-instrument): its "
                               "checkpoint spans wait in %s, for dcp-otel report", directory)  # fmt: skip
                if self.node:
                    self._take_mark(directory)
                seq = self._seq + 1
                line = json.dumps([seq, self._scope, items], separators=(",", ":"), default=str)
                size = self._ends[-1][1] if self._ends else 0  # (the file's, in bytes: the JSON is ASCII)
                kept = size + len(line) <= MAX_BYTES
                if not kept:
                    report("spool_spans_full", "dcp_otel keeps %d MiB of unexported spans per process: these are "
                           "not kept (the span exporter is stuck or slow)", MAX_BYTES >> 20)  # fmt: skip
                else:
                    with open(os.path.join(directory, layout.SPANS_FILE), "a", encoding="utf-8") as out:
                        out.write(line + "\n")
                    self._seq = seq
                    self._ends.append((seq, size + len(line) + 1))
            if left:  # (out of the lock: a synchronous processor exports as it is given them)
                self._export_left(left)
            if kept and not self.node:
                self._request()
        except Exception as exc:  # noqa: BLE001 - the builder goes on
            reraise_if_signalled(exc)
            report("spool_error", "dcp_otel could not keep a checkpoint's spans in its record", exc_info=True)

    def _adopt(self, path: str) -> list[str]:
        """(under the lock, at the first add) Lines an earlier instrumentation of this process left unsent (its record
        stayed, marked exited; the record made again has the same directory): kept, numbered on from them. The node
        sends them (the record's mark is 0 again); in this process's own mode, its next confirmed flush counts them
        with its own. Lines written for the node (an earlier ``span_export="node"``) were given to no exporter: they
        are given to this process's provider (the lines returned), else that flush would count them sent and nobody
        would send them."""
        try:
            with open(path, "rb") as kept:
                data = kept.read()
        except OSError:
            return []
        whole = data[: data.rfind(b"\n") + 1]  # (a line cut short by a death in the middle of its write: dropped)
        ends, end, for_node = [], 0, []
        for line in whole.splitlines(keepends=True):
            end += len(line)
            try:
                ends.append((int(line[1 : line.index(b",")]), end))
            except ValueError:
                continue
            if not self.node and line[: line.find(b"],") + 2].endswith(_NODE_SCOPE):  # (its scope: "[seq,[...],")
                for_node.append(line.decode("utf-8", "replace"))
        if len(whole) != len(data):
            with open(path, "r+b") as kept:
                kept.truncate(len(whole))
        if ends:
            self._ends, self._seq = ends, max(seq for seq, _ in ends)
        return for_node

    def _export_left(self, lines: list[str]) -> None:
        """(process mode) The node's lines an earlier instrumentation left, to this process's span processors."""
        provider = self._provider()
        processor = span_processor(provider)
        if processor is None:
            report("spool_error", "dcp_otel: %d checkpoint(s) of spans written for the node (span_export=node) are "
                   "left in the record, and this process has no SDK span processor to send them", len(lines))  # fmt: skip
            return
        resource = getattr(provider, "resource", None) or Resource.get_empty()
        spans = decode_lines("".join(lines), 0, resource)
        if len(spans) > MAX_LEFT_SPANS:  # (a batch processor's queue, 2,048 by default, drops what overflows it unsaid)
            report("spool_spans_full", "dcp_otel: %d spans written for the node (span_export=node) were left in the "
                   "record; this process sends the last %d, the rest are not sent", len(spans), MAX_LEFT_SPANS)  # fmt: skip
            spans = spans[-MAX_LEFT_SPANS:]
        for span in spans:
            processor.on_end(span)

    def _take_mark(self, directory: str) -> None:
        """(node, under the lock) Drop the lines the node's exporter has sent; say once if it sends nothing."""
        mark = layout.U64.unpack_from(self._record.mm, layout.OFF_EXPORTED)[0]
        now = time.monotonic()
        if mark != self._mark:
            self._mark, self._waiting_since = mark, now
            self._drop_through(os.path.join(directory, layout.SPANS_FILE), mark)
        if not self._ends:
            self._waiting_since = now
        elif now - self._waiting_since > UNSENT_WARN_S:
            report("spool_spans_unsent", "dcp_otel: the node has sent none of this process's spans for %.0f s (its agent "
                   "cannot reach its exporter, or is not dcp-otel's: span_export=node needs dcp-otel-run, or torchrun "
                   "under opentelemetry-instrument); they wait in %s", UNSENT_WARN_S, directory)  # fmt: skip
            self._waiting_since = now

    def left_untaken(self) -> bool:
        """(at the close) Whether lines an earlier instrumentation left wait in the record, never taken up by this one
        (it kept no line: a provider that records nothing, or no checkpoint since): the record stays for a survivor."""
        directory = self._record.directory
        try:
            return self._seq == 0 and directory is not None and \
                os.path.getsize(os.path.join(directory, layout.SPANS_FILE)) > 0  # fmt: skip
        except OSError:
            return False

    @property
    def unconfirmed(self) -> bool:
        return bool(self._ends)

    def start(self) -> None:
        """Start the confirming thread now (the instrumentation calls it as the first operation starts, on the
        caller's thread: cheap once it runs); never raises."""
        try:
            if self._stopped or self.node or self._running():  # (node: this process flushes nothing)
                return
            with self._lock:
                if self._running():
                    return
                thread = threading.Thread(target=self._run, name="dcp-otel-spool-confirm", daemon=True)
                # (The provider's flush drains the builder, whose wait for a training step it must not cut short.)
                setattr(thread, HURRY, False)
                start_elsewhere((thread,))
                # Kept once started: a signal handler's exception before this leaves no thread said to run that never
                # will (the next operation starts one); after it, one more thread waiting beside this one, at worst.
                self._thread, self._started_at = thread, time.monotonic()
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("spool_error", "dcp_otel could not start confirming its record's spans", exc_info=True)

    def _running(self) -> bool:
        """Whether the confirming thread runs, or is being started (its helper had a second; a start that failed,
        for want of threads, or a thread that died of an exporter's SystemExit, is replaced at the next request)."""
        thread = self._thread
        if thread is None:
            return False
        if thread.ident is None:
            return time.monotonic() - self._started_at < _START_S
        return thread.is_alive()

    def _request(self) -> None:
        self._wanted.set()
        self.start()  # (started with the first operation already: a no-op)

    def _run(self) -> None:
        # For as long as the instrumentation: a process that checkpoints every hour starts it once, not every hour.
        while not self._stopped:
            self._wanted.wait()
            gap = self._flushed_at + MIN_GAP_S - time.monotonic()
            if gap > 0:  # (what is added meanwhile goes out with this flush)
                self._hurry.wait(gap)
            with self._idle:
                self._busy = True
                self._wanted.clear()
            try:
                if not self._stopped and self.confirm():  # (a look that sent nothing, or failed, holds back no other)
                    self._flushed_at = time.monotonic()
            except BaseException as exc:  # noqa: BLE001 - an exporter's SystemExit: this thread goes on confirming
                reraise_if_signalled(exc)  # (never here, off the main thread; what the library's rule asks)
                report("spool_error", "dcp_otel could not confirm a record's exported spans: %s", type(exc).__name__)
            finally:
                with self._idle:
                    self._busy = False
                    self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether the confirming thread has done all it was asked (waiting up to ``timeout_s``)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._busy and not self._wanted.is_set(), timeout_s)

    def _drop_through(self, path: str, target: int) -> None:
        """The lines through ``target`` went out: the file keeps only those added since (under the lock). Checkpoints
        back to back add while a flush runs: a file emptied only when nothing was added meanwhile would fill up."""
        ends = self._ends
        cut = 0
        while ends and ends[0][0] <= target:
            cut = ends.pop(0)[1]
        if not ends:  # nothing added since: empty the file
            with open(path, "w", encoding="utf-8"):
                pass
        elif cut:  # the rest, in a file of its own first: a survivor reading meanwhile sees one or the other whole
            with open(path, "rb") as kept:
                kept.seek(cut)
                rest = kept.read()
            with open(path + ".new", "wb") as out:
                out.write(rest)
            os.replace(path + ".new", path)
            self._ends = [(seq, end - cut) for seq, end in ends]

    def close_record(self, clean: bool) -> None:
        """Close the record (:meth:`ProcessRecord.close`) with no line being written or dropped meanwhile: the
        confirming thread, told to stop but not waited for at exit, may be between its flush and its drop, which
        would make ``spans.jsonl`` again in a record being removed (a directory with no record, which no survivor
        can read: torchelastic's agent then waited its whole timeout for that rank's death)."""
        with self._lock:
            self._record.close(clean=clean)

    def stop(self, timeout_s: float) -> None:
        """End the confirming thread (uninstrument); what it was flushing is given ``timeout_s``."""
        self._stopped = True
        self._hurry.set()
        self._wanted.set()
        thread = self._thread
        # Not waited for while it is in the provider's flush (a stuck exporter never returns from it; the thread is
        # a daemon and ends when it does), nor when its start never came (it ends at once if it comes now).
        if thread is not None and thread is not threading.current_thread() and not self._flushing \
                and thread.ident is not None:  # fmt: skip
            thread.join(timeout_s)

    def confirm(self, timeout_s: float | None = None) -> bool:
        """Flush the provider; if everything went out, mark what was kept before as exported. Never raises.

        One flush at a time: while one is stuck (a collector that never answers), no other starts, and what is
        kept waits (bounded) for the next look.
        """
        try:
            if self.node:  # the node's exporter sends them: whether it has, now (never waited for)
                with self._lock:
                    directory = self._record.directory
                    if directory is not None:
                        self._take_mark(directory)
                    return not self._ends
            target = self._seq
            if target == 0 or (self._flush is not None and self._flush.running()) or (
                    self._flushing and threading.current_thread() is not self._thread):  # fmt: skip
                return False
            timeout = self._timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + timeout
            self._drain(timeout)
            if threading.current_thread() is self._thread:
                # Flushed here, on the confirming thread: a thread made and ended for every checkpoint can crash a
                # faulthandler dump of all threads that lands meanwhile (cpython#116008). A stuck exporter holds
                # this thread alone, and the next confirmation waits for it (one flush at a time).
                force_flush = getattr(self._provider(), "force_flush", None)
                self._flushing = True
                try:
                    flushed = force_flush is None or force_flush_said(force_flush, "span", max(0, int(timeout * 1000)))
                finally:
                    self._flushing = False
            else:
                if self._flushing:
                    return False
                self._flush = BoundedFlush(self._provider(), "span", deadline, quiet=True, hurry=False)
                flushed = self._flush.wait() is True
            if not flushed:
                return False
            with self._lock:
                layout.U64.pack_into(self._record.mm, layout.OFF_EXPORTED, target)
                directory = self._record.directory
                if directory is not None:
                    self._drop_through(os.path.join(directory, layout.SPANS_FILE), target)
            return True
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("spool_error", "dcp_otel could not confirm a record's exported spans", exc_info=True)
            return False


def _parent_sends(spool_dir: str) -> bool:
    """Whether this process's parent runs a survivor (it says so in the spool): the node's exporter, for its children."""
    return os.path.exists(os.path.join(spool_dir, layout.survivor_name(os.getppid())))


#: How long a starting confirming thread's helper has to start it before it counts as failed (and is replaced).
_START_S: Final = 1.0
