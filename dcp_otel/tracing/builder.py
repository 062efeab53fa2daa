"""Build spans and metric observations from finished operations, off the caller's thread.

The hot path (:mod:`dcp_otel.tracing.tracker`) hands each complete
:class:`~dcp_otel.tracing.records.Operation` to :meth:`SpanBuilder.submit`,
which appends it to a bounded queue and returns; a full queue drops the
operation and counts it (``build_queue_full``), it never blocks. One named
daemon thread per process (``dcp-otel-builder``) then, per operation:

1. records its metrics (histograms with their exemplars, byte counters summed here, not on the caller's thread);
2. for an async save in a process whose optimizer steps are seen, waits (bounded, woken, cut short by a
   flush) for the training step its upload ended in, and measures what it cost the steps beside it
   (:mod:`dcp_otel.tracing.step_measures`): onto its spans, into the metrics; between checkpoints it folds
   the steps seen into the step histogram every few seconds;
3. waits (bounded, woken, cut short by a flush) while a thread is inside a checkpoint call: the next
   ``async_save``'s staging often starts as the previous upload is awaited, and building beside it took
   the interpreter from the caller's call (:meth:`SpanBuilder.defer`);
4. asks the :class:`~dcp_otel.tracing.detail.DetailPolicy` how much to export;
5. emits ordinary SDK spans with the recorded start and end times and the ids chosen on the hot path (so spans
   that a storage plugin started inside a step nest under it), names, attributes, events, links and statuses.

Metrics come first, so a stuck span exporter never holds up a metric.
:meth:`SpanBuilder.drain` waits, bounded, until everything queued is built:
``dcp_otel.flush()``, the exit flush, the daemon's per-save flush, the
provider's own ``force_flush``/``shutdown`` and every metrics reader (:meth:`SpanBuilder.drain_for_reader`) go
through it, so whoever reads telemetry sees every finished operation.

Usage::

    builder = SpanBuilder(DetailPolicy("full", 2000), metrics, max_queued=4096)
    builder.submit(op)
    builder.drain(timeout_s=10)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from opentelemetry import trace

from dcp_otel import _forksafe, semconv
from dcp_otel._selftelemetry import report
from dcp_otel._wake import Wake
from dcp_otel.live.signal_exceptions import join_started, reraise_if_signalled, start_elsewhere
from dcp_otel.metrics.prometheus import MetricsSink
from dcp_otel.spool.record import ProcessRecord
from dcp_otel.tracing.detail import DetailPolicy, named_straggler, summary_attributes
from dcp_otel.tracing.emit import DirectEmitter, Emitter
from dcp_otel.tracing.interference import RECENT_STEPS, StepLedger, wait_until_ns
from dcp_otel.tracing.measure import count_bytes, measure
from dcp_otel.tracing.outcome import at_risk
from dcp_otel.tracing.records import (
    KIND_COLLECTIVE,
    KIND_OPERATION,
    KIND_STAGING,
    KIND_STEP,
    KIND_UPLOAD,
    Call,
    DurationHistory,
    Operation,
)
from dcp_otel.tracing.step_measures import FOLD_EVERY_S, FOLD_IDLE_S, StepMeasures
from dcp_otel.tracing.steps import CLOCK, HURRY
from dcp_otel.tracing.trace_ids import chosen_ids_tracer

#: The background work of an async save: what runs beside training once the caller's call returned.
_BACKGROUND = frozenset({KIND_UPLOAD, KIND_STAGING})
#: The longest a finished operation waits, from when it finished, for checkpoint calls to return before it is built
#: anyway (a save that runs for minutes mostly waits for its storage, the interpreter free).
DEFER_MAX_S: Final = 10.0
#: How often the builder looks anyway while it waits, where nothing wakes it: an operation call's end, a training
#: step's end, a drain and a long queue wake it (:meth:`SpanBuilder.nudge`). A look that wakes a thread costs the
#: thread holding the interpreter a switch, and this one about 1 ms of CPU under a busy caller: looking every
#: 20 ms took 20-50 ms of CPU beside each 10,000-tensor ``async_save`` (``benchmarks/own_share.py``).
_LOOK_EVERY_S: Final = 0.5
#: Past this many operations queued (or half the queue's bound) the builder builds, checkpoint call or not: back-to-back
#: checkpoint calls must not fill the queue until it drops spans.
DEFER_MAX_QUEUED: Final = 64
#: The longest a reader of the metrics waits for what is queued: a stuck builder must not stall a scrape.
READER_WAIT_S: Final = 1.0


class SpanBuilder(StepMeasures):
    """One process's builder thread and its bounded queue; :meth:`submit` never blocks."""

    def __init__(self, policy: DetailPolicy, metrics: MetricsSink | None, max_queued: int) -> None:
        self.policy = policy
        self._metrics = metrics
        self._max_queued = max_queued
        self._tracers: dict[int, Any] = {}  # id(tracer) -> (tracer, its chosen-ids twin or None)
        #: Each operation's recent successful durations: what the stall watchdog's thresholds start from.
        self.history = DurationHistory()
        #: The training steps observed so far, and the checkpoints' background windows (tracing/interference.py).
        self.ledger = StepLedger()
        #: The process's record (its operations written ahead) and where built spans wait for an exporter's
        #: confirmation (dcp_otel.spool): set by the instrumentor, None where nothing is written ahead.
        self.record: ProcessRecord | None = None
        self.keep: Callable[[list[list[Any]]], None] | None = None
        self.direct = False  # span_export="node": spans written straight into the record (emit.DirectEmitter)
        #: Whether a thread is inside a checkpoint operation's call now (set by the recorder): see :meth:`defer`.
        self.checkpointing: Callable[[], bool] = _never
        #: When the earliest operation still open started (0: none; set by the recorder): see :meth:`_fold`.
        self.open_since: Callable[[], int] = _none_open
        self._reset()
        _forksafe.register(self)

    def _reset(self) -> None:
        # Held with ``with self._lock`` (a C lock), never ``with self._cond``: Condition's own __exit__ is Python, and
        # a signal handler's exception raised at its first instruction would leave the lock held for good.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[tuple[Operation, list[Call]]] = deque()
        self._unbuilt = 0  # queued items not built yet
        self._unmeasured = 0  # queued items whose metrics are not recorded yet (they come first)
        self._thread: threading.Thread | None = None
        self._running: threading.Thread | None = None  # the thread that is in _run (see _start_thread)
        self._closed = False
        # Set by drain() and close(): build now, with the training steps seen so far (not waiting for the next one).
        self._hurry = Wake()  # (a flag set from the training thread too, in a flush: see dcp_otel._wake)
        self._nudged = Wake()  # something a waiting builder waits for may have happened (see nudge)
        self._draining = 0  # drains that hurry, waiting now: nothing is deferred meanwhile (a later submit too)
        self.peak_depth = 0
        self.busy_ns = 0
        self.built = 0
        self._progress, self._reader_gave_up = 0, (-1, 0)  # measures and builds done; see drain_for_reader
        self.folds = 0  # the times the steps seen were folded into the histogram between checkpoints (see _fold)
        # Folds of the steps seen into the histogram asked for (by a drain, the timer) and done (see _fold): a fold
        # asked while one runs is another one (that one may have read the steps before the ask).
        self._folds_asked = self._folds_done = 0
        self._rank_label: str | None = None  # the rank the steps are of, as the last checkpoint said
        self._count_seen = 0  # the steps seen as the builder last began to wait (see _next)

    def _after_fork_in_child(self) -> None:
        """The child builds nothing of the parent's: a new queue, a new thread when needed."""
        self._reset()

    # --- the caller's side ------------------------------------------------------
    def submit(self, op: Operation, calls: list[Call] | None = None) -> None:
        """Queue ``op`` (or ``calls`` of it that ended after it was built); drop and count when full."""
        item = (op, op.calls if calls is None else calls)
        if calls is None and self.record is not None:
            self.record.op_complete(op)  # ended: a death before it is built still has its ends, and its outcome
        with self._lock:
            # After close() too: an async upload that ends after uninstrument() is still built,
            # by a thread that stops again once the queue is empty.
            full = len(self._queue) >= self._max_queued
            if calls is None:
                if op.queued:  # handed on already (an end cut short and finished again submits it once more)
                    return
                # Marked and queued with no call between (a signal handler runs only at a call, a backward
                # jump or a function's start): the one goes with the other.
                op.queued = True
            if not full:
                self._unbuilt += 1
                self._unmeasured += 1
                self._queue.append(item)
                # (Cut short here, the builder is woken by the next submit or drain.)
                self._cond.notify()
                self.peak_depth = max(self.peak_depth, len(self._queue))
                if len(self._queue) >= min(DEFER_MAX_QUEUED, self._max_queued // 2):
                    self._nudged.set()  # a waiting builder stops waiting (see _may_defer)
            thread = self._thread
        if full:
            report("build_queue_full", "dcp_otel dropped a finished operation's spans: %d operations wait "
                   "to be built (raise DCP_OTEL_MAX_QUEUED_OPERATIONS, or check the span exporter)",
                   self._max_queued)  # fmt: skip
            # Metrics never depend on spans: its metrics are recorded here, on the caller's thread, which
            # pays that (no span, no exporter) only while the builder is this far behind.
            self._record_metrics(*item)
            if calls is None and self.record is not None:
                self.record.op_done(op)
            if calls is None:  # dropped: its cycle broken as a built one's is (see _run)
                op.calls, op.gathered = [], []
            return
        if thread is None or (thread is not self._running and not thread.is_alive()):
            self._start_thread()

    def ensure_thread(self) -> None:
        """Start the thread now if none runs (at an operation's start: cheap once it runs). Its thread, like all
        of dcp-otel's, starts as the first checkpoint starts and runs until ``close()``: none is made or ended
        around later checkpoints, where a faulthandler dump of all threads (registered for SIGTERM or SIGUSR1 to
        see where a job hangs) can crash when a thread starts or ends meanwhile (cpython#116008)."""
        if self._thread is None:
            self._start_thread()

    def _start_thread(self) -> None:
        # A thread whose start() a signal handler's exception cut short may never run (Python's own
        # bookkeeping of it fails): one that is not alive is replaced, at the next submit or drain.
        with self._lock:
            current = self._thread  # (one made but not started yet, by another thread now: it starts it)
            if current is not None and (current.ident is None or current.is_alive()):
                return
            thread = self._thread = threading.Thread(target=self._run, name="dcp-otel-builder", daemon=True)
        start_elsewhere((thread,))  # (at an operation's end, on the application's thread)

    def drain(self, timeout_s: float, metrics_only: bool = False, hurry: bool = True) -> bool:
        """Wait until every queued operation is built; ``False`` past ``timeout_s``.

        ``metrics_only``: until their metrics are recorded, which never waits
        for a span exporter (the async save process relays them per save).
        ``hurry``: an async save waiting for the training step its upload ended
        in is built now, with the steps seen so far (``False``: dcp-otel's own
        confirmations, which must not cut the measurement short; a reader's:
        :meth:`drain_for_reader`).
        """
        if threading.current_thread() is self._thread:  # an exporter flushing from inside a build
            return True
        hurrying = hurry and getattr(threading.current_thread(), HURRY, True)
        if hurrying:
            self._hurry.set()
            self._nudged.set()
        with self._lock:
            queued = bool(self._queue)
            # The steps since the last checkpoint, into the histogram too (an application's flush, the exit's), by a
            # builder that runs (one that does not has no checkpoint yet, and no rank to say the steps are of). Not
            # for a drain of the metrics only (the async save process's answer to its rank, a metrics collection):
            # the fold comes after the build under way, which may wait for a span exporter.
            fold = 0
            if hurrying and not metrics_only and self._rank_label is not None and CLOCK.count > self.ledger.observed \
                    and self._thread is not None and self._thread.is_alive():  # fmt: skip
                self._folds_asked += 1
                fold = self._folds_asked
            self._cond.notify_all()  # (a submit cut short between queuing and waking the builder: woken here)
        if queued:
            self._start_thread()  # (none if one runs)
        with self._lock:
            self._draining += hurrying
            try:
                if metrics_only:
                    return self._cond.wait_for(lambda: self._unmeasured == 0, timeout_s)
                return self._cond.wait_for(lambda: self._unbuilt == 0 and self._folds_done >= fold, timeout_s)
            finally:
                self._draining -= hurrying

    def drain_for_reader(self, metrics_only: bool = False) -> bool:
        """:meth:`drain` for a reader of the metrics (a scrape, an OTel collection): :data:`READER_WAIT_S` at most,
        hurried only where waiting loses something: an operation queued behind an async save's wait for the step its
        upload ended in (it would miss it), or a read on the training thread (whose step cannot end meanwhile). Not
        at all while nothing moved since a reader last waited in vain (a builder stuck behind an exporter that never
        returns): the SDK collects its readers one after another, and each waited its second (found by a review)."""
        if self._reader_gave_up == (self._progress, self._unmeasured):  # (nothing measured, built or queued since)
            return False
        hurry = bool(self._queue) or CLOCK.thread == threading.get_ident()
        if not (done := self.drain(READER_WAIT_S, metrics_only=metrics_only, hurry=hurry)):
            self._reader_gave_up = (self._progress, self._unmeasured)
        return done

    def close(self, timeout_s: float = 5.0) -> None:
        """Let the thread end once the queue is empty (waited for, at most ``timeout_s``).

        Work submitted later still gets built, by a thread started for it that
        ends again when it is done.
        """
        self._hurry.set()
        self._nudged.set()
        with self._lock:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            join_started(thread, timeout_s)

    # --- the builder thread ---------------------------------------------------------
    def _run(self) -> None:
        self._running = threading.current_thread()
        while True:
            item = self._next()
            if item is None:
                self._fold()
                with self._lock:
                    if self._closed and not self._queue:
                        self._thread = None
                        return
                continue
            op, calls = item
            self._rank_label = op.rank_label  # (the steps between checkpoints are this rank's: see _fold)
            started = time.thread_time_ns()  # CPU time: not the waits for the interpreter lock, nor the step's
            self._record_metrics(op, calls)
            with self._lock:
                self._unmeasured -= 1
                self._progress += 1
                self._cond.notify_all()
            if calls is op.calls and op.failed is None and op.end_ns:
                first = op.start_ns or min((c.start_ns for c in calls), default=op.end_ns)
                checkpoint_id = str(op.attributes.get(semconv.ATTR_CHECKPOINT_ID, ""))
                self.history.add(op.name, (op.end_ns - first) / 1e9, op.end_ns, checkpoint_id)
                if self.record is not None and op.name in semconv.SAVE_OPERATIONS:
                    self.record.recovery(op.end_ns, checkpoint_id)
            elif calls is op.calls and op.failed is not None:
                at_risk(op, calls, self.history.last_success_ns(semconv.SAVE_OPERATIONS))
            if calls is op.calls and CLOCK.count:  # (training steps seen: an optimizer stepped in this process)
                # After its metrics, its history and the recovery point in the record: a wait for the training
                # step never holds them up (a death meanwhile still has its durable save).
                self._steps(op, calls)
            self.defer(op.end_ns or time.time_ns())
            try:
                self._build(op, calls, late=calls is not op.calls)
            except Exception as exc:  # noqa: BLE001
                reraise_if_signalled(exc)
                report("builder_error", "dcp_otel failed to build a checkpoint's spans", exc_info=True)
            if calls is op.calls and self.record is not None:
                self.record.op_done(op)  # built, its spans kept until exported: the record needs it no more
            if calls is op.calls:
                # Each call names its operation and the operation lists its calls: a cycle, which only the
                # garbage collector would free (with the storage writer and write results the operation
                # holds), collections the training thread then pays for. Built, nothing reads them again
                # (a late part comes with its own list): freed here, by reference counting.
                op.calls, op.gathered = [], []
            op = calls = None  # type: ignore[assignment]  # (not kept until the next operation comes)
            with self._lock:
                self._unbuilt -= 1
                self.busy_ns += time.thread_time_ns() - started
                self.built += 1
                self._progress += 1
                self._cond.notify_all()

    def _next(self) -> tuple[Operation, list[Call]] | None:
        """The next queued operation, waited for; ``None``: fold the steps seen (between checkpoints every
        :data:`FOLD_EVERY_S` while the loop steps, else every :data:`FOLD_IDLE_S`; when a drain asks; at the close)."""
        with self._lock:
            while not self._queue:
                if self._folds_asked > self._folds_done or self._closed:
                    return None
                self._hurry.clear()  # (every drain so far has what it waited for)
                folding = self._rank_label is not None and self._metrics is not None and CLOCK.installed
                # While the loop steps (steps since the last wait began), soon; else rarely, for steps to come.
                stepping, self._count_seen = CLOCK.count != self._count_seen, CLOCK.count
                if not self._cond.wait((FOLD_EVERY_S if stepping else FOLD_IDLE_S) if folding else None):
                    self._folds_asked += 1
            return self._queue.popleft()

    def _steps(self, op: Operation, calls: list[Call]) -> None:
        try:
            self._await_step(op, calls)
            self._interference(op)
        except Exception as exc:  # noqa: BLE001 - telemetry never raises, not even here
            reraise_if_signalled(exc)
            report("metrics_error", "dcp_otel failed to measure the training steps around a checkpoint", exc_info=True)

    def _await_step(self, op: Operation, calls: list[Call]) -> None:
        """Wait, bounded, for the training step an async save's background work ended in to end too."""
        op_call = next((c for c in calls if c.kind == KIND_OPERATION), None)
        if op_call is None or not op_call.end_ns or not any(c.kind in _BACKGROUND for c in calls):
            return
        op.background = (op_call.end_ns, max(op.end_ns, op_call.end_ns))
        until = wait_until_ns(CLOCK.ends(RECENT_STEPS)[0], op.background[1])
        # A step that holds the next checkpoint call (the upload awaited, the next save staged) ends only after it:
        # waited for, within DEFER_MAX_S more.
        longest = until + int(DEFER_MAX_S * 1e9)
        while until and not self._hurry.is_set():
            self._nudged.clear()  # (then looked: what happens after the look wakes the wait)
            CLOCK.wake_on_step(self._nudged)  # (the next step's end sets it, once)
            if CLOCK.last_end() >= op.background[1]:
                break
            now = time.time_ns()
            if now >= longest or (now >= until and not self._may_defer()):
                break
            # (until ``until`` at most: past it, a checkpoint call's end, not the next look, lets it build)
            self._nudged.wait(min(_LOOK_EVERY_S, ((until if now < until else longest) - now) / 1e9))
        CLOCK.wake_on_step(None)

    def _may_defer(self) -> bool:
        """Whether building may wait: a thread is inside a checkpoint call, no drain waits, the queue is short."""
        return (not self._draining and len(self._queue) < min(DEFER_MAX_QUEUED, self._max_queued // 2)
                and self.checkpointing())  # fmt: skip

    def defer(self, finished_ns: int) -> None:
        """Wait while a thread is inside a checkpoint call, until :data:`DEFER_MAX_S` after the operation finished
        (``finished_ns``: a deadline shared by everything queued, never one per operation); a drain, or a queue of
        :data:`DEFER_MAX_QUEUED`, cuts it short.

        Building takes the interpreter lock for 4 to 50 ms a checkpoint (10 to 10,000 tensors). An async save is
        built once its upload ends, which is often just as the training thread awaits it and calls the next
        ``async_save``, whose planning and staging hold the interpreter too: building then delayed that call's
        return (``benchmarks/own_share.py``). Woken when an operation call ends (:meth:`nudge`), looked at every
        :data:`_LOOK_EVERY_S` where nothing wakes it (a call ended by the process's ending).
        """
        longest = finished_ns + int(DEFER_MAX_S * 1e9)
        while not self._hurry.is_set():
            self._nudged.clear()  # (then looked: a call's end after the look wakes the wait)
            now = time.time_ns()
            if now >= longest or not self._may_defer():
                return
            self._nudged.wait(min(_LOOK_EVERY_S, (longest - now) / 1e9))

    def nudge(self) -> None:
        """Wake a waiting builder to look again (a checkpoint operation's call ended: once a checkpoint, on the
        caller's thread; a drain; a queue grown long). One lock release (:class:`~dcp_otel._wake.Wake`): no waiting,
        and nothing a signal handler's exception can leave held."""
        self._nudged.set()

    def _record_metrics(self, op: Operation, calls: list[Call]) -> None:
        try:
            if self._metrics is not None:
                measure(op, calls, self._metrics, late=calls is not op.calls)
            else:
                count_bytes(op, None)
        except Exception as exc:  # noqa: BLE001 - telemetry never raises, not even here
            reraise_if_signalled(exc)
            report("metrics_error", "dcp_otel failed to record checkpoint metrics", exc_info=True)

    def _twin(self, tracer: trace.Tracer) -> Any:
        found = self._tracers.get(id(tracer))
        if found is None or found[0] is not tracer:
            found = self._tracers[id(tracer)] = (tracer, chosen_ids_tracer(tracer))
        return found[1]

    def _build(self, op: Operation, calls: list[Call], late: bool) -> None:
        steps = [call for call in calls if call.kind == KIND_STEP and call.span_id]
        collectives = [call for call in calls if call.kind == KIND_COLLECTIVE]
        op_call = next((call for call in calls if call.kind == KIND_OPERATION), None)
        detailed, summary = True, None
        if not late:
            detailed, reason = self.policy.decide(op, steps, op_call, len(collectives))
            summary = summary_attributes(op, steps, detailed, reason, collectives) if op_call is not None else None
        if not op.sampled:
            return
        straggler: dict[str, int | float] = {}
        for call in collectives:
            if call.arrivals:  # the coordinator's write gather: whom it waited for, on it and on the root
                straggler = named_straggler(call.arrivals)
                call.arrivals = None
                if straggler:
                    call.extra = {**(call.extra or {}), **straggler}
        keep = self.keep
        direct = self.direct and keep is not None and getattr(self.record, "directory", None) is not None  # (else: sent here)
        emit = DirectEmitter(op, []) if direct else Emitter(op, self._twin(op.tracer), [] if keep is not None else None)
        if op.root_span_id and not late:
            emit.root(straggler)
        for call in calls:
            if not detailed and call.kind in _DETAIL_KINDS:
                continue
            emit.span(call, summary if call is op_call else None)
            # Let other threads have the interpreter between SDK spans: the training thread never waits a whole
            # switch interval (5 ms) for it, and the SDK's batch worker takes its batches as they come.
            if not direct:  # (written straight, a span takes tens of us: no offer between them)
                time.sleep(0)
        if keep is not None and emit.ended:
            keep(emit.ended)  # until an exporter confirms them: a death now would lose them with the SDK's queue


_never: Callable[[], bool] = bool  # (False: no thread inside a checkpoint call)
_none_open: Callable[[], int] = int  # (0: no operation open)


#: The calls only a detailed rank exports: its steps, and DCP's collectives between them.
_DETAIL_KINDS = frozenset({KIND_STEP, KIND_COLLECTIVE})
