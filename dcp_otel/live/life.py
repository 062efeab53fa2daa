"""A rank process's life, as one ``dcp.process`` span: when a generation of workers last showed a sign of life.

A training process that dies between checkpoints (an exception in its
training step, SIGTERM from torchrun because a peer died) leaves no DCP span
of its end: its last one is its last checkpoint, and "how much work did the
restart redo?" needs the moment it died. So, once the process has made its
first DCP call, its exit (``atexit``) emits one span from ``instrument()`` to that
moment (a process killed by a signal runs no ``atexit``: a survivor emits the
same span from its record, :mod:`dcp_otel.spool.reader`), with:

- who it was: ``dcp.rank``, ``dcp.world_size``, ``dcp.run_id``, ``dcp.generation``, ``process.pid``;
- how it ended (``dcp.process.ended_by``): ``exit``, ``exception`` (the uncaught exception Python printed,
  as the span's error) or the signal's name;
- the work at risk then: ``dcp.recovery_point.age_seconds`` and ``dcp.recovery_point.checkpoint_id``, this
  process's last durable save (a restart restores it, or an older one);
- ``dcp.training.step``: the last step the training loop said (``dcp_otel.set_training_step``), from which
  the report counts the steps a restart redid.

It costs nothing while the process runs: one store per operation (who it is)
and one span at the end, inside the exit flush's deadline.

Usage::

    life = ProcessLife(recorder)
    life.end("exit")        # once: later calls do nothing
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.tracing.tracker import SpanRecorder
from dcp_otel.tracing.training_step import explicit_step

#: What the process span repeats of its last operation's attributes.
_WHO = (semconv.ATTR_RANK, semconv.ATTR_WORLD_SIZE, semconv.ATTR_RUN_ID, semconv.ATTR_GENERATION)


class ProcessLife:
    """The ``dcp.process`` span of one instrumented process (see the module)."""

    def __init__(self, recorder: SpanRecorder) -> None:
        self._recorder = recorder
        self.start_ns = time.time_ns()
        self._pid = os.getpid()
        self._ended = False
        self._lock = threading.Lock()  # the ending thread (SIGTERM) and atexit may both end it

    def end(self, cause: str) -> None:
        """Emit the span, once, if this process made a DCP call (``cause``: a signal's name, or ``"exit"``,
        which an uncaught exception turns into ``"exception"``); never raises."""
        try:
            last = self._recorder.starter.last_attributes
            if last is None or os.getpid() != self._pid or not self._lock.acquire(timeout=0.5):
                return
            try:
                if self._ended:
                    return
                self._ended = True
                self._emit(cause, last)
            finally:
                self._lock.release()
        except Exception as exc:  # noqa: BLE001 - the process is ending: its checkpoints' spans matter more
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to emit the process span", exc_info=True)

    def _emit(self, cause: str, last: dict[str, Any]) -> None:
        now = time.time_ns()
        attributes: dict[str, Any] = {key: last[key] for key in _WHO if key in last}
        attributes["process.pid"] = self._pid
        # An uncaught exception: Python printed it (and kept it in sys.last_value) before atexit.
        exc = getattr(sys, "last_value", None) if cause == semconv.INTERRUPTED_AT_EXIT else None
        if exc is not None and isinstance(exc, BaseException) and not isinstance(exc, SystemExit):
            cause = semconv.ENDED_BY_EXCEPTION
        attributes[semconv.ATTR_ENDED_BY] = cause
        recovery = self._recorder.builder.history.last_success(semconv.SAVE_OPERATIONS)
        if recovery is not None and now >= recovery[0]:
            attributes[semconv.ATTR_RECOVERY_POINT_AGE] = round((now - recovery[0]) / 1e9, 3)
            attributes[semconv.ATTR_RECOVERY_POINT_ID] = recovery[1]
        step = explicit_step()
        if step is not None:
            attributes[semconv.ATTR_TRAINING_STEP] = step
        tracer, _ = self._recorder.starter.tracer()
        span = tracer.start_span(semconv.SPAN_PROCESS, context=Context(), start_time=self.start_ns, attributes=attributes)
        if cause == semconv.ENDED_BY_EXCEPTION and exc is not None:
            span.record_exception(exc, timestamp=now)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:500]))
        elif cause != semconv.INTERRUPTED_AT_EXIT:
            span.set_status(Status(StatusCode.ERROR, f"terminated by {cause}"))
        span.end(end_time=now)
