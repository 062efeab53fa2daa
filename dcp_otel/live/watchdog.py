"""The stall watchdog: one background thread per process, started with its first DCP operation.

Every tick (1 s; a quarter of ``stall_after_s`` when that is shorter, at least
50 ms) it reads where each open operation is (:class:`~dcp_otel.live.progress.LiveState`)
and:

* reports an operation whose innermost call has made no progress for longer
  than its threshold (:class:`~dcp_otel.live.stalls.StallReporter`), at once
  and again at 2, 4, 8, ... times the threshold while it lasts;
* publishes the progress where a metrics collection cannot read it itself: the
  multiprocess-mode gauges, and, in a checkpoint process, the rank it relays to;
* applies what a checkpoint process relayed to this rank (``before``).

Each tick it also writes a heartbeat (and the training step the loop said)
into the process's record (:mod:`dcp_otel.spool.record`): a survivor that
finds the process gone knows it was alive until then. Nothing it
does waits for an exporter (stall spans are exported on a thread of their own).

It never takes part in a collective, never touches a torch object, and never
runs on the caller's thread: a DCP call costs the same with it as without it
(``benchmarks/watchdog.py`` measures that, and what a tick costs).

Usage::

    watchdog = Watchdog(live, reporter, record=record)
    recorder.watch = watchdog.ensure_running    # the tracker calls it when an operation starts
    ...
    watchdog.stop()
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from dcp_otel._selftelemetry import report
from dcp_otel.live.progress import LiveState, Progress
from dcp_otel.live.signal_exceptions import join_started, reraise_if_signalled, start_elsewhere
from dcp_otel.live.stalls import StallReporter
from dcp_otel.metrics.prometheus import LiveEntry
from dcp_otel.spool.record import ProcessRecord
from dcp_otel.tracing.training_step import explicit_step

#: The longest and shortest ticks.
MAX_TICK_S: Final = 1.0
MIN_TICK_S: Final = 0.05


class Watchdog:
    """The watchdog of one instrumentation (see the module)."""

    def __init__(
        self,
        live: LiveState,
        reporter: StallReporter | None,
        *,
        record: ProcessRecord | None = None,
        publish: Sequence[Callable[[list[LiveEntry]], None]] = (),
        before: Callable[[], object] | None = None,
        tick_s: float | None = None,
    ) -> None:
        self.live = live
        self.reporter = reporter
        self._record = record
        self._publish = tuple(publish)
        self._before = before
        fixed = live.policy.stall_after_s
        self.tick_s = tick_s if tick_s is not None else (
            min(MAX_TICK_S, max(MIN_TICK_S, fixed / 4)) if fixed else MAX_TICK_S)  # fmt: skip
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._stopped = False
        self._wake = threading.Event()
        self._started = threading.Event()  # set by the thread itself (a helper starts it: see ensure_running)
        # (id(op), id(call), since_ns) -> (reports made, the age at which the next one is due)
        self._stalls: dict[tuple[int, int, int], tuple[int, float]] = {}
        self._published: list[LiveEntry] | None = None
        self.cpu_ns = 0  # the thread's own CPU time in its ticks (it holds the GIL for that long)
        self.ticks = 0

    # --- life -------------------------------------------------------------------------
    def ensure_running(self) -> None:
        """Start the thread if it is not running in this process (cheap when it is: called per operation)."""
        if self._pid == os.getpid() or self._stopped:
            return
        with self._lock:
            if self._pid == os.getpid() or self._stopped:
                return
            self._stalls, self._published = {}, None  # (a forked child: nothing of the parent's)
            self._wake, self._started = threading.Event(), threading.Event()
            thread = self._thread = threading.Thread(target=self._run, name="dcp-otel-watchdog", daemon=True)
            self._pid = os.getpid()
            start_elsewhere((thread,))  # (the first operation's start, on the application's thread)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._pid == os.getpid()

    def wait_running(self, timeout_s: float) -> bool:
        """Whether the thread runs in this process, waiting up to ``timeout_s`` for one that is being started
        (``ensure_running`` hands the start to a helper thread, so it returns before the thread runs)."""
        return self._pid == os.getpid() and self._started.wait(timeout_s) and self.running

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (on uninstrument); never raises."""
        self._stopped = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and self._pid == os.getpid():
            join_started(thread, timeout_s)

    def _run(self) -> None:
        self._started.set()
        while not self._stopped:
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - the watchdog never dies of a telemetry problem
                reraise_if_signalled(exc)
                report("watchdog_error", "dcp_otel's watchdog failed a tick", exc_info=True)
            self._wake.wait(self.tick_s)

    # --- a tick -----------------------------------------------------------------------
    def check(self, now_ns: int | None = None) -> None:
        """One tick (the thread calls it; tests may too)."""
        started = time.thread_time_ns()
        try:
            if self._before is not None:
                self._before()
            progress = self.live.progress()
            if self._publish:
                entries = self.live.entries()
                if entries != self._published:
                    for publish in self._publish:
                        publish(entries)
                    self._published = entries
            now_ns = now_ns if now_ns is not None else time.time_ns()
            if self._record is not None:
                self._record.heartbeat(now_ns, explicit_step())
            if self.reporter is not None and self.live.policy.enabled:
                self._check_stalls(progress, now_ns)
        finally:
            self.cpu_ns += time.thread_time_ns() - started
            self.ticks += 1

    def _check_stalls(self, progress: list[Progress], now_ns: int) -> None:
        seen = set()
        for p in progress:
            if p.where is not None:
                continue  # its checkpoint process watches (and reports) it
            threshold = self.live.policy.threshold(p.op.name)
            if threshold is None:
                continue
            key = (id(p.op), id(p.call), p.since_ns)
            seen.add(key)
            reports, due = self._stalls.get(key, (0, threshold))
            if p.age_s(now_ns) >= due:
                reports += 1
                assert self.reporter is not None
                self.reporter.report(p, threshold, reports, now_ns)
                due = threshold * 2**reports  # again at 2x, 4x, 8x ... the threshold
            self._stalls[key] = (reports, due)
        for key in set(self._stalls) - seen:
            del self._stalls[key]
