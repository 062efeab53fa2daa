"""The write-ahead record of one process: what a survivor needs, written before anything can go wrong.

A process can die at any instant (SIGKILL from the OOM killer, ``abort()`` from
NCCL's watchdog, a segfault in a storage plugin, SIGTERM's default action) and
run nothing as it dies. So the hot path writes what is open *as it opens*, into
a file mapped into the process (:mod:`dcp_otel.spool.layout`): a store into
memory the kernel keeps after the process is gone, never a system call, never
a wait for a disk. Per DCP call that is one ``struct.pack_into`` as it starts
(its span id, start, operation and name, in its thread's ring of calls), written
inline by the tracker, and one as it ends (the end time); per operation, its
trace ids and attributes once as it starts, and its end and outcome once as it
ends. The stall watchdog adds a heartbeat and the stacks it read;
the builder adds the last durable checkpoint and the spans it made
(:mod:`dcp_otel.spool.spans`).

The file is made at the process's first operation; until then the same stores
go to a buffer that is copied into it, so a thread registered before is
recorded too. A forked child gets a buffer of its own again (it never writes
into its parent's file) and its own file at its own first operation. At a
normal exit, with nothing open and every span exported, the directory is
removed: what stays in the spool is what a death left.

Usage::

    record = ProcessRecord("/dev/shm/dcp-otel-1000", identity)
    stack = ThreadStack(record.thread_base())   # once per thread (base -1: no slot left)
    record.ensure()                          # at an operation's start: the file exists from now on
    record.op_begin(op, start_ns, parent_span_id)   # the operation's ids and attributes
    call.rec = stack.base + ((stack.calls & RING_MASK) << ENTRY_SHIFT); stack.calls += 1   # the tracker, inline:
    ENTRY.pack_into(record.mm, call.rec, span_id, start_ns, 0, op.rec_serial, KIND_CODES["step"], b"write_data")
    I64.pack_into(record.mm, call.rec + OFF_ENTRY_END, end_ns)
    record.op_done(op)
    record.close(clean=True)                 # at exit
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import stat
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from dcp_otel import _forksafe
from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.spool import layout
from dcp_otel.spool.layout import (
    HEADER,
    I64,
    OP_HEAD,
    OP_SIZE,
    OP_SLOTS,
    OPS_OFFSET,
    RECORD_SIZE,
    THREAD_SIZE,
    THREAD_SLOTS,
    THREADS_OFFSET,
    U32,
    U64,
    UPLOAD,
)

if TYPE_CHECKING:
    from dcp_otel.tracing.records import Operation

_pack_i64 = I64.pack_into
_pack_failed = layout.FAILED.pack_into
_pack_head = OP_HEAD.pack_into
_pack_u64 = U64.pack_into
_pack_complete = layout.COMPLETE.pack_into


def open_spool_dir(path: str) -> str:
    """Make ``path`` (mode 0700) if it is missing; raise ``PermissionError`` if it is not this user's alone.

    Records say which checkpoints a job wrote and where it was when it died: another user must not read
    them, nor plant records this user's survivors would export.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    found = os.stat(path)
    if not stat.S_ISDIR(found.st_mode):
        raise PermissionError(f"{path} is not a directory")
    if hasattr(os, "getuid") and found.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user (uid {found.st_uid})")
    if found.st_mode & 0o077:
        raise PermissionError(f"{path} is open to other users (mode {stat.S_IMODE(found.st_mode):o}); chmod 700 it")
    return path


class ProcessRecord:
    """One process's record in the spool (see the module); its writes never raise and never block."""

    def __init__(self, spool_dir: str, identity: Callable[[], Mapping[str, Any]]) -> None:
        self.spool_dir = spool_dir
        self._identity = identity
        self.process_span_id = int.from_bytes(os.urandom(8), "little") or 1
        self.created_ns = time.time_ns()
        self._reset()
        _forksafe.register(self)

    def _reset(self) -> None:
        #: Where the stores go: the mapped file once it exists, a buffer of the same layout before.
        self.mm: bytearray | mmap.mmap = bytearray(RECORD_SIZE)
        self.directory: str | None = None
        self._pid = 0
        self._failed = False
        self._threads: dict[int, int] = {}  # thread id -> its slot
        self._free_ops = list(range(OP_SLOTS - 1, -1, -1))
        self._slot_ops: list[Operation | None] = [None] * OP_SLOTS  # the operation each slot holds now
        self._serial = 0
        self._lock = threading.Lock()  # slot allocation: per thread and per operation, never per step

    def _after_fork_in_child(self) -> None:
        """A forked child writes nothing into its parent's file: a buffer again, its own file at its first operation."""
        mm = self.mm
        self._reset()
        if isinstance(mm, mmap.mmap):
            try:
                mm.close()
            except (BufferError, OSError):
                pass
        self.process_span_id = int.from_bytes(os.urandom(8), "little") or 1
        self.created_ns = time.time_ns()

    # --- the file ------------------------------------------------------------------------------
    def made_here(self) -> bool:
        """Whether this process has a record of its own (it made a DCP call; a forked child, since the fork)."""
        return self.directory is not None and self._pid == os.getpid()

    def ensure(self) -> bool:
        """Make the file if this process has none yet (at each operation's start: cheap once made)."""
        if self._pid == os.getpid():
            return True
        if self._failed:
            return False
        with self._lock:
            if self._pid == os.getpid():
                return True
            try:
                self._create()
                return True
            except Exception as exc:  # noqa: BLE001 - no record: the process goes on, what a death leaves is less
                reraise_if_signalled(exc)
                self._failed = True
                report("spool_error", "dcp_otel cannot keep a record of this process in %s: %s (what a death of "
                       "this process leaves is not reported)", self.spool_dir, exc)  # fmt: skip
                return False

    def _create(self) -> None:
        pid = os.getpid()
        start = layout.start_ticks(pid) or 0
        directory = os.path.join(open_spool_dir(self.spool_dir), layout.directory_name(layout.host_name(), pid, start))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(directory, layout.RECORD_FILE), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, RECORD_SIZE)
            mm = mmap.mmap(fd, RECORD_SIZE)
        finally:
            os.close(fd)
        mm[:] = bytes(self.mm)  # what was recorded before the file existed (threads registered, calls open)
        ppid = os.getppid()
        identity = {**self._identity(), "pid": pid, "ppid": ppid, "parent_start": layout.start_ticks(ppid),
                    "host": layout.host_name(), "start": start}  # fmt: skip
        HEADER.pack_into(mm, 0, layout.MAGIC, layout.VERSION, self.created_ns, 0, 0, -1, 0, self.process_span_id, 0, 0)
        self._write_json(mm, layout.OFF_IDENTITY, identity, layout.IDENTITY_MAX)
        self.mm, self.directory, self._pid = mm, directory, pid

    @staticmethod
    def _write_json(mm: bytearray | mmap.mmap, offset: int, value: object, limit: int) -> bool:
        data = json.dumps(value, separators=(",", ":"), default=str).encode()
        if len(data) > limit:
            return False
        mm[offset + 4 : offset + 4 + len(data)] = data
        U32.pack_into(mm, offset, len(data))  # the length last: a reader never takes a half-written document
        return True

    def close(self, clean: bool) -> None:
        """The process is ending normally: remove the record if ``clean`` (nothing open, every span exported),
        else mark it exited so that a survivor exports what is left. Never raises."""
        directory = self.directory
        if directory is None or self._pid != os.getpid():
            return
        try:
            if clean:
                self.directory = None
                self.mm = bytearray(RECORD_SIZE)
                self._pid = 0
                shutil.rmtree(directory, ignore_errors=True)
            else:
                _pack_i64(self.mm, layout.OFF_EXITED, time.time_ns())
                U64.pack_into(self.mm, layout.OFF_FLAGS, layout.FLAG_EXITED)
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("spool_error", "dcp_otel could not close this process's record", exc_info=True)

    # --- threads and calls (the hot path) -------------------------------------------------------
    def thread_base(self) -> int:
        """The offset of the calling thread's entries (once per thread); -1 when every slot is taken."""
        ident = threading.get_ident()
        with self._lock:
            slot = self._threads.get(ident)
            if slot is None:
                taken = set(self._threads.values())
                if len(taken) >= THREAD_SLOTS:  # threads come and go (one executor per async save): free the dead
                    living = {thread.ident for thread in threading.enumerate()}
                    self._threads = {i: s for i, s in self._threads.items() if i in living}
                    taken = set(self._threads.values())
                slot = next((s for s in range(THREAD_SLOTS) if s not in taken), None)
                if slot is None:
                    report("spool_threads_full", "dcp_otel records the DCP calls of %d threads at most: the calls of "
                           "this thread are not written ahead", THREAD_SLOTS)  # fmt: skip
                    return -1
                self._threads[ident] = slot
            base = THREADS_OFFSET + slot * THREAD_SIZE
            self.mm[base : base + THREAD_SIZE] = bytes(THREAD_SIZE)  # nothing of a thread that had it before
            return base

    # --- operations ----------------------------------------------------------------------------
    def op_begin(self, op: Operation, start_ns: int, parent_span_id: int) -> None:
        """``op`` starts (on the caller's thread, once per operation): its ids and attributes.

        Written as a Python literal (read back with ``ast.literal_eval``, which builds plain values and runs no
        code): ``repr`` runs no bytecode, json's encoder runs some of its own on the caller's thread.
        """
        if self._pid != os.getpid() and not self.ensure():
            return
        was_open = False
        with self._lock:
            self._serial = serial = self._serial + 1
            if self._free_ops:
                slot = self._free_ops.pop()
            else:  # none is refused: one gives way (see _give_way)
                slot, was_open = self._give_way()
                victim = self._slot_ops[slot]
                if victim is not None:
                    victim.rec_slot = -1  # (it writes into the slot no more)
            # This operation's from here, with no call between (a start cut short gives it back: abandon).
            self._slot_ops[slot] = op
            op.rec_slot = slot
        if was_open:
            report("spool_operation_evicted", "dcp_otel records %d open operations at most: the oldest one's "
                   "record gave way to a new one", OP_SLOTS)  # fmt: skip
        try:
            mm, offset = self.mm, OPS_OFFSET + slot * OP_SIZE
            _pack_u64(mm, offset, 0)  # first: a reader skips the slot until its serial says it is whole
            data = repr({"trace": op.trace_id, "span": op.span_id, "root": op.root_span_id, "parent": parent_span_id,
                         "name": op.name, "start": start_ns, "flags": int(op.flags), "adopted": op.adopted,
                         "attributes": op.attributes, "step_attributes": op.step_attributes}).encode()  # fmt: skip
            if len(data) > layout.OP_JSON_MAX:  # attributes too long for a slot (a very long checkpoint id): the ids
                data = repr({"trace": op.trace_id, "span": op.span_id, "root": op.root_span_id,
                             "parent": parent_span_id, "name": op.name, "start": start_ns, "flags": int(op.flags),
                             "adopted": op.adopted}).encode()  # fmt: skip
            mm[offset + layout.OFF_OP_JSON : offset + layout.OFF_OP_JSON + len(data)] = data
            _pack_head(mm, offset, 0, layout.OP_STATE_OPEN, 0, 0, 0, 0, 0, 0, 0, len(data))
            _pack_failed(mm, offset + layout.OFF_OP_FAILED, b"")
            _pack_u64(mm, offset, serial)  # the serial last
            op.rec_serial = serial
        except Exception as exc:  # noqa: BLE001 - the hot path: counted, never raised
            reraise_if_signalled(exc)
            report("spool_error", "dcp_otel could not write an operation ahead", exc_info=True)

    def _give_way(self) -> tuple[int, bool]:
        """The slot a new operation takes when none is free (under the lock), and whether an open one loses it.

        First a slot no operation holds (a start cut short between taking it and writing it), then the oldest
        complete operation (ended, its outcome written, waiting for the builder: a tight loop of state-dict
        calls outruns the builder by dozens; it is built and exported all the same, only a death in the next
        moments would lose it), and only then the oldest open one: counted, and said.
        """
        mm, ops = self.mm, self._slot_ops
        complete: list[tuple[int, int]] = []
        opened: list[tuple[int, int]] = []
        for slot in range(OP_SLOTS):
            if ops[slot] is None:
                return slot, False
            offset = OPS_OFFSET + slot * OP_SIZE
            serial, state = U64.unpack_from(mm, offset)[0], U64.unpack_from(mm, offset + layout.OFF_OP_STATE)[0]
            (opened if state == layout.OP_STATE_OPEN else complete).append((serial, slot))
        if complete:
            return min(complete)[1], False
        return min(opened)[1], True

    def abandon(self, start_uuid: str) -> None:
        """The start of call ``start_uuid`` was cut short (see :mod:`dcp_otel.tracing.cut_short`): an operation
        it began never runs, and its slot is free again."""
        with self._lock:
            begun = [op for op in self._slot_ops if op is not None and op.start_uuid == start_uuid and not op.submitted]
        for op in begun:
            slot = op.rec_slot
            if slot >= 0:
                _pack_u64(self.mm, OPS_OFFSET + slot * OP_SIZE, 0)  # as if never written (it never ran)
                self._release(op, slot)

    def op_complete(self, op: Operation) -> None:
        """``op`` ended (handed to the builder, on the caller's thread): how it ended, until it is built."""
        slot = op.rec_slot
        if slot >= 0:
            offset = OPS_OFFSET + slot * OP_SIZE
            failed = op.failed
            if failed is not None:  # (a failure is rare: a save that succeeds writes its end and state only)
                _pack_failed(self.mm, offset + layout.OFF_OP_FAILED, failed.encode())
            _pack_complete(self.mm, offset + layout.OFF_OP_STATE, layout.OP_STATE_COMPLETE, op.end_ns)

    def op_done(self, op: Operation) -> None:
        """``op`` is built (its spans kept until exported), or dropped: its slot is free again."""
        slot = op.rec_slot
        if slot < 0:
            return
        try:
            if op.rec_serial:
                U64.pack_into(self.mm, OPS_OFFSET + slot * OP_SIZE + layout.OFF_OP_STATE, layout.OP_STATE_DONE)
            self._release(op, slot)
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("spool_error", "dcp_otel could not mark an operation done in its record", exc_info=True)

    def _release(self, op: Operation, slot: int) -> None:
        with self._lock:
            if self._slot_ops[slot] is op:
                self._slot_ops[slot] = None
                self._free_ops.append(slot)
        op.rec_slot = -1

    def background(self, op: Operation, staging: bool, span_id: int, start_ns: int, end_ns: int = 0) -> None:
        """An async save's upload (or staging) that no thread is inside, started or (``end_ns``) ended."""
        slot = op.rec_slot
        if slot < 0:
            return
        offset = OPS_OFFSET + slot * OP_SIZE + (layout.OFF_OP_STAGING if staging else layout.OFF_OP_UPLOAD)
        UPLOAD.pack_into(self.mm, offset, span_id, start_ns, end_ns)

    # --- what the watchdog and the builder add ------------------------------------------------
    def heartbeat(self, now_ns: int, step: int | None) -> None:
        """The process was alive at ``now_ns`` (the watchdog's tick)."""
        if self.directory is not None:
            _pack_i64(self.mm, layout.OFF_HEARTBEAT, now_ns)
            _pack_i64(self.mm, layout.OFF_STEP, -1 if step is None else step)

    def recovery(self, end_ns: int, checkpoint_id: str) -> None:
        """The last durable save (the builder, once it succeeded): the id first, its time last."""
        if self.directory is None:
            return
        encoded = checkpoint_id.encode()[: layout.RECOVERY_ID_SIZE]
        self.mm[layout.OFF_RECOVERY_ID : layout.OFF_RECOVERY_ID + layout.RECOVERY_ID_SIZE] = encoded.ljust(
            layout.RECOVERY_ID_SIZE, b"\0")  # fmt: skip
        _pack_i64(self.mm, layout.OFF_RECOVERY, end_ns)

    def stacks(self, by_span: Mapping[int, str]) -> None:
        """The Python stacks the watchdog read for open calls (span id -> text, credentials already redacted), as
        the last stall report saw them; each cut to its innermost frames until all fit."""
        if self.directory is None:
            return
        limit = layout.STACKS_SIZE - layout.STACK_HEAD.size
        for keep in (8000, 2000, 500):
            data = json.dumps({str(k): v[-keep:] for k, v in by_span.items()}, separators=(",", ":")).encode()
            if len(data) <= limit:
                break
        else:
            return
        start = layout.STACKS_OFFSET + layout.STACK_HEAD.size
        layout.STACK_HEAD.pack_into(self.mm, layout.STACKS_OFFSET, 0, 0)
        self.mm[start : start + len(data)] = data
        layout.STACK_HEAD.pack_into(self.mm, layout.STACKS_OFFSET, len(data), zlib.crc32(data))
