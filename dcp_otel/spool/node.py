"""The node's exporter: a survivor that is no training process sends the spans live processes leave to it.

A process instrumented with ``span_export="node"`` builds no SDK span: it writes
each checkpoint's spans into its record's ``spans.jsonl`` (:mod:`dcp_otel.spool.spans`)
and exports nothing. The survivor of torchelastic's agent (``dcp-otel-run``, or
``torchrun`` under ``opentelemetry-instrument``) looks at the spool every second
(:mod:`dcp_otel.spool.survivor`) and, for each live record that says
``span_export: node`` of its own children, or of its job where the record's parent
runs no survivor (two agents of one job on a host: each sends its own workers'), sends the lines past the record's
``exported_through`` through the agent's exporters (:mod:`dcp_otel.spool.delivery`,
with the rank's own resource) and moves that mark in the record's file. The rank
reads the mark through its mapping and drops the lines it covers as it adds more.
Only the agent writes the mark of such a record; only the rank writes its lines.

Should the rank die, the lines past the mark are its death's survivor's to send,
as for any record: a line sent by both (the agent died while sending) reaches the
backend twice, and ``dcp-otel report`` counts each span once.

Usage::

    node = NodeExport(Delivery(provider, 10))
    node.take(name, path, (os.getpid(), start_ticks), job)   # for each live record, each look ...
    node.send_taken()                                        # ... then all of them, in one delivery
    node.forget(set(os.listdir(spool_dir)))                  # records gone
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final, NamedTuple

from opentelemetry.sdk.trace import ReadableSpan

from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.semconv import SPAN_EXPORT_NODE
from dcp_otel.spool import layout
from dcp_otel.spool.encoding import decode_sent_lines
from dcp_otel.spool.reader import RecordError, read_record

#: How long a record whose spans could not be sent waits before the next try.
RETRY_S: Final = 30.0


class _Facts(NamedTuple):
    """A live record's identity, read once (it changes only when the record is made again: ``created``)."""

    node: bool  # it leaves its spans to the node
    ppid: object
    parent_start: object
    job: object
    resource: Any
    created: int


class _Taken(NamedTuple):
    """A live record's lines read for the node, to be sent (see :meth:`NodeExport.send_taken`)."""

    name: str
    path: str
    spans: list[ReadableSpan]
    through: int


class NodeExport:
    """Sends the spans of the live processes that leave them to the node (see the module)."""

    def __init__(self, deliver: Callable[[Sequence[ReadableSpan]], bool],
                 can_deliver: Callable[[], bool] = lambda: True) -> None:  # fmt: skip
        self._deliver = deliver
        self._can_deliver = can_deliver
        # A live record, read once (its identity never changes): whether its spans are ours to send, and its resource.
        self._records: dict[str, _Facts] = {}
        self._retry_at: dict[str, float] = {}
        self.sent = 0  # spans sent
        self._taken: list[_Taken] = []  # read this look, sent at its end

    def forget(self, listed: set[str]) -> None:
        """The records no longer in the spool (dead and claimed, or removed at a clean end)."""
        self._records = {name: facts for name, facts in self._records.items() if name in listed}
        self._retry_at = {name: at for name, at in self._retry_at.items() if name in listed}

    def _facts(self, name: str, path: str, created: int) -> _Facts | None:
        facts = self._records.get(name)
        if facts is None or facts.created != created:  # (made again by a new instrumentation of the process: read again)
            try:
                record = read_record(path)
            except RecordError:
                return None  # (a record being made: read again next look)
            identity = record.identity
            node = identity.get("span_export") == SPAN_EXPORT_NODE
            facts = self._records[name] = _Facts(node, identity.get("ppid"), identity.get("parent_start"),
                                                 identity.get("job"), record.resource if node else None, created)  # fmt: skip
        return facts

    @staticmethod
    def ours(facts: _Facts, me: tuple[int, int | None], job: str | None, parents: Collection[int]) -> bool:
        """Whether this survivor sends the record's spans: a node record of its own child, or of its job whose parent
        runs no survivor (two agents of one job on a host: each sends its own workers')."""
        if not facts.node:
            return False
        if facts.ppid == me[0] and facts.parent_start == me[1]:
            return True
        return bool(job) and facts.job == job and facts.ppid not in parents

    def send(self, name: str, path: str, me: tuple[int, int | None], job: str | None,
             parents: Collection[int] = ()) -> int:  # fmt: skip
        """Send what the live process of record ``path`` left to the node since the last look: :meth:`take`, then
        :meth:`send_taken`; the spans sent."""
        self.take(name, path, me, job, parents)
        return self.send_taken()

    def take(self, name: str, path: str, me: tuple[int, int | None], job: str | None,
             parents: Collection[int] = ()) -> None:  # fmt: skip
        """Read what the live process of record ``path`` left to the node since the last look, for
        :meth:`send_taken` (``me``: this process's pid and start ticks, whose children's records are ours; ``job``:
        our run id; ``parents``: the pids of the other survivors on this host, whose children's records are
        theirs). Never raises."""
        try:
            try:
                with open(os.path.join(path, layout.RECORD_FILE), "rb") as rec:
                    head = os.pread(rec.fileno(), layout.OFF_EXPORTED + 8, 0)
                (created,) = layout.I64.unpack_from(head, layout.OFF_CREATED)
                (mark,) = layout.U64.unpack_from(head, layout.OFF_EXPORTED)
                facts = self._facts(name, path, created)
                if facts is None or not self.ours(facts, me, job, parents) or \
                        time.monotonic() < self._retry_at.get(name, 0.0):  # fmt: skip
                    return
                with open(os.path.join(path, layout.SPANS_FILE), encoding="utf-8") as src:
                    text = src.read()
                if not text:
                    return
            except (OSError, struct.error):
                return  # (gone meanwhile: a death, reported as one; or a record being made)
            spans, through = decode_sent_lines(text, mark, facts.resource)
            if spans:
                self._taken.append(_Taken(name, path, spans, through))
        except Exception as exc:  # noqa: BLE001 - the survivor goes on
            reraise_if_signalled(exc)
            report("survivor_error", "dcp_otel could not read a live process's spans for the node", exc_info=True)

    def send_taken(self) -> int:
        """Send what :meth:`take` read since the last call, every record's in one delivery (a look's eight ranks:
        one export request, and an exporter stuck on one rank's holds back none of the others), and move each
        record's mark; the spans sent. Never raises."""
        taken, self._taken = self._taken, []
        if not taken or not self._can_deliver():
            return 0
        try:
            if not self._deliver([span for each in taken for span in each.spans]):
                for each in taken:
                    self._retry_at[each.name] = time.monotonic() + RETRY_S
                report("survivor_not_sent", "dcp_otel could not send the spans of %s for the node; they wait in "
                       "their records", ", ".join(each.name for each in taken))  # fmt: skip
                return 0
        except Exception as exc:  # noqa: BLE001 - the survivor goes on
            reraise_if_signalled(exc)
            report("survivor_error", "dcp_otel could not send live processes' spans for the node", exc_info=True)
            return 0
        for each in taken:
            self.sent += len(each.spans)
            try:
                with open(os.path.join(each.path, layout.RECORD_FILE), "r+b") as rec:
                    os.pwrite(rec.fileno(), layout.U64.pack(each.through), layout.OFF_EXPORTED)
            except OSError:
                pass  # (it died meanwhile: its death's survivor sends them again; the report counts each once)
        return sum(len(each.spans) for each in taken)
