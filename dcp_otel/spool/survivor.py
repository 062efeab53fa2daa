"""The survivor: a process that outlives another reports its death from the record it left.

Every instrumented process that can outlive others runs one (a thread,
``dcp-otel-survivor``, waking every second): torchelastic's agent under
``opentelemetry-instrument`` and ``dcp-otel-run`` (they see each worker's exit
status), the ranks (their peers'), the next generation of ranks after a
restart (the previous one's), and the parent of ``torch.multiprocessing.spawn``
ranks. While its process is inside a checkpoint call it keeps quiet (for at most
:data:`QUIET_MAX_S`, a death it is told of excepted). Each wake it lists the
spool directory and, for each record whose process is gone (its pid no longer
runs with the start time the record names), decides whether the death is its to report:

* the exit status was handed to it (:meth:`Survivor.expect`: the agent, the
  moment torchelastic closed its workers), or the dead process was its own
  child: at once;
* the dead process was of its own job (the same run id, from
  ``DCP_OTEL_RUN_ID``, torchrun's or SLURM's): after a grace of
  :data:`GRACE_S`, which leaves the agent, who knows how it died, to go first.

It then claims the record (a rename: one survivor wins), rebuilds the spans
the process would have sent (:mod:`dcp_otel.spool.reader`), sends them
(:mod:`dcp_otel.spool.delivery`), writes ``death.json`` and marks the record
reported. A survivor that cannot send anywhere claims nothing; one that dies
while sending leaves a claim another takes over. Reported records stay for
``dcp-otel report <spool dir>`` for :data:`KEEP_S`.

A survivor that is no training process (``live=True``: the agent's) is also the
node's exporter for the processes that leave theirs to it (``span_export="node"``):
each look, it sends the lines of their ``spans.jsonl`` past the record's
``exported_through`` and moves that mark (:mod:`dcp_otel.spool.node`).

Usage::

    survivor = Survivor(spool_dir, Delivery(provider, 10), own=record)
    survivor.start()                           # the thread
    survivor.expect({(4242, 81234): -9}, time.time_ns())  # the agent: how its workers ended (pid, start ticks)
    survivor.wait_idle(5)                      # at exit: what it took is sent
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from opentelemetry.sdk.trace import ReadableSpan

from dcp_otel import _forksafe, semconv
from dcp_otel._selftelemetry import report
from dcp_otel._wake import Wake
from dcp_otel.live.signal_exceptions import join_started, reraise_if_signalled, start_elsewhere
from dcp_otel.spool import layout
from dcp_otel.spool.node import NodeExport
from dcp_otel.spool.reader import Death, RecordError, read_record

#: How long a survivor that was not told how a process died leaves its record to the one that was.
GRACE_S: Final = 2.0
#: How often the spool is looked at.
INTERVAL_S: Final = 1.0
#: How long a look may wait while this process is inside a checkpoint call (a look takes the interpreter lock
#: from it: its planning and staging; a rank blocked in a collective by a dead peer is inside one too, so the
#: wait is short), and how often it asks whether the call has returned. An expected death is looked for at once.
QUIET_MAX_S: Final = 2.0
_QUIET_POLL_S: Final = 0.5  # (the call's end wakes it: Survivor.nudge; a look wakes a thread, costing the caller)
#: How long reported records are kept for ``dcp-otel report``, and at most how many (a dead process's record
#: that no survivor reported goes after as long).
KEEP_S: Final = 7 * 24 * 3600.0
KEEP_MAX: Final = 256
#: A process whose death nobody saw died at most this long after the last sign of life its record holds
#: (the watchdog's heartbeat, every second).
_HEARTBEAT_NS: Final = 1_000_000_000
#: How long an exit status handed over is kept for a record not seen yet.
_EXPECTED_S: Final = 60.0
#: How long a record whose spans could not be sent waits before this survivor tries again.
RETRY_S: Final = 30.0


class _DeadFacts(NamedTuple):
    """What decides whose a dead process's record is to report (see :meth:`Survivor._death_if_ours`)."""

    evidence: bool
    identity: dict[str, Any]
    last_seen_ns: int


class Survivor:
    """Reports the deaths its process outlives (see the module)."""

    def __init__(self, spool_dir: str, deliver: Callable[[Sequence[ReadableSpan]], bool], job: str | None,
                 own: Callable[[], str | None] = lambda: None, interval_s: float = INTERVAL_S,
                 grace_s: float = GRACE_S, checkpointing: Callable[[], bool] = lambda: False,
                 live: bool = False) -> None:  # fmt: skip
        self.spool_dir = spool_dir
        self._live = live  # the node's exporter: it sends the spans of live processes that leave them to it
        self._checkpointing = checkpointing  # whether this process is inside a checkpoint call now
        self.deliver = deliver
        self._can_deliver: Callable[[], bool] = getattr(deliver, "can_deliver", lambda: True)
        self.job = job
        self._own = own  # the directory of this process's own record, never reported by itself
        self._interval_s = interval_s
        self._grace_s = grace_s
        self._reset()
        _forksafe.register(self)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._wake = Wake()  # (set from the training thread too: see dcp_otel._wake)
        self._idle = threading.Condition()
        self._busy = False
        self._quiet = False  # a look is held back while this process is inside a checkpoint call (see nudge)
        self._scans = 0  # looks at the spool completed
        self.started = False  # its thread was started (read on every operation's start: one attribute)
        self._thread: threading.Thread | None = None
        self._stopped = False
        # (pid, start ticks) -> (status, when it was seen); a start of None: not read, only a child of ours matches
        self._expected: dict[tuple[int, int | None], tuple[int | None, int]] = {}
        self._seen_dead: dict[str, float] = {}  # record name -> when this survivor first saw its process gone
        self._my_start = layout.start_ticks(os.getpid())
        self._retry_at: dict[str, float] = {}  # record name -> when to try again a send that failed
        # A dead process's record, as read once: what decides whose death it is (by its name). A
        # dead process writes nothing more and a claim renames its record, so a path's facts never change; read
        # again every second, the records of other jobs' dead processes cost each rank 0.5 ms apiece a look, and
        # their liveness and times, read again too, 0.2 ms apiece where training threads hold the interpreter lock
        # (each system call gives it up, and waits to get it back).
        self._dead: dict[str, _DeadFacts] = {}
        self._mtimes: dict[str, float] = {}  # name -> its mtime, for records that change no more (dead, reported)
        self.reported = 0
        self.spans_sent = 0  # the spans of the deaths reported
        # The node's exporter: it sends the spans of live processes that leave them to it (spool.node).
        self.node = NodeExport(self.deliver, self._can_deliver) if self._live else None
        self.delivering = False  # another process's spans are on their way (through this process's exporters)

    def _after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) is nobody's survivor."""
        self._reset()
        self._stopped = True

    # --- life -----------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            thread = self._thread  # (one made but not started yet by its helper: it will be)
            if self._stopped or (thread is not None and (thread.ident is None or thread.is_alive())):
                return
            self._announce(True)
            thread = self._thread = threading.Thread(target=self._run, name="dcp-otel-survivor", daemon=True)
            self.started = True
            start_elsewhere((thread,))  # (at the first operation's start, on the application's thread)

    def _announce(self, here: bool) -> None:
        """Say (or stop saying) in the spool that this survivor runs: its children's deaths are its to report."""
        path = os.path.join(self.spool_dir, layout.survivor_name(os.getpid()))
        try:
            if here:
                with open(path, "w", encoding="utf-8"):
                    pass
            else:
                os.unlink(path)
        except OSError:
            pass

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None:
            self._announce(False)
        self._stopped = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            join_started(thread, timeout_s)

    def nudge(self) -> None:
        """A checkpoint operation's call ended (called on its thread, once a checkpoint): a look held back while
        it ran happens now. One lock release (:class:`~dcp_otel._wake.Wake`), only while the thread holds a look back."""
        if self._quiet:
            self._wake.set()

    def expect(self, statuses: Mapping[tuple[int, int | None], int | None], end_ns: int, job: str | None = None) -> None:
        """These processes (this process's workers, by pid and start ticks: a reused pid is another process) ended
        with these statuses: report them now. ``job``: their run id, where this survivor has none of its own (an
        agent): their helpers' records are then its to report."""
        with self._lock:
            if job and not self.job:
                self.job = job
            for key, status in statuses.items():
                self._expected[key] = (status, end_ns)
            stale = end_ns - int(_EXPECTED_S * 1e9)
            self._expected = {key: seen for key, seen in self._expected.items() if seen[1] >= stale}
        self._wake.set()  # (the thread, where it runs, looks now)

    def wait_idle(self, timeout_s: float, final: bool = False) -> bool:
        """Until no death this survivor was told of is left to report (at exit); ``False`` past the timeout.

        ``final``: the process (a rank of the job) is leaving, and no survivor may come after it: the deaths of
        its job it has seen are reported now, without the grace left to the agent. A process that made no
        checkpoint of its own leaves them to the others: its exit never waits on another's spans.
        """
        thread = self._thread
        if thread is None or not thread.is_alive():
            return True
        if final:
            self._grace_s = 0.0
        else:
            with self._lock:
                if not self._expected:
                    return True  # told of no death: nothing this exit waits for (a look under way goes on as a daemon)
        deadline = time.monotonic() + timeout_s
        with self._idle:
            looked = self._scans + self._busy  # (a look under way began before this: the one after it counts)
        self._wake.set()
        with self._idle:
            return self._idle.wait_for(lambda: self._scans > looked and not self._busy and not self._pending_expected(),
                                       max(0.0, deadline - time.monotonic()))  # fmt: skip

    def _pending_expected(self) -> bool:
        """Whether a process this survivor was told of has a record it has yet to try to report."""
        if not self._expected or not self._can_deliver():
            return False
        names = {(parsed.pid, parsed.start) for parsed in map(layout.parse_name, self._names())
                 if parsed and not parsed.state and parsed.base not in self._retry_at}  # fmt: skip
        return any(key in names for key in self._expected)

    def _run(self) -> None:
        self._can_deliver()  # (what it loads, it loads here, not in an exit that waits for this thread)
        woken, quiet_since = False, 0.0
        while not self._stopped:
            if not woken and self._checkpointing():  # a look now would slow that call: later, within QUIET_MAX_S
                now = time.monotonic()
                quiet_since = quiet_since or now
                if now - quiet_since < QUIET_MAX_S:
                    self._quiet = True  # (the call's end wakes it now: nudge)
                    woken = self._wake.wait(min(_QUIET_POLL_S, QUIET_MAX_S - (now - quiet_since)))
                    self._quiet = False
                    if woken:  # (cleared only when seen set: a wake between the wait and a clear is never lost)
                        self._wake.clear()
                    continue
            quiet_since = 0.0
            with self._idle:
                self._busy = True
            try:
                self.scan()
            except Exception as exc:  # noqa: BLE001 - the survivor never dies of a bad record
                reraise_if_signalled(exc)
                report("survivor_error", "dcp_otel's survivor failed to look at the spool", exc_info=True)
            finally:
                with self._idle:
                    self._busy = False
                    self._scans += 1
                    self._idle.notify_all()
            woken = self._wake.wait(self._interval_s)
            if woken:
                self._wake.clear()

    # --- one look -------------------------------------------------------------------------------
    def _names(self) -> list[str]:
        try:
            return os.listdir(self.spool_dir)
        except OSError:
            return []

    def scan(self, now_ns: int | None = None) -> int:
        """Report every death that is this survivor's to report now; the number reported."""
        now_ns = now_ns or time.time_ns()
        host, me, own = layout.host_name(), os.getpid(), self._own()
        due: list[tuple[layout.RecordName, str, Death]] = []  # the deaths to report, sent together after the look
        reported: list[tuple[float, str]] = []
        names = self._names()
        parents = layout.other_survivors(self.spool_dir, names, host)
        if self._dead or self._mtimes or self.node is not None:
            listed = set(names)
            self._dead = {name: facts for name, facts in self._dead.items() if name in listed}
            self._mtimes = {name: mtime for name, mtime in self._mtimes.items() if name in listed}
            if self.node is not None:
                self.node.forget(listed)
        try:
            for name in names:
                parsed = layout.parse_name(name)
                if parsed is None or parsed.host != host or parsed.state == layout.SURVIVOR:
                    continue  # not a record, or another host's (a spool shared over the network): not ours to judge
                if parsed.state == layout.REPORTED:  # (reported, it changes no more: its time is read once)
                    mtime = self._mtimes.get(name)
                    if mtime is None:
                        mtime = self._mtimes[name] = layout.mtime(os.path.join(self.spool_dir, name))
                    reported.append((mtime, os.path.join(self.spool_dir, name)))
                    continue
                path = os.path.join(self.spool_dir, name)
                if own is not None and os.path.basename(own) == name:
                    continue
                if parsed.state.startswith(layout.CLAIMED):
                    _, claimer, start = parsed.state.split(".")
                    if layout.alive(int(claimer), int(start)):
                        continue  # its claimer is at it
                elif name not in self._dead and layout.alive(parsed.pid, parsed.start):  # (seen dead: dead for good)
                    if self.node is not None and not parsed.state:
                        self.node.take(name, path, (me, self._my_start), self.job, parents)  # (sent after the look)
                    continue
                death = self._death_if_ours(parsed, path, me, now_ns, parents)
                if death is not None:
                    due.append((parsed, path, death))
                elif time.time() - self._seen_at(name) > KEEP_S:
                    shutil.rmtree(path, ignore_errors=True)  # a dead process nobody reported in a week: the spool is bounded
        finally:  # (what was read for the node goes out, or is read again next look: never both)
            if self.node is not None:
                self.node.send_taken()  # (every live record's lines in one delivery, as the deaths')
        self._prune(reported)
        return self._report(due)

    def _seen_at(self, name: str) -> float:
        """When a record was last written (read once: a dead process writes no more)."""
        mtime = self._mtimes.get(name)
        if mtime is None:
            path = os.path.join(self.spool_dir, name)
            mtime = self._mtimes[name] = layout.mtime(path) if os.path.isdir(path) else time.time()
        return mtime

    def _forget(self, parsed: layout.RecordName) -> None:
        with self._lock:
            self._expected.pop((parsed.pid, parsed.start), None)
            self._expected.pop((parsed.pid, None), None)

    def _death_if_ours(self, parsed: layout.RecordName, path: str, me: int, now_ns: int,
                       parents: set[int]) -> Death | None:  # fmt: skip
        name = os.path.basename(path)
        facts = self._dead.get(name)
        if facts is None:
            try:
                record = read_record(path)
            except RecordError:
                return None  # (not kept: a read may fail for a while, as when another survivor has it claimed)
            facts = self._dead[name] = _DeadFacts(record.has_evidence(), record.identity, record.last_seen_ns)
        if not facts.evidence:
            shutil.rmtree(path, ignore_errors=True)  # died without a DCP call: nothing to say
            return None
        identity = facts.identity
        # Our own child (a worker of this agent, a spawned rank): its parent was this process, not one before it
        # with the same pid.
        child = identity.get("ppid") == me and identity.get("parent_start") == self._my_start
        with self._lock:
            expected = self._expected.get((parsed.pid, parsed.start)) or (
                self._expected.get((parsed.pid, None)) if child else None)  # fmt: skip
        if expected is not None:
            return Death.of_status(expected[0], expected[1])
        if child:
            status = layout.exit_status_of_child(parsed.pid)  # (read without reaping it: its owner still will)
            if status is not None:
                return Death.of_status(status, now_ns)
        elif not self.job or identity.get("job") != self.job or identity.get("ppid") in parents:
            return None  # not of this job, or its parent runs a survivor, which knows how it died
        # Not told how it died (yet): whoever reaped it (torchelastic's agent, spawn's join) may still say, unless
        # it died long enough ago (the next generation finds the previous one's).
        first = self._seen_dead.setdefault(parsed.base, time.monotonic())
        if time.monotonic() - first < self._grace_s and now_ns - facts.last_seen_ns < self._grace_s * 1e9:
            return None
        return Death.of_status(None, min(now_ns, facts.last_seen_ns + _HEARTBEAT_NS))

    def _report(self, due: list[tuple[layout.RecordName, str, Death]]) -> int:
        """Claim the records of ``due``'s deaths and send their spans in one delivery; the number reported.

        One delivery, not one a record: a node's ranks die together, and an exporter stuck on the first one's had the
        others refused (not handed over on top of it), left for a retry after the agent had gone (a collector down
        for 8 s: one of two ranks sent). A delivery waits for its flush; one each took a slow collector's round trip each."""
        if not due or not self._can_deliver():
            return 0  # another survivor may (or this one, later); the spool keeps them for the report meanwhile
        claims: list[tuple[layout.RecordName, str, str, Death, list[ReadableSpan]]] = []
        for parsed, path, death in due:
            if time.monotonic() < self._retry_at.get(parsed.base, 0.0):
                continue
            claimed = os.path.join(self.spool_dir, f"{parsed.base}.{layout.CLAIMED}.{os.getpid()}.{self._my_start or 0}")
            try:
                os.rename(path, claimed)
            except OSError:
                continue  # another survivor took it
            spans = self._spans_of(parsed, path, claimed, death)
            if spans is not None:
                claims.append((parsed, path, claimed, death, spans))
        self.delivering = bool(claims)
        try:  # (a Delivery never raises)
            sent = bool(claims) and self.deliver([span for *_, spans in claims for span in spans])
        finally:
            self.delivering = False
        return sum(self._close_claim(parsed, path, claimed, death, len(spans), sent)
                   for parsed, path, claimed, death, spans in claims)  # fmt: skip

    def _spans_of(self, parsed: layout.RecordName, path: str, claimed: str, death: Death) -> list[ReadableSpan] | None:
        """The spans a claimed record leaves for its death (``None``: nothing to send; the claim is undone)."""
        try:
            record = read_record(claimed)
            if not record.has_evidence():  # died without a DCP call: nothing to say
                shutil.rmtree(claimed, ignore_errors=True)
                self._forget(parsed)
                return None
            return list(record.spans(death))
        except Exception as exc:  # noqa: BLE001 - left as it was found (RecordError: another version's record)
            reraise_if_signalled(exc)
            with contextlib.suppress(OSError):
                os.rename(claimed, path)
            if isinstance(exc, RecordError):
                self._forget(parsed)
            else:  # (tried again later, not every look)
                self._retry_at[parsed.base] = time.monotonic() + RETRY_S
                report("survivor_error", "dcp_otel could not read the record of process %d", parsed.pid, exc_info=True)
            return None

    def _close_claim(self, parsed: layout.RecordName, path: str, claimed: str, death: Death, spans: int,
                     sent: bool) -> bool:  # fmt: skip
        """After the delivery: the record marked reported, or handed back for a later try; whether reported."""
        try:
            with open(os.path.join(claimed, layout.DEATH_FILE), "w", encoding="utf-8") as out:
                json.dump({"cause": death.cause, "exit_code": death.exit_code, "end_ns": death.end_ns,
                           "reported_by": os.getpid(), "sent": sent, "spans": spans}, out)  # fmt: skip
            if not sent:
                os.rename(claimed, path)  # again later (or by another survivor)
                self._retry_at[parsed.base] = time.monotonic() + RETRY_S
                how = f"exit status {death.exit_code}" if death.cause == semconv.ENDED_BY_EXIT else death.cause
                report("survivor_not_sent", "dcp_otel could not send the spans process %d left in its record (it "
                       "ended: %s); the record stays in %s for another try and for dcp-otel report", parsed.pid, how,
                       self.spool_dir)  # fmt: skip
                return False
            os.rename(claimed, os.path.join(self.spool_dir, f"{parsed.base}.{layout.REPORTED}"))
            self._forget(parsed)
            self.reported += 1
            self.spans_sent += spans
            self._seen_dead.pop(parsed.base, None)
            return True
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("survivor_error", "dcp_otel could not report the death of process %d", parsed.pid, exc_info=True)
            return False

    def _prune(self, reported: list[tuple[float, str]]) -> None:
        now = time.time()
        reported.sort()
        for index, (mtime, path) in enumerate(reported):
            if now - mtime > KEEP_S or index < len(reported) - KEEP_MAX:
                shutil.rmtree(path, ignore_errors=True)
