"""One stall report: a span exported at once, a counter, one warning line.

When an open DCP call has made no progress for longer than its threshold, the
watchdog calls :meth:`StallReporter.report`, which, while the call is still open:

* emits a zero-length ``dcp.stall`` span in the checkpoint's trace, under the
  open step (under the operation, between steps), with the step, the seconds
  since the last progress, the threshold, the stuck thread's stack
  (``code.stacktrace``) and, when that thread is blocked in a
  ``torch.distributed`` collective, which one (``dcp.stall.collective``): it is
  waiting for other ranks. The span is made, ended and flushed on a thread of
  its own, in order (past 16 waiting behind a stuck exporter, a report's span
  is skipped and counted as ``stall_span_skipped``), so it
  leaves the process now rather than with the next batch and survives a
  SIGKILL that follows, and the watchdog never waits for an exporter (with a
  ``SimpleSpanProcessor``, ``span.end()`` exports in the calling thread);
* counts ``dcp_stalls_total{operation, step, rank}`` (the first report of a
  stall only);
* logs one WARNING line naming the rank, step, seconds and top frames.

Usage::

    reporter = StallReporter(recorder, metrics)
    reporter.report(progress, threshold_s=300.0, number=1)
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext

from dcp_otel import _forksafe, semconv
from dcp_otel._selftelemetry import report as report_problem
from dcp_otel.live.progress import Progress
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.live.stacks import ThreadStack, thread_stack, with_helpers
from dcp_otel.live.status import board
from dcp_otel.metrics.prometheus import MetricsSink
from dcp_otel.redact import redact_text
from dcp_otel.tracing.tracker import SpanRecorder

logger = logging.getLogger("dcp_otel")
#: Stall spans waiting for the export thread, past which more are skipped (and counted).
_QUEUED = 16
#: The stacks of stalled calls a process's record keeps (the latest ones).
_KEPT_STACKS = 8


class StallReporter:
    """Reports stalls of one recorder's operations (``where``: the checkpoint process this runs in, if one)."""

    def __init__(self, recorder: SpanRecorder, metrics: MetricsSink | None, where: str | None = None,
                 after_count: Callable[[], None] | None = None, flush_timeout_s: float = 10.0) -> None:  # fmt: skip
        self._recorder = recorder
        self._metrics = metrics
        self._where = where
        self._after_count = after_count  # a checkpoint process relays its count to its rank now
        self._flush_timeout_s = flush_timeout_s
        self._queue: queue.Queue[tuple[Progress, float, int, ThreadStack | None, int]] = queue.Queue(_QUEUED)
        self._exporter: threading.Thread | None = None
        self.reported = 0
        self._stacks: dict[int, str] = {}  # span id -> the stack last read inside it (the process's record keeps them)
        _forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        """A forked child: the parent's export thread is not there, and its queue's lock may be held."""
        self._queue = queue.Queue(_QUEUED)
        self._exporter = None

    def report(self, p: Progress, threshold_s: float, number: int, now_ns: int | None = None) -> None:
        """Report that ``p`` has made no progress for over ``threshold_s`` (the ``number``-th time). Never raises."""
        try:
            now_ns = now_ns if now_ns is not None else time.time_ns()
            stack = thread_stack(p.thread_id) if p.thread_id is not None else None
            helpers = p.call.helpers
            if stack is not None and helpers:  # (a set's copy is one step of the interpreter)
                stack = with_helpers(stack, list(helpers))
            record = self._recorder.record
            if stack is not None and record is not None:  # a survivor ends this call with it, should the process die
                self._stacks[p.call.span_id] = redact_text(stack.text)
                while len(self._stacks) > _KEPT_STACKS:
                    self._stacks.pop(next(iter(self._stacks)))
                record.stacks(self._stacks)
            self._log(p, threshold_s, number, stack, now_ns)
            posted: dict[str, Any] = {
                "operation": p.op.name, "step": p.step, "rank": p.op.rank_label, "seconds": p.age_s(now_ns),
                "threshold_s": threshold_s, "stack": stack.text if stack is not None else None,
                "collective": stack.collective[0] if stack is not None and stack.collective else None,
                "where": self._where,
            }  # fmt: skip
            board().record(**posted)
            relayed = getattr(self._metrics, "stall_report", None)  # a checkpoint process's: to its rank's board too
            if relayed is not None:
                relayed(posted)
            if number == 1 and self._metrics is not None:
                self._metrics.stalled(p.op.name, p.step, p.op.rank_label)
                if self._after_count is not None:
                    self._after_count()
            if p.op.sampled:
                self._export(p, threshold_s, number, stack, now_ns)
            self.reported += 1
        except Exception as exc:  # noqa: BLE001 - a report must never break the watchdog, nor training
            reraise_if_signalled(exc)
            report_problem("stall_report_error", "dcp_otel failed to report a stalled DCP call", exc_info=True)

    def _log(self, p: Progress, threshold_s: float, number: int, stack: ThreadStack | None, now_ns: int) -> None:
        op = p.op
        where = f" in the {self._where}" if self._where else ""
        checkpoint = op.step_attributes.get(semconv.ATTR_CHECKPOINT_ID) or op.attributes.get(semconv.ATTR_CHECKPOINT_ID)
        step = "between steps" if p.step == semconv.STEP_NONE else f"in {p.step}"
        waiting = ""
        if stack is not None and stack.collective is not None:
            name, caller = stack.collective
            waiting = f"; waiting for other ranks in {name}" + (f" ({caller})" if caller else "")
        frames = f"; stack: {stack.top(3)}" if stack is not None else ""
        logger.warning(
            "dcp_otel: rank %s%s has been %s of %s %s for %.1f s without progress (stall threshold %g s, report %d)%s%s",
            op.rank_label, where, step, op.name, checkpoint or "", p.age_s(now_ns), threshold_s, number, waiting, frames,
        )

    def _span(self, p: Progress, threshold_s: float, number: int, stack: ThreadStack | None, now_ns: int) -> None:
        op = p.op
        attributes: dict[str, Any] = {
            **op.step_attributes,
            semconv.ATTR_STEP: p.step,
            semconv.ATTR_STALL_SECONDS: p.age_s(now_ns),
            semconv.ATTR_STALL_THRESHOLD: float(threshold_s),
            semconv.ATTR_STALL_REPORT: number,
        }
        if self._where:
            attributes[semconv.ATTR_STALL_WHERE] = self._where
        if stack is not None:
            attributes[semconv.ATTR_CODE_STACKTRACE] = stack.text
            attributes[semconv.ATTR_THREAD_ID] = stack.thread_id
            attributes[semconv.ATTR_THREAD_NAME] = stack.thread_name
            if stack.collective is not None:
                attributes[semconv.ATTR_STALL_COLLECTIVE] = stack.collective[0]
                if stack.collective[1]:
                    attributes[semconv.ATTR_STALL_COLLECTIVE_CALLER] = stack.collective[1]
        parent = SpanContext(op.trace_id, p.call.span_id, False, op.flags)
        span = op.tracer.start_span(semconv.SPAN_STALL, context=trace.set_span_in_context(NonRecordingSpan(parent)),
                                    attributes=attributes, start_time=now_ns)  # fmt: skip
        span.end(end_time=now_ns)

    def _export(self, p: Progress, threshold_s: float, number: int, stack: ThreadStack | None, now_ns: int) -> None:
        """Queue the span for the export thread: the watchdog never waits for an exporter."""
        try:
            self._queue.put_nowait((p, threshold_s, number, stack, now_ns))
        except queue.Full:
            report_problem("stall_span_skipped", "dcp_otel skipped a stall span: the ones before it are still "
                                                 "being exported (the span exporter is stuck)")  # fmt: skip
            return
        if self._exporter is None or not self._exporter.is_alive():
            self._exporter = threading.Thread(target=self._export_all, name="dcp-otel-stall-export", daemon=True)
            self._exporter.start()

    def _export_all(self) -> None:
        while True:  # for the life of the process, once a stall was reported (idle in get(): costs nothing)
            item = self._queue.get()
            try:
                self._span(*item)
                force_flush = getattr(self._recorder.provider(), "force_flush", None)
                if force_flush is not None:  # out now, not with the next batch: it survives a SIGKILL after it
                    force_flush(int(self._flush_timeout_s * 1000))
            except Exception as exc:  # noqa: BLE001 - a report must never break anything
                reraise_if_signalled(exc)
                report_problem("stall_report_error", "dcp_otel failed to export a stall span", exc_info=True)
            finally:
                self._queue.task_done()

    def wait_exported(self, timeout_s: float) -> bool:
        """Until every stall span reported so far is exported (for tests and flushes); ``False`` past the timeout."""
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(lambda: self._queue.unfinished_tasks == 0, timeout_s)
