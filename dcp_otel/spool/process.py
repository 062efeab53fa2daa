"""One instrumented process's part in the spool: its record, the spans it keeps, and its survivor.

:class:`ProcessSpool` puts the pieces of :mod:`dcp_otel.spool` together for a
recorder: the record its hot path writes ahead into, the built spans kept
until an exporter confirms them, and the survivor that reports the deaths this
process outlives, sending through the recorder's tracer provider (else the
exporters ``OTEL_*`` names). :class:`AgentWatch` is the survivor alone, told how
a launcher's workers ended, for a launcher that checkpoints nothing of its own
(``torchrun`` under ``opentelemetry-instrument``, ``dcp-otel-run``).

Usage::

    spool = ProcessSpool.open(recorder, options, process_name=None)   # None: DCP_OTEL_SPOOL_DIR=off, or unusable
    spool.survivor.start()
    ...
    spool.close(clean=True)
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import wrapt
from opentelemetry import trace

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.attach import worker_exits
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.spool.delivery import Delivery
from dcp_otel.spool.layout import spool_dir_from_env
from dcp_otel.spool.record import ProcessRecord, open_spool_dir
from dcp_otel.spool.spans import SpanSpool
from dcp_otel.spool.survivor import Survivor
from dcp_otel.tracing.flushing import shut_down_in_background
from dcp_otel.tracing.trace_ids import resolve_run_id

if TYPE_CHECKING:
    from dcp_otel.tracing.tracker import SpanRecorder

#: The longest the end of an instrumentation waits for the survivor's and the confirming thread's current work.
_STOP_S = 5.0
#: How long an agent's exit waits for its survivor to mark the records of a delivery that ended during the exit.
_MARK_S = 1.0


def job_key() -> str | None:
    """The run id a launcher gave this process (``DCP_OTEL_RUN_ID``, torchrun's, SLURM's): the same on every rank
    and every restart of the job; ``None`` where none is set (then only a parent or an agent reports a death)."""
    explicit = os.environ.get("DCP_OTEL_RUN_ID", "").strip() or None
    identity = resolve_run_id(explicit, world_size=2)
    return identity.run_id if identity.source not in ("fallback", "random") else None


def usable_spool_dir(lost: str) -> str | None:
    """``DCP_OTEL_SPOOL_DIR`` (or the default), made if missing; ``None`` where it is off, or unusable (said once,
    with ``lost``: what goes missing without it)."""
    spool_dir = spool_dir_from_env()
    if spool_dir is None:
        return None
    try:
        return open_spool_dir(spool_dir)
    except OSError as exc:
        report("spool_error", "dcp_otel cannot keep records in %s: %s; %s (set DCP_OTEL_SPOOL_DIR to a directory of "
               "your own)", spool_dir, exc, lost)  # fmt: skip
        return None


def is_multiprocessing_child() -> bool:
    """Started by ``multiprocessing`` (``spawn``/``forkserver``): a DataLoader worker, a checkpoint helper, or a rank
    of ``torch.multiprocessing.spawn``; it is a survivor only once it makes a DCP call of its own."""
    return "--multiprocessing-fork" in getattr(sys, "orig_argv", sys.argv)


class ProcessSpool:
    """The spool of one recorder (see the module)."""

    def __init__(self, spool_dir: str, recorder: SpanRecorder, flush_timeout_s: float, where: str | None,
                 node: bool = False) -> None:  # fmt: skip
        self.spool_dir = spool_dir
        self._recorder = recorder
        self._where = where
        self.node = node  # span_export="node": the node's exporter sends the spans, this process none
        self.record = ProcessRecord(spool_dir, self._identity)
        timeout = float(flush_timeout_s or 10)
        # (Its confirmations never hurry the builder: an async save's measurement waits for its training step.)
        self.keep = SpanSpool(self.record, recorder.provider, lambda t: recorder.builder.drain(t, hurry=False), timeout,
                              node=node)  # fmt: skip
        self.survivor = Survivor(spool_dir, Delivery(recorder.provider, timeout), job_key(),
                                 own=lambda: self.record.directory, checkpointing=recorder.checkpointing)  # fmt: skip
        recorder.call_ended.append(self.survivor.nudge)
        recorder.record = recorder.builder.record = self.record
        recorder.builder.keep = self.keep.add
        recorder.builder.direct = node

    @classmethod
    def open(cls, recorder: SpanRecorder, flush_timeout_s: float, where: str | None,
             node: bool = False) -> ProcessSpool | None:  # fmt: skip
        """The spool of ``DCP_OTEL_SPOOL_DIR`` (or the default); ``None``, said once, where it is off or unusable
        (then ``span_export="node"`` falls back to this process's exporter, said too)."""
        lost = "a death of this process is reported by nobody"
        spool_dir = usable_spool_dir(lost + (", and this process exports its spans itself (span_export=node needs "
                                             "the spool)" if node else ""))  # fmt: skip
        if spool_dir is None and node and spool_dir_from_env() is None:
            report("setup_error", "dcp_otel: span_export=node needs the spool (%s is off): this process exports its "
                   "spans itself", semconv.ENV_SPOOL_DIR)  # fmt: skip
        return cls(spool_dir, recorder, flush_timeout_s, where, node) if spool_dir is not None else None

    def _identity(self) -> dict[str, Any]:
        provider = self._recorder.provider()
        resource = getattr(provider, "resource", None)
        attributes = dict(getattr(resource, "attributes", {}) or {})
        return {"job": job_key(), "where": self._where, "resource": attributes,
                "span_export": "node" if self.node else "process"}

    def close(self, clean: bool, exiting: bool = False) -> None:
        """At a normal end: the record goes if ``clean`` (nothing left open, every span sent), else it stays,
        marked exited, for a survivor to send what is left. ``exiting``: at interpreter exit, whose deadline the
        exit flush keeps: the threads are told to stop, not waited for (they are daemons)."""
        self.survivor.stop(0 if exiting else _STOP_S)
        self.keep.stop(0 if exiting else _STOP_S)
        if self.node and clean:  # what the node has not sent yet stays, for it to send once this process is gone
            clean = self.keep.confirm()
        elif clean and self.keep.left_untaken():  # (an earlier instrumentation's lines: for a survivor to send)
            clean = False
        self.keep.close_record(clean)

    def settled(self, timeout_s: float) -> bool:
        """Whether every span kept so far is confirmed sent (flushing once more to find out, within ``timeout_s``)."""
        return not self.keep.unconfirmed or self.keep.confirm(timeout_s)


class AgentWatch:
    """A launcher's part: the survivor of its workers, told how each ended (:mod:`dcp_otel.attach.worker_exits`).

    ``torchrun`` under ``opentelemetry-instrument`` and ``dcp-otel-run`` make no checkpoint of their own: they
    get this alone, and import no torch for it beyond what they import themselves. One per process; the
    deaths seen are sent before the launcher exits (``atexit``, within the flush timeout).
    """

    _current: ClassVar[AgentWatch | None] = None

    def __init__(self, survivor: Survivor, timeout_s: float) -> None:
        self.survivor = survivor
        self._timeout_s = timeout_s
        self._undo: list[Callable[[], None]] | None = []

    @classmethod
    def start(cls, flush_timeout_s: float = 10.0) -> AgentWatch | None:
        """The process's watch, started once (``None`` where the spool is off or unusable)."""
        if cls._current is not None:
            return cls._current
        survivor = agent_survivor(flush_timeout_s)
        if survivor is None:
            return None
        watch = cls._current = cls(survivor, float(flush_timeout_s or 10))
        survivor.start()
        for module, hook in ((worker_exits.ELASTIC_MODULE, worker_exits.watch_worker_exits),
                             (worker_exits.SPAWN_MODULE, worker_exits.watch_spawned_ranks)):  # fmt: skip
            watch_when_imported(module, hook, survivor, lambda: watch._undo)
        atexit.register(watch.at_exit)
        return watch

    def settle(self) -> None:
        """Until the deaths seen are sent (at exit: half the flush timeout at most, and a delivery under way until its
        own deadline, so an exporter that retries gets there). Where the provider they went through is stuck on
        them, its shutdown goes to a daemon thread: the SDK's exit hook would wait for the exporter again, as long
        as the exporter's own timeout, after the ranks' exit flush (found by a review: a job under a hung
        collector ended 21 s after plain, not 10)."""
        idle = self.survivor.wait_idle(self._timeout_s / 2)
        stuck = getattr(self.survivor.deliver, "settle", lambda: None)()  # (a Delivery's; None: sent, or nothing)
        if stuck is not None:
            shut_down_in_background(stuck)
        elif not idle:  # the delivery ended meanwhile: its records marked (a rename each), not left claimed by the exit
            self.survivor.wait_idle(_MARK_S)

    def at_exit(self) -> None:
        """At the interpreter's exit: :meth:`settle`, then the survivor stopped and its announcement out of the spool,
        for it reports nothing more (left, it stayed until another survivor's look found it stale). Not at the end of
        a launcher's run: ``dcp-otel-run``'s ``main`` called again in the process reuses the watch."""
        self.settle()
        self.survivor.stop(0)

    def close(self) -> None:
        atexit.unregister(self.at_exit)
        undo, self._undo = self._undo, None
        for step in reversed(undo or []):
            step()
        self.survivor.stop()
        if AgentWatch._current is self:
            AgentWatch._current = None


def watch_when_imported(module: str, watch: Callable[[Survivor], Callable[[], None]], survivor: Survivor,
                        undo: Callable[[], list[Callable[[], None]] | None]) -> None:  # fmt: skip
    """``watch(survivor)`` once ``module`` is imported (now, if it is), its undo kept in ``undo()``'s list while
    that is still there (an instrumentation undone since keeps none)."""

    def hook(_: object) -> None:
        kept = undo()
        if kept is None:
            return
        try:
            kept.append(watch(survivor))
        except Exception as exc:  # noqa: BLE001 - inside an import of the application's
            reraise_if_signalled(exc)
            report("survivor_error", "dcp_otel could not watch how the workers of %s end", module, exc_info=True)

    wrapt.register_post_import_hook(hook, module)


def agent_survivor(flush_timeout_s: float = 10.0) -> Survivor | None:
    """A survivor with no recorder of its own (``dcp-otel-run``): it sends through the global tracer provider
    where one is configured, else to what ``OTEL_*`` names; ``None`` where the spool is off or unusable."""
    spool_dir = usable_spool_dir("no dead worker is reported")
    if spool_dir is None:
        return None
    provider: Callable[[], object] = trace.get_tracer_provider
    # (No training process: the node's exporter too, for the processes that leave their spans to it.)
    # (direct: the agent's provider, where it has one, is opentelemetry-instrument's, whose exporters are the
    # environment's; sent straight to them, each export's answer is known, and a failed one is tried again.)
    return Survivor(spool_dir, Delivery(provider, flush_timeout_s, direct=True), job_key(), live=True)
