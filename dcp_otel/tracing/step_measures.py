"""The builder's measures of the training steps: what a checkpoint's background work cost the steps beside it,
and every step into the step histogram, between checkpoints too.

Both run on the builder's thread (:class:`~dcp_otel.tracing.builder.SpanBuilder` is a ``StepMeasures``), from
the step ends the optimizer hook keeps (:data:`~dcp_otel.tracing.steps.CLOCK`) and the arithmetic of
:mod:`dcp_otel.tracing.interference`. An async save's build measures its steps (:meth:`_interference`); while
steps are seen and no checkpoint comes, the builder wakes every :data:`FOLD_EVERY_S` (:data:`FOLD_IDLE_S` while
the loop pauses) and folds the steps since into ``dcp_training_step_seconds{overlaps="none"}`` (:meth:`_fold`),
as it does when a flush asks and at the close: a scrape between checkpoints sees every step, and an hour between checkpoints loses none to the ring.

Usage (the builder's loop)::

    if queue_empty_for(FOLD_EVERY_S):
        self._fold()
    ...
    self._interference(op)   # an operation built, its steps awaited
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from typing import Final

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.metrics.prometheus import MetricsSink
from dcp_otel.tracing.interference import StepLedger, assess
from dcp_otel.tracing.records import Operation
from dcp_otel.tracing.steps import CLOCK

#: How often the builder folds the training steps seen into the step histogram between checkpoints: while the loop
#: steps, and else (the loop paused, or no optimizer steps in this process) rarely.
FOLD_EVERY_S: Final = 5.0
FOLD_IDLE_S: Final = 60.0


class StepMeasures:
    """The builder's side of the training steps (a mixin of :class:`~dcp_otel.tracing.builder.SpanBuilder`)."""

    ledger: StepLedger
    _metrics: MetricsSink | None
    _lock: threading.RLock
    _cond: threading.Condition
    _folds_asked: int
    _folds_done: int
    _rank_label: str | None
    folds: int
    busy_ns: int
    checkpointing: Callable[[], bool]
    open_since: Callable[[], int]

    def _fold(self) -> None:
        """The training steps seen since the last checkpoint into the step histogram (``overlaps="none"``), up to
        the start of any operation still open (its background work may yet overlap them; see ``open_since``).
        Between checkpoints too: else a scrape sees the steps only at the next checkpoint's build, and a ring of
        4,096 step ends loses the rest of an hour's."""
        started = time.thread_time_ns()
        asked = self._folds_asked  # (asked before this reads the steps: done by this fold)
        metrics, rank = self._metrics, self._rank_label
        try:
            if metrics is not None and rank is not None and CLOCK.count and not self.checkpointing():
                upto = time.time_ns()
                since = self.open_since()
                ends, first = CLOCK.ends()
                for seconds, overlaps in self.ledger.new_steps(ends, first, min(upto, since) if since else upto,
                                                               list(CLOCK.blocked)):  # fmt: skip
                    metrics.training_step(overlaps, rank, seconds, None)
        except Exception as exc:  # noqa: BLE001 - telemetry never raises, not even here
            reraise_if_signalled(exc)
            report("metrics_error", "dcp_otel failed to measure the training steps between checkpoints", exc_info=True)
        with self._lock:
            self._folds_done = max(self._folds_done, asked)
            self.folds += 1
            self.busy_ns += time.thread_time_ns() - started
            self._cond.notify_all()

    def _interference(self, op: Operation) -> None:
        """The operation's interference with training, on its spans and in the metrics; the steps since the last."""
        ends, first = CLOCK.ends()
        blocked = list(CLOCK.blocked)
        ledger, metrics = self.ledger, self._metrics
        window, upto = op.background, op.end_ns
        since = self.open_since()  # (another checkpoint's upload still open: the steps beside it wait for its build)
        if window is not None and not CLOCK.installed and CLOCK.removed_ns < window[1]:
            window = None  # uninstrumented while it uploaded: the steps after that are unseen, nothing is said
        if window is not None:
            found = assess(ends, window, blocked, ledger.windows)
            ledger.windows.append(window)
            # The end of the step the window ended in (by bisection: a scan from the oldest of a full ring's 4,080
            # ends cost ~60 us a checkpoint, a twentieth of the builder's).
            k = bisect.bisect_left(ends, window[1])
            upto = ends[k] if k < len(ends) else upto
            if found is not None:
                op.attributes = {**op.attributes, **found.attributes()}  # (replaced, never mutated: shared)
                if metrics is not None:
                    metrics.training_interference(op.name, op.rank_label, found.lost_s)
        if since:
            upto = min(upto, since)
        if metrics is not None:  # a step beside this checkpoint's work links to its trace
            for seconds, overlaps in ledger.new_steps(ends, first, upto, blocked):
                exemplar = op.exemplar if overlaps == semconv.OVERLAPS_CHECKPOINT and window is not None else None
                metrics.training_step(overlaps, op.rank_label, seconds, exemplar)
