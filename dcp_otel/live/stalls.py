"""One stall report: a span exported at once, a counter, one warning line.

When an open DCP call has made no progress for longer than its threshold, the
watchdog calls :meth:`StallReporter.report`, which, while the call is still open:

* emits a zero-length ``dcp.stall`` span in the checkpoint's trace, under the
  open step (under the operation, between steps), with the step, the seconds
  since the last progress, the threshold, the stuck thread's stack
  (``code.stacktrace``) and, when that thread is blocked in a
  ``torch.distributed`` collective, which one (``dcp.stall.collective``): it is
  waiting for other ranks. It then asks the tracer provider to flush, on a
  thread of its own, so the span leaves the process now rather than with the
  next batch, and survives a SIGKILL that follows;
* counts ``dcp_stalls_total{operation, step, rank}`` (the first report of a
  stall only);
* logs one WARNING line naming the rank, step, seconds and top frames.

Usage::

    reporter = StallReporter(recorder, metrics)
    reporter.report(progress, threshold_s=300.0, number=1)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext

from dcp_otel import semconv
from dcp_otel._selftelemetry import report as report_problem
from dcp_otel.live.progress import Progress
from dcp_otel.live.stacks import ThreadStack, thread_stack
from dcp_otel.metrics.prometheus import MetricsSink
from dcp_otel.tracing.flushing import BoundedFlush
from dcp_otel.tracing.tracker import SpanRecorder

logger = logging.getLogger("dcp_otel")


class StallReporter:
    """Reports stalls of one recorder's operations (``where``: the checkpoint process this runs in, if one)."""

    def __init__(self, recorder: SpanRecorder, metrics: MetricsSink | None, where: str | None = None,
                 after_count: Callable[[], None] | None = None, flush_timeout_s: float = 10.0) -> None:  # fmt: skip
        self._recorder = recorder
        self._metrics = metrics
        self._where = where
        self._after_count = after_count  # a checkpoint process relays its count to its rank now
        self._flush_timeout_s = flush_timeout_s
        self._flush: BoundedFlush | None = None
        self.reported = 0

    def report(self, p: Progress, threshold_s: float, number: int, now_ns: int | None = None) -> None:
        """Report that ``p`` has made no progress for over ``threshold_s`` (the ``number``-th time). Never raises."""
        try:
            now_ns = now_ns if now_ns is not None else time.time_ns()
            stack = thread_stack(p.thread_id) if p.thread_id is not None else None
            self._log(p, threshold_s, number, stack, now_ns)
            if number == 1 and self._metrics is not None:
                self._metrics.stalled(p.op.name, p.step, p.op.rank_label)
                if self._after_count is not None:
                    self._after_count()
            if p.op.sampled:
                self._span(p, threshold_s, number, stack, now_ns)
                self._flush_now()
            self.reported += 1
        except Exception:  # noqa: BLE001 - a report must never break the watchdog, nor training
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

    def _flush_now(self) -> None:
        """Flush the provider on a thread of its own: the watchdog never waits for an exporter."""
        previous = self._flush
        if previous is not None and previous.running():
            return  # one at a time: a hung exporter does not pile up threads
        self._flush = BoundedFlush(self._recorder.provider(), "span", time.monotonic() + self._flush_timeout_s)
