"""A record read back, after its process died: the spans the process would have sent, with its own ids.

:func:`read_record` takes a record directory (:mod:`dcp_otel.spool.layout`)
apart: the process's identity, its operations and the calls open on each of its
threads when it died, the stacks its watchdog last read, its last durable save,
and the spans it had built but not seen exported. :meth:`Record.spans` turns
that into ``ReadableSpan``\\ s of the dead process's resource, as its own
ending would have: every call still open ends, as ERROR, at the death,
"terminated by SIGKILL during write_data" (with the stack where the watchdog
had read one, and ``dcp.interrupted``); the steps of an unfinished operation
that had already ended come with their own times; the coordinator's
``dcp.checkpoint`` root, if it was open; and the process's ``dcp.process``
span (how it ended, its recovery point and training step). Trace and span ids
are the ones the process chose, so a span sent twice is one span to
``dcp-otel report`` (and one per id in a trace backend).

Usage::

    record = read_record("/dev/shm/dcp-otel-1000/node-3.4242.81234")
    spans = record.spans(Death.of_status(-9, time.time_ns()))
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import signal
import zlib
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from dcp_otel import semconv
from dcp_otel.spool import layout
from dcp_otel.spool.encoding import decode_lines
from dcp_otel.version import __version__

_SCOPE = InstrumentationScope(semconv.SCOPE_NAME, __version__)
UNKNOWN = "unknown"
INTERRUPTED_TYPE = "dcp_otel.Interrupted"
_INTERNAL = SpanKind.INTERNAL


class RecordError(ValueError):
    """Not a record (another file, another version, cut short)."""


@dataclass(frozen=True)
class Death:
    """How and when a process ended, as far as the survivor can tell."""

    cause: str  # a signal's name, "exit", or "unknown"
    end_ns: int
    exit_code: int | None = None

    @classmethod
    def of_status(cls, returncode: int | None, end_ns: int) -> Death:
        """From a ``Popen.returncode``-style status: ``-9`` is SIGKILL, ``1`` an exit, ``None`` not known."""
        if returncode is None:
            return cls(UNKNOWN, end_ns)
        if returncode < 0:
            try:
                return cls(signal.Signals(-returncode).name, end_ns)
            except ValueError:
                return cls(f"signal {-returncode}", end_ns)
        return cls(semconv.ENDED_BY_EXIT, end_ns, returncode)

    @property
    def head(self) -> str:
        if self.cause == UNKNOWN:
            return "ended when its process died (how is not known)"
        if self.cause == semconv.ENDED_BY_EXIT:
            return f"ended when its process exited with status {self.exit_code}"
        return f"terminated by {self.cause}"


@dataclass
class OpRecord:
    serial: int
    state: int
    doc: dict[str, Any]
    upload: tuple[int, int, int]
    staging: tuple[int, int, int]
    end_ns: int = 0  # once complete
    failed: str | None = None  # how it failed, once complete (None: it succeeded)

    @property
    def trace_id(self) -> int:
        return int(self.doc["trace"])

    @property
    def flags(self) -> TraceFlags:
        return TraceFlags(int(self.doc.get("flags", 1)))

    def attributes(self, whole: bool) -> dict[str, Any]:
        found = self.doc.get("attributes" if whole else "step_attributes")
        return dict(found) if isinstance(found, dict) else {}


@dataclass
class Entry:
    span_id: int
    parent_id: int
    start_ns: int
    end_ns: int
    serial: int
    kind: str
    name: str
    thread: int


@dataclass
class Record:
    """One process's record, read back (see the module)."""

    path: str
    identity: dict[str, Any]
    created_ns: int
    heartbeat_ns: int
    recovery_ns: int
    recovery_id: str
    step: int | None
    exported_through: int
    process_span_id: int
    exited: bool
    ops: dict[int, OpRecord]
    entries: list[Entry]
    stacks: dict[int, str]
    spans_text: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def resource(self) -> Resource:
        found = self.identity.get("resource")
        attributes = dict(found) if isinstance(found, dict) else {}
        attributes.setdefault("process.pid", self.identity.get("pid", 0))
        return Resource({k: tuple(v) if isinstance(v, list) else v for k, v in attributes.items()})

    @property
    def last_seen_ns(self) -> int:
        """The latest moment the record shows the process alive."""
        times = [self.created_ns, self.heartbeat_ns, *(e.start_ns for e in self.entries), *(e.end_ns for e in self.entries)]
        for op in self.ops.values():
            times += [int(op.doc.get("start", 0)), op.upload[1], op.upload[2], op.staging[1], op.staging[2]]
        return max(times)

    def open_ops(self) -> list[OpRecord]:
        return [op for op in self.ops.values() if op.state == layout.OP_STATE_OPEN]

    def unbuilt_ops(self) -> list[OpRecord]:
        """Operations that ended but were not built when the process died (their spans exist nowhere else)."""
        return [op for op in self.ops.values() if op.state == layout.OP_STATE_COMPLETE]

    def open_entries(self, op: OpRecord) -> list[Entry]:
        """The calls of ``op`` with no end yet, outermost first (the order they started in)."""
        return sorted((e for e in self.entries if e.serial == op.serial and not e.end_ns), key=lambda e: e.start_ns)

    def has_evidence(self) -> bool:
        """Whether a survivor has anything to say: a DCP call was made, or spans wait to be exported."""
        return bool(self.ops) or bool(self.unexported())

    def unexported(self, damaged: list[str] | None = None) -> list[ReadableSpan]:
        return decode_lines(self.spans_text, self.exported_through, self.resource, damaged)

    # --- the spans ------------------------------------------------------------------------------
    def spans(self, death: Death) -> list[ReadableSpan]:
        """What the process would have sent had it ended its open calls itself (see the module)."""
        resource = self.resource
        spans = self.unexported(self.notes)
        if not self.exited:
            for op in self.open_ops():
                spans.extend(self._interrupted(op, death, resource))
            for op in self.unbuilt_ops():
                spans.extend(self._interrupted(op, death, resource, ended=True))
            process = self._process_span(death, resource)
            if process is not None:
                spans.append(process)
        return spans

    def _interrupted(self, op: OpRecord, death: Death, resource: Resource, ended: bool = False) -> list[ReadableSpan]:
        """The spans of ``op``: open, ended by the death; or (``ended``) complete, with its own end and outcome."""
        open_entries = [] if ended else self.open_entries(op)
        description = (op.failed or "") if ended else self._description(op, open_entries, death)
        trace_id, flags = op.trace_id, op.flags
        end = op.end_ns if ended and op.end_ns else max(death.end_ns, self.last_seen_ns)
        step_attributes = op.attributes(whole=False)
        spans: list[ReadableSpan] = []
        # Each thread's stack, as the watchdog last read it inside any of its open calls (innermost first): on
        # every call still open on that thread, as the process's own ending puts it.
        stacks: dict[int, str] = {}
        for entry in reversed(open_entries):
            if entry.span_id in self.stacks:
                stacks.setdefault(entry.thread, self.stacks[entry.span_id])
        op_stack = next(iter(stacks.values()), None)

        def make(name: str, span_id: int, parent_id: int, start: int, attributes: dict[str, Any],
                 failed: bool, stack: str | None = None, end_ns: int = end) -> ReadableSpan:  # fmt: skip
            events = []
            if failed and ended:  # an operation that failed by itself: its outcome, no death of its
                context = SpanContext(trace_id, span_id, False, flags)
                parent = SpanContext(trace_id, parent_id, False, flags) if parent_id else None
                return ReadableSpan(name=name, context=context, parent=parent, resource=resource,
                                    attributes=attributes, kind=_INTERNAL, status=Status(StatusCode.ERROR, description[:256]),
                                    start_time=start, end_time=end_ns, instrumentation_scope=_SCOPE)  # fmt: skip
            if failed:
                attributes = {**attributes, semconv.ATTR_INTERRUPTED: death.cause, semconv.ATTR_END_INFERRED: True}
                event = {"exception.type": INTERRUPTED_TYPE, "exception.message": description}
                if stack:
                    event["exception.stacktrace"] = stack
                events.append(Event("exception", event, end_ns))
            context = SpanContext(trace_id, span_id, False, flags)
            parent = SpanContext(trace_id, parent_id, False, flags) if parent_id else None
            status = Status(StatusCode.ERROR, description[:256]) if failed else Status(StatusCode.UNSET)
            return ReadableSpan(name=name, context=context, parent=parent, resource=resource, attributes=attributes,
                                events=events, kind=_INTERNAL, status=status, start_time=start, end_time=end_ns,
                                instrumentation_scope=_SCOPE)  # fmt: skip

        start = int(op.doc.get("start", 0)) or self.created_ns
        failed_op = not ended or op.failed is not None
        if op.doc.get("root"):
            spans.append(make(semconv.SPAN_CHECKPOINT, int(op.doc["root"]), 0, start, op.attributes(whole=True),
                              failed_op))  # fmt: skip
        op_span = int(op.doc.get("span", 0))
        if op_span and not op.doc.get("adopted"):
            attributes = op.attributes(whole=True)
            if failed_op and self.recovery_ns and end >= self.recovery_ns:  # the work at risk: since the last save
                attributes[semconv.ATTR_RECOVERY_POINT_AGE] = round((end - self.recovery_ns) / 1e9, 3)
            spans.append(make(semconv.SPAN_PREFIX + str(op.doc.get("name", "")), op_span, int(op.doc.get("parent", 0)),
                              start, attributes, failed_op, self.stacks.get(op_span, op_stack)))  # fmt: skip
        for entry in self.entries:
            if entry.serial != op.serial or entry.span_id == op_span:
                continue
            failed = not entry.end_ns  # (one that ended: a step of the unfinished operation, with its own times)
            if failed and ended:
                continue  # a complete operation's call that never said its end: not one to guess
            name = (semconv.SPAN_COLLECTIVE_PREFIX if entry.kind == "collective" else semconv.SPAN_PREFIX) + \
                entry.name.split("|")[0]  # fmt: skip
            attributes = dict(step_attributes)
            if entry.kind == "collective":  # "gather_object|all_reduce|write": the method, whom it serves
                for key, value in zip((semconv.ATTR_COLLECTIVE_PATTERN, semconv.ATTR_COLLECTIVE_STEP),
                                      entry.name.split("|")[1:], strict=False):  # fmt: skip
                    if value:
                        attributes[key] = value
            stack = stacks.get(entry.thread) if failed else None
            spans.append(make(name, entry.span_id, entry.parent_id, entry.start_ns, attributes, failed, stack,
                              end if failed else entry.end_ns))  # fmt: skip
        for kind_name, (span_id, started, finished) in ((semconv.SPAN_ASYNC_STAGING, op.staging),
                                                        (semconv.SPAN_ASYNC_UPLOAD, op.upload)):  # fmt: skip
            if span_id:
                spans.append(make(kind_name, span_id, op_span, started, dict(step_attributes), not finished,
                                  end_ns=finished or end))  # fmt: skip
        return spans

    def _description(self, op: OpRecord, open_entries: list[Entry], death: Death) -> str:
        """Where the operation was: "terminated by SIGKILL during write_data", "... while waiting in gather_object
        (all_reduce)", "... between steps", "... during write_data in the checkpoint process"."""
        where = self.identity.get("where")
        where_text = f" in the {where}" if where else ""
        innermost = open_entries[-1] if open_entries else None  # (the latest to start: nothing nests in it)
        waiting = step = None
        if innermost is not None and innermost.kind == "collective":
            method, _, rest = innermost.name.partition("|")
            pattern = rest.split("|")[0]  # the _DistWrapper method the collective serves, as a stack names it
            waiting = f"waiting in {method}" + (f" (_DistWrapper.{pattern})" if pattern else "")
            below = [e for e in open_entries if e.span_id == innermost.parent_id]  # the step it serves, if one
            step = below[0].name if below and below[0].kind == "step" else None
        elif innermost is not None and innermost.kind == "step":
            step = innermost.name
        if step is None:
            background = "async upload" if op.upload[0] and not op.upload[2] else None
            if waiting:
                return f"{death.head} while {waiting}{where_text}"
            if background:
                return f"{death.head} during its {background}{where_text}"
            return f"{death.head} between steps{where_text}"
        return f"{death.head} during {step}{where_text}" + (f", {waiting}" if waiting else "")

    def _process_span(self, death: Death, resource: Resource) -> ReadableSpan | None:
        """The ``dcp.process`` span its own ending would have made (only for a process that made a DCP call)."""
        if not self.ops:
            return None
        last = self.ops[max(self.ops)].attributes(whole=True)
        attributes: dict[str, Any] = {k: last[k] for k in (semconv.ATTR_RANK, semconv.ATTR_WORLD_SIZE,
                                                              semconv.ATTR_RUN_ID, semconv.ATTR_GENERATION) if k in last}
        attributes["process.pid"] = int(self.identity.get("pid", 0))
        attributes[semconv.ATTR_ENDED_BY] = death.cause
        if death.exit_code is not None:
            attributes["process.exit.code"] = death.exit_code
        end = max(death.end_ns, self.last_seen_ns)
        if self.recovery_ns and end >= self.recovery_ns:
            attributes[semconv.ATTR_RECOVERY_POINT_AGE] = round((end - self.recovery_ns) / 1e9, 3)
            attributes[semconv.ATTR_RECOVERY_POINT_ID] = self.recovery_id
        if self.step is not None:
            attributes[semconv.ATTR_TRAINING_STEP] = self.step
        digest = hashlib.sha256(f"{os.path.basename(self.path)}/{self.process_span_id}".encode()).digest()
        trace_id = int.from_bytes(digest[:16], "big") or 1
        context = SpanContext(trace_id, self.process_span_id, False, TraceFlags(TraceFlags.SAMPLED))
        status = Status(StatusCode.ERROR, death.head.replace("ended when its process", "the process"))
        return ReadableSpan(name=semconv.SPAN_PROCESS, context=context, parent=None, resource=resource,
                            attributes=attributes, kind=_INTERNAL, status=status, start_time=self.created_ns,
                            end_time=end, instrumentation_scope=_SCOPE)  # fmt: skip


def read_record(path: str) -> Record:
    """Read the record directory ``path`` (raises :class:`RecordError` if it is not one)."""
    try:
        with open(os.path.join(path, layout.RECORD_FILE), "rb") as src:
            data = src.read()
    except OSError as exc:
        raise RecordError(f"{path}: no record ({exc.strerror})") from None
    if len(data) != layout.RECORD_SIZE or data[:8] != layout.MAGIC:
        raise RecordError(f"{path}: not a dcp-otel record")
    (_, version, created, heartbeat, recovery, step, exported, process_span, flags, _) = layout.HEADER.unpack_from(data, 0)
    if version != layout.VERSION:
        raise RecordError(f"{path}: a record of another dcp-otel (layout {version}, this one reads {layout.VERSION})")
    identity = _json_at(data, layout.OFF_IDENTITY) or {}
    recovery_id = data[layout.OFF_RECOVERY_ID : layout.OFF_RECOVERY_ID + layout.RECOVERY_ID_SIZE].rstrip(b"\0")
    ops: dict[int, OpRecord] = {}
    for slot in range(layout.OP_SLOTS):
        offset = layout.OPS_OFFSET + slot * layout.OP_SIZE
        serial, state, op_end, *background, length = layout.OP_HEAD.unpack_from(data, offset)
        if not serial or not length:
            continue
        (failed_bytes,) = layout.FAILED.unpack_from(data, offset + layout.OFF_OP_FAILED)
        failed = failed_bytes.rstrip(b"\0").decode(errors="replace") or None
        try:  # a Python literal: literal_eval builds plain values, never runs code
            doc = ast.literal_eval(data[offset + layout.OFF_OP_JSON : offset + layout.OFF_OP_JSON + length].decode())
            int(doc["trace"])
        except (ValueError, KeyError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        ops[serial] = OpRecord(serial, state, doc, tuple(background[:3]), tuple(background[3:]), op_end, failed)
    entries: list[Entry] = []
    for thread in range(layout.THREAD_SLOTS):
        base = layout.THREADS_OFFSET + thread * layout.THREAD_SIZE
        for index in range(layout.RING):
            span_id, start, end, serial, kind, name = layout.ENTRY.unpack_from(data, base + (index << layout.ENTRY_SHIFT))
            if span_id and start > 0 and serial in ops and kind in layout.KINDS:
                entries.append(Entry(span_id, 0, start, end, serial, layout.KINDS[kind],
                                     name.rstrip(b"\0").decode(errors="replace"), thread))  # fmt: skip
    _nest(entries, ops)
    stacks: dict[int, str] = {}
    size, crc = layout.STACK_HEAD.unpack_from(data, layout.STACKS_OFFSET)
    body = data[layout.STACKS_OFFSET + layout.STACK_HEAD.size :][:size]
    if size and zlib.crc32(body) == crc:
        try:
            stacks = {int(k): str(v) for k, v in json.loads(body).items()}
        except (ValueError, AttributeError):
            stacks = {}
    try:
        with open(os.path.join(path, layout.SPANS_FILE), encoding="utf-8", errors="replace") as src:
            spans_text = src.read()
    except OSError:
        spans_text = ""
    return Record(path, identity if isinstance(identity, dict) else {}, created, heartbeat, recovery,
                  recovery_id.decode(errors="replace"), step if step >= 0 else None, exported, process_span,
                  bool(flags & layout.FLAG_EXITED), ops, entries, stacks, spans_text)  # fmt: skip


def _nest(entries: list[Entry], ops: dict[int, OpRecord]) -> None:
    """Each entry's parent: the call it started inside on its thread (calls nest strictly within a thread); a
    thread's outermost call of an operation nests in what the operation does there: the operation's own span on
    the thread that called it, its upload on the thread that ran the upload, the span it was continued from in a
    checkpoint process."""
    by_thread: dict[int, list[Entry]] = {}
    for entry in entries:
        by_thread.setdefault(entry.thread, []).append(entry)
    for calls in by_thread.values():
        calls.sort(key=lambda e: e.start_ns)
        caller = {e.serial for e in calls if e.kind == "operation"}  # the operations called on this thread
        for index, entry in enumerate(calls):
            op = ops[entry.serial]
            enclosing = next((e for e in reversed(calls[:index]) if e.serial == entry.serial
                              and (not e.end_ns or e.end_ns >= entry.start_ns)), None)  # fmt: skip
            if enclosing is not None:
                entry.parent_id = enclosing.span_id
            elif entry.kind == "operation" or op.doc.get("adopted"):
                entry.parent_id = int(op.doc.get("parent", 0))
            elif entry.serial in caller or not op.upload[0]:
                entry.parent_id = int(op.doc.get("span", 0))
            else:
                entry.parent_id = op.upload[0]


def _json_at(data: bytes, offset: int) -> Any:
    (length,) = layout.U32.unpack_from(data, offset)
    if not length or length > layout.IDENTITY_MAX:
        return None
    try:
        return json.loads(data[offset + 4 : offset + 4 + length])
    except ValueError:
        return None
