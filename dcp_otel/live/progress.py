"""Where each open DCP operation is now, and when it would count as stalled.

:class:`LiveState` turns the recorder's open calls into one :class:`Progress`
per open operation: its innermost open call (the operation's own call between
steps), the step's name (``"-"`` between steps), the time it last made
progress, and the thread inside it. Progress is *the later of* when the
innermost open call started and when the last of its operation's calls ended:
a leaf step (``write_data``) counts from its start; a rank between steps (in
DCP's collectives) counts from the end of the step before, so a rank waiting
in a collective shows how long it has waited.

An async save whose work runs in a checkpoint process (torch's async save
process, the ``_experimental`` checkpoint process) shows that process's
progress, relayed over its metrics pipe (:class:`RemoteProgress`), in place of
its upload's.

:class:`StallPolicy` gives each operation its threshold: ``stall_after_s`` when
set, else derived from the operation's own history in this process: ``3 x`` the
slowest of its last 20 successful runs, at least 60 s, and 300 s before it has
any. Three times the slowest healthy run is far outside the normal spread, so a
report means something; the 60 s floor keeps a sub-second checkpoint from being
reported for a pause of a few seconds (a page-cache flush, a GC); and 300 s for
a first checkpoint (which pays one-time costs: process start, allocation) is
still half of NCCL's default 10-minute collective timeout, so the report comes
while the job is still there to look at.

Usage::

    live = LiveState(recorder, StallPolicy(None, recorder.builder.history))
    for p in live.progress():
        print(p.op.name, p.step, (time.time_ns() - p.since_ns) / 1e9)
    live.entries()          # [("save", "write_data", "1", 1764000000.5, 300.0), ...] for the metrics
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.metrics.prometheus import LiveEntry
from dcp_otel.tracing.records import KIND_COLLECTIVE, KIND_OPERATION, KIND_UPLOAD, Call, DurationHistory, Operation
from dcp_otel.tracing.tracker import SpanRecorder

#: The stall threshold from history: this many times the slowest recent successful run ...
HISTORY_FACTOR: Final = 3.0
#: ... and at least this many seconds;
FLOOR_S: Final = 60.0
#: before any successful run of the operation in this process.
NO_HISTORY_S: Final = 300.0


@dataclass(frozen=True)
class Progress:
    """One open operation of this process, where it is now."""

    op: Operation
    call: Call  # the innermost open call: a step, an upload, or the operation's own call between steps
    step: str  # the innermost open step's name, or semconv.STEP_NONE between steps
    since_ns: int  # Unix time (ns) it last made progress
    thread_id: int | None  # the thread inside ``call`` (None: an upload, which ends with a future)
    where: str | None = None  # the process doing the work, when not this one ("async save process")

    def age_s(self, now_ns: int | None = None) -> float:
        return max(0, (now_ns if now_ns is not None else time.time_ns()) - self.since_ns) / 1e9


@dataclass(frozen=True)
class RemoteProgress:
    """A checkpoint process's progress on an operation of its rank, as relayed to the rank."""

    operation: str
    step: str
    rank: str
    since_ns: int
    where: str


class StallPolicy:
    """Each operation's stall threshold (see the module); ``None`` when stall reports are off."""

    def __init__(self, stall_after_s: float | None, history: DurationHistory) -> None:
        self.stall_after_s = stall_after_s
        self._history = history

    @property
    def enabled(self) -> bool:
        return self.stall_after_s is None or self.stall_after_s > 0

    def threshold(self, operation: str) -> float | None:
        if self.stall_after_s is not None:
            return self.stall_after_s if self.stall_after_s > 0 else None
        longest = self._history.longest(operation)
        return NO_HISTORY_S if longest is None else max(FLOOR_S, HISTORY_FACTOR * longest)


class LiveState:
    """The open operations of one recorder (and of its checkpoint processes); safe from any thread."""

    def __init__(
        self, recorder: SpanRecorder, policy: StallPolicy, remote: Callable[[], list[RemoteProgress]] | None = None
    ) -> None:
        self.recorder = recorder
        self.policy = policy
        #: The checkpoint processes' relayed progress (the rank's ProcessBridge), if any.
        self.remote = remote

    def progress(self) -> list[Progress]:
        """One :class:`Progress` per open operation. Never raises (a failure is counted: ``[]``)."""
        try:
            return _merge(_local(self.recorder.open_calls()), self.remote() if self.remote is not None else [])
        except Exception as exc:  # noqa: BLE001 - a reader of telemetry state never raises
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to read where the open DCP calls are", exc_info=True)
            return []

    def entries(self) -> list[LiveEntry]:
        """What the in-progress metrics show: ``(operation, step, rank, since Unix s, threshold s or None)``,
        the oldest of each ``(operation, step, rank)``."""
        found: dict[tuple[str, str, str], LiveEntry] = {}
        for p in self.progress():
            key = (p.op.name, p.step, p.op.rank_label)
            held = found.get(key)
            if held is None or p.since_ns / 1e9 < held[3]:
                found[key] = (*key, p.since_ns / 1e9, self.policy.threshold(p.op.name))
        return list(found.values())


def _local(open_calls: list[tuple[Call, int | None]]) -> list[Progress]:
    by_op: dict[int, list[tuple[Call, int | None]]] = {}
    for call, ident in open_calls:
        # In one of DCP's collectives a rank is between steps, waiting: the stall report names the
        # collective from the thread's stack.
        if call.op is not None and not call.end_ns and call.kind != KIND_COLLECTIVE:
            by_op.setdefault(id(call.op), []).append((call, ident))
    found = []
    for calls in by_op.values():
        # The latest started is the innermost: a call nests in the one open when it started, on its
        # thread, and an async save's background save starts after its upload opened.
        call, ident = max(calls, key=lambda pair: (pair[0].kind != KIND_OPERATION, pair[0].start_ns))
        op = call.op
        assert op is not None
        # A call of the operation that started inside it and has ended (a child step) is progress too.
        ended = max((c.end_ns for c in tuple(op.calls) if c.start_ns >= call.start_ns), default=0)
        step = semconv.STEP_NONE if call.kind == KIND_OPERATION else call.func_name
        found.append(Progress(op, call, step, max(call.start_ns, ended), ident))
    return found


def _merge(local: list[Progress], remote: list[RemoteProgress]) -> list[Progress]:
    """An upload whose checkpoint process relayed its own progress shows that progress instead."""
    if not remote:
        return local
    merged = []
    for p in local:
        match = None
        if p.call.kind == KIND_UPLOAD:
            match = next((r for r in remote if r.operation == p.op.name and r.rank == p.op.rank_label
                          and r.since_ns >= p.call.start_ns), None)  # fmt: skip
        merged.append(p if match is None else
                      Progress(p.op, p.call, match.step, match.since_ns, None, match.where))  # fmt: skip
    return merged
