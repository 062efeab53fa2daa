"""When the process ends normally with DCP calls still open: end them as failed, with the stack.

A rank exiting with a call still open (an exception in its training loop
while an async upload runs, ``sys.exit`` from a hung collective's timeout
handler) would otherwise take that call's spans with it. At interpreter exit
(:class:`~dcp_otel.tracing.flushing.ExitFlush`), :meth:`Ending.end_open_calls`
ends every open call of the process as ERROR, saying where it was
("interrupted at exit during write_data", "... while waiting in gather_object
(_DistWrapper.all_reduce)"), with the stack of the thread that was inside it
as the exception's stack trace, and ``dcp.interrupted`` on each span; the
operations go to the builder, and the exit flush sends them.

A process that dies without reaching its exit (a signal's default action,
SIGKILL, ``abort()``, a segfault) runs nothing of this: its record in the spool
has what a survivor needs to say the same (:mod:`dcp_otel.spool`).

Usage::

    ending = Ending(recorder, live, otel_metrics)
    ending.end_open_calls("exit")
    ending.end_life("exit", deadline)
"""

from __future__ import annotations

import threading
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
from dcp_otel.tracing.records import Operation
from dcp_otel.tracing.tracker import SpanRecorder


def description(cause: str, p: Progress | None, stack: ThreadStack | None) -> str:
    """Where an interrupted operation was: ``"interrupted at exit during write_data"``,
    ``"interrupted at exit while waiting in gather_object (_DistWrapper.all_reduce)"`` (between steps),
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
    """Ends one recorder's open calls when its process exits (see the module)."""

    def __init__(self, recorder: SpanRecorder, live: LiveState, otel_metrics: OTelCheckpointMetrics | None,
                 after_build: Callable[[], None] | None = None, life: ProcessLife | None = None) -> None:  # fmt: skip
        self._recorder = recorder
        self._life = life  # a rank's training process (not a checkpoint process): its dcp.process span
        self._live = live
        self._otel_metrics = otel_metrics
        self._after_build = after_build  # a checkpoint process relays the failures to its rank

    def end_open_calls(self, cause: str, frames: dict[int, FrameType] | None = None) -> list[Operation]:
        """End every open call as failed because of ``cause`` (``"exit"``); never raises.

        ``frames``: thread id to where that thread was interrupted, so its stack shows that.
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

            ended = self._recorder.interrupt_open(cause, describe, {i: s.text for i, s in stacks.items()})
            if ended and self._after_build is not None:  # a checkpoint process: its rank counts the failures
                self._recorder.drain(1.0, metrics_only=True)
                self._after_build()
            return ended
        except Exception as exc:  # noqa: BLE001 - the process is ending: keep what can be kept
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to end the open DCP calls", exc_info=True)
            return []

    def end_life(self, cause: str, deadline: float) -> None:
        """The process's ``dcp.process`` span, once what finished is built (its recovery point is then known)."""
        if self._life is not None:
            self._recorder.drain(max(0.0, (deadline - time.monotonic()) / 2))
            # Ended on a thread of its own, waited for until the deadline: through a SimpleSpanProcessor, the span's
            # end runs the exporter, and one that never returns would hold this thread (the exit) for good.
            ending = threading.Thread(target=self._life.end, args=(cause,), name="dcp-otel-process-span", daemon=True)
            ending.start()
            ending.join(max(0.0, deadline - time.monotonic()))
