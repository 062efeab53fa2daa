"""When the process ends with DCP calls still open: end them as failed, with the stack, and flush.

A rank stopped by its scheduler (SIGTERM), or exiting
with a call still open would otherwise take that call's spans with it, and
every finished span still in its batch processor. :meth:`Ending.end_open_calls`
ends every open call of the process as ERROR, saying where it was ("terminated
by SIGTERM during write_data", "... while waiting in gather_object
(_DistWrapper.all_reduce)"), with the stack of the thread that was inside it as
the exception's stack trace, and ``dcp.interrupted`` on each span; the
operations go to the builder. :meth:`Ending.flush` then builds them and
flushes spans and metrics, all within ``flush_timeout_s``.

It runs on a thread of its own (started by the watchdog when a SIGTERM
arrives) or in ``atexit``, while the threads inside the calls may be blocked
for good, or frozen in a signal handler that waits for it.

The process waits for it once: :class:`EndingClock` starts at the first sign of
the end (a SIGTERM, interpreter exit) and every later one keeps that deadline;
a further signal cuts it short, never restarts it.

Usage::

    ending = Ending(recorder, live, otel_metrics, flush_timeout_s=10)
    deadline = ending.clock.start()
    ending("SIGTERM", {main_thread_id: interrupted_frame})
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import FrameType

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.live.life import ProcessLife
from dcp_otel.live.progress import LiveState, Progress
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.live.stacks import ThreadStack, thread_stack
from dcp_otel.metrics.otel import OTelCheckpointMetrics
from dcp_otel.tracing.flushing import flush_all
from dcp_otel.tracing.records import Operation
from dcp_otel.tracing.tracker import SpanRecorder


class EndingClock:
    """The one deadline a process waits for its telemetry as it ends (see the module).

    Written from the main thread (a signal handler, ``atexit``) and the
    watchdog without a lock: a signal handler must never take one. Each field
    is one attribute store, and a race between two starts only picks one of
    two deadlines a few microseconds apart.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deadline: float | None = None  # time.monotonic() seconds; None: not started

    @property
    def started(self) -> bool:
        return self.deadline is not None

    def start(self) -> float:
        """The deadline: now plus the timeout the first time, the same one every later time."""
        deadline = self.deadline
        if deadline is None:
            deadline = self.deadline = time.monotonic() + self.timeout_s
        return deadline

    def cut(self) -> None:
        """A further signal: the wait ends now."""
        self.deadline = time.monotonic()

    def remaining(self) -> float:
        deadline = self.deadline
        return self.timeout_s if deadline is None else max(0.0, deadline - time.monotonic())

    def reset(self) -> None:
        """(a forked child: its parent's end is not its own)"""
        self.deadline = None


def description(cause: str, p: Progress | None, stack: ThreadStack | None) -> str:
    """Where an interrupted operation was: ``"terminated by SIGTERM during write_data"``,
    ``"terminated by SIGTERM while waiting in gather_object (_DistWrapper.all_reduce)"`` (between steps),
    ``"interrupted at exit during write_data in the async save process"``."""
    head = "interrupted at exit" if cause == semconv.INTERRUPTED_AT_EXIT else f"terminated by {cause}"
    if p is None:
        return head
    waiting = ""
    if stack is not None and stack.collective is not None:
        name, caller = stack.collective
        waiting = f"waiting in {name}" + (f" ({caller})" if caller else "")
    where = f" in the {p.where}" if p.where else ""
    if p.step == semconv.STEP_NONE:
        return f"{head} while {waiting}" if waiting else f"{head} between steps{where}"
    return f"{head} during {p.step}{where}" + (f", {waiting}" if waiting else "")


class Ending:
    """Ends one recorder's open calls when its process ends (see the module)."""

    def __init__(self, recorder: SpanRecorder, live: LiveState, otel_metrics: OTelCheckpointMetrics | None,
                 flush_timeout_s: float, after_build: Callable[[], None] | None = None,
                 life: ProcessLife | None = None) -> None:  # fmt: skip
        self._recorder = recorder
        self._life = life  # a rank's training process (not a checkpoint process): its dcp.process span
        self._live = live
        self._otel_metrics = otel_metrics
        self.flush_timeout_s = flush_timeout_s
        self.clock = EndingClock(flush_timeout_s)
        self._after_build = after_build  # a checkpoint process relays the failures to its rank

    def end_open_calls(self, cause: str, frames: dict[int, FrameType] | None = None) -> list[Operation]:
        """End every open call as failed because of ``cause`` (a signal's name, or ``"exit"``); never raises.

        ``frames``: thread id to where that thread was interrupted (the frame a
        signal handler was given), so its stack shows that, not the handler.
        """
        try:
            progress = {id(p.op): p for p in self._live.progress()}
            threads = {ident for call, ident in self._recorder.open_calls() if ident is not None}
            given = frames or {}
            stacks = {ident: stack for ident in threads
                      if (stack := thread_stack(ident, given.get(ident))) is not None}  # fmt: skip

            def describe(op: Operation) -> str:
                p = progress.get(id(op))
                return description(cause, p, stacks.get(p.thread_id) if p is not None and p.thread_id else None)

            return self._recorder.interrupt_open(cause, describe, {i: s.text for i, s in stacks.items()})
        except Exception as exc:  # noqa: BLE001 - the process is ending: keep what can be kept
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to end the open DCP calls", exc_info=True)
            return []

    def end_life(self, cause: str, deadline: float) -> None:
        """The process's ``dcp.process`` span, once what finished is built (its recovery point is then known)."""
        if self._life is not None:
            self._recorder.drain(max(0.0, (deadline - time.monotonic()) / 2))
            self._life.end(cause)

    def flush(self, deadline: float) -> bool:
        """Build what is queued and flush spans (and OpenTelemetry metrics) by ``deadline``; never raises."""
        try:
            if self._after_build is not None:
                self._recorder.drain(max(0.0, deadline - time.monotonic()), metrics_only=True)
                self._after_build()
            return flush_all(self._recorder, self._otel_metrics, max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("flush_error", "dcp_otel failed to flush as the process ended", exc_info=True)
            return False

    def __call__(self, cause: str, frames: dict[int, FrameType] | None = None) -> None:
        """End the open calls and flush, by the clock's deadline (0 s: dcp-otel starts no flush)."""
        deadline = self.clock.start()
        self.end_open_calls(cause, frames)
        if self.flush_timeout_s > 0:
            self.end_life(cause, deadline)
            self.flush(deadline)
