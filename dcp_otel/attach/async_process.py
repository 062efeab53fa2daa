"""Carry the trace and the metrics across torch's async checkpoint daemon (rank side).

``async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)`` runs
the background ``save`` in a daemon process that torch spawns on the first such
save and reuses afterwards. Left alone, that process is invisible. The rank
side of the bridge, installed by :mod:`dcp_otel.attach.patches`:

* the daemon's entry point becomes :func:`dcp_otel.processes.daemon.daemon_main`, which
  sets up tracing there and then runs torch's own entry point unchanged;
* ``_ProcessGroupInitInfo``, which torch hands to the new daemon, also carries a
  :class:`DaemonBootstrap`: this rank's options, its resource attributes, and
  the write end of a pipe for the daemon's metrics. Each bootstrap has its own
  pipe: two ``async_save`` calls issued before the first daemon is up each make
  one, and torch may start a daemon for each. No pipe is closed while a daemon
  may still be given it (that made torch's spawn fail with ``handle is closed``,
  or lost every metric of the job's daemon); the rank reads every daemon's;
* every save request sent to the daemon carries the current operation and span
  (:meth:`~dcp_otel.tracing.operations.OperationStarter.export`), the way OTel's
  messaging instrumentations put context in message headers;
* when the daemon answers a request, its metrics are applied to this rank's
  (:func:`dcp_otel.metrics.relay.drain`), so one scrape target per rank shows
  them all.

The caller thread's context reaches the executor thread that talks to the
daemon through :class:`~dcp_otel.attach.async_thread.AsyncContextCarrier`, exactly as
for the thread-based executor.

Usage (what :mod:`dcp_otel.attach.patches` installs)::

    bridge = ProcessBridge(recorder, options, metrics)
    wrapt.wrap_function_wrapper(module, "_AsyncCheckpointProcess._send", bridge.send)
"""

from __future__ import annotations

import importlib
import multiprocessing
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from dcp_otel import _forksafe
from dcp_otel._selftelemetry import report
from dcp_otel.config import InstrumentOptions, resolve_callable
from dcp_otel.live.progress import RemoteProgress
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.metrics.prometheus import LiveEntry, MetricsSink
from dcp_otel.metrics.relay import drain
from dcp_otel.processes import DAEMON_MAIN
from dcp_otel.tracing.tracker import SpanRecorder

PROCESS_MODULE = "torch.distributed.checkpoint._async_process_executor"
DAEMON_CLASS = "_AsyncCheckpointProcess"
DAEMON_ENTRY = "_checkpointing_subprocess"
#: Attribute of torch's ``_ProcessGroupInitInfo`` carrying the :class:`DaemonBootstrap`.
BOOTSTRAP_ATTR = "_dcp_otel_bootstrap"
#: Attribute of torch's ``_CheckpointRequestIdentifier`` carrying the operation.
CARRIER_ATTR = "_dcp_otel_operation"


@dataclass(frozen=True)
class DaemonBootstrap:
    """What the daemon needs to trace like its rank; pickled into it by torch."""

    run_id: str | None
    slowest_keys: int
    max_open_spans: int
    flush_timeout_s: int
    process_setup: str | None
    detail: str = "auto"
    span_budget: int = 2000
    resource: dict[str, Any] = field(default_factory=dict)
    relay: Connection | None = None
    stall_after_s: float | None = None


class ProcessBridge:
    """The rank's side: bootstrap the daemon, tag requests, collect the daemon's metrics."""

    def __init__(self, recorder: SpanRecorder, options: InstrumentOptions, metrics: MetricsSink | None) -> None:
        self._recorder = recorder
        self._options = options
        self._metrics = metrics
        self._lock = threading.Lock()
        #: Pipes of bootstraps no daemon has been started with yet, by id of their write end.
        self._pending: dict[int, tuple[Connection, Connection]] = {}
        self._readers: list[Connection] = []  # of daemons that started
        #: What each daemon last said of its open operations (by id of its pipe), for the live progress.
        self._remote: dict[int, tuple[str, list[LiveEntry]]] = {}
        _forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        # The pipes belong to the parent's daemons; a forked child never reads them.
        self._lock = threading.Lock()
        self._pending, self._readers, self._remote = {}, [], {}

    def bootstrap(self) -> DaemonBootstrap:
        """A bootstrap for a new daemon, with a metrics pipe of its own."""
        reader, writer = multiprocessing.get_context("spawn").Pipe(duplex=False)
        with self._lock:
            self._pending[id(writer)] = (reader, writer)
        resource = getattr(self._recorder.provider(), "resource", None)
        options = self._options
        return DaemonBootstrap(
            run_id=options.run_id,
            slowest_keys=options.slowest_keys,
            max_open_spans=options.max_open_spans,
            flush_timeout_s=options.flush_timeout_s,
            process_setup=options.process_setup,
            detail=options.detail,
            span_budget=options.span_budget,
            resource=dict(getattr(resource, "attributes", None) or {}),
            relay=writer,
            stall_after_s=options.stall_after_s,
        )

    # --- wrappers (wrapt signature) -----------------------------------------
    def init_info(self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Around ``_ProcessGroupInitInfo.__init__``: what torch gives a new daemon."""
        result = wrapped(*args, **kwargs)
        try:
            setattr(instance, BOOTSTRAP_ATTR, self.bootstrap())
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("process_bridge_error", "dcp_otel could not prepare the async save process", exc_info=True)
        return result

    def send(self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Around ``_AsyncCheckpointProcess._send`` (executor thread): tag save requests."""
        data = args[0] if args else kwargs.get("data")
        request_id = getattr(data, "checkpoint_request_id", None)
        if request_id is not None:
            carried = self._recorder.starter.export()
            if carried is not None:
                try:
                    setattr(request_id, CARRIER_ATTR, carried)
                except Exception as exc:  # noqa: BLE001
                    reraise_if_signalled(exc)
                    report("process_bridge_error", "dcp_otel could not tag an async save request", exc_info=True)
        return wrapped(*args, **kwargs)

    def daemon_started(self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:  # fmt: skip
        """Around ``_AsyncCheckpointProcess.__init__``: a daemon was started with one bootstrap's pipe.

        Once it has started (or failed to), the daemon holds its own copy of the
        write end: ours is closed, so the rank sees the end of the pipe when the
        daemon exits, and the read end joins the ones drained after each save.
        """
        info = kwargs.get("pg_init_info", args[0] if args else None)
        started = False
        try:
            result = wrapped(*args, **kwargs)
            started = True
            return result
        finally:
            self.started(getattr(info, BOOTSTRAP_ATTR, None), started)

    def started(self, bootstrap: object, ok: bool) -> None:
        """A process was started (``ok``), or failed to start, with ``bootstrap``: see :meth:`daemon_started`."""
        writer = bootstrap.relay if isinstance(bootstrap, DaemonBootstrap) else None
        with self._lock:
            pipe = self._pending.pop(id(writer), None) if writer is not None else None
            if pipe is not None and ok:
                self._readers.append(pipe[0])
        if pipe is not None:
            pipe[1].close()
            if not ok:
                pipe[0].close()

    def save(self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Around ``_AsyncCheckpointProcess.save``: apply the daemons' metrics once it answered."""
        try:
            return wrapped(*args, **kwargs)
        finally:
            self.drain()

    def drain(self) -> int:
        """Apply whatever metrics the daemons have sent so far (and note their progress); return how many."""
        with self._lock:
            return sum(drain(reader, self._metrics, self._progress_of(reader)) for reader in self._readers)

    def _progress_of(self, reader: Connection) -> Callable[[str, list[LiveEntry]], None]:
        def remember(where: str, entries: list[LiveEntry]) -> None:  # called by drain, under self._lock
            self._remote[id(reader)] = (where, entries)

        return remember

    def remote_progress(self) -> list[RemoteProgress]:
        """Where the daemons' open operations are, as each last said (drained by :meth:`drain`)."""
        with self._lock:
            held = list(self._remote.values())
        return [RemoteProgress(str(operation), str(step), str(rank), int(float(since_s) * 1e9), where)
                for where, entries in held for operation, step, rank, since_s, _ in entries]  # fmt: skip

    def close(self) -> None:
        with self._lock:
            conns = [*self._readers, *(end for pipe in self._pending.values() for end in pipe)]
            self._pending, self._readers = {}, []
        for conn in conns:
            conn.close()


def daemon_class() -> Any:
    """torch's ``_AsyncCheckpointProcess`` (raises if this torch has none)."""
    return getattr(importlib.import_module(PROCESS_MODULE), DAEMON_CLASS)


def replace_daemon_entry() -> Callable[[], None] | None:
    """Make :data:`~dcp_otel.processes.DAEMON_MAIN` the daemon's entry point; see :func:`replace_entry`."""
    return replace_entry(daemon_class, DAEMON_ENTRY, DAEMON_MAIN)


def replace_entry(owner_of: Callable[[], type], name: str, replacement_spec: str) -> Callable[[], None] | None:
    """Make the function named ``replacement_spec`` the static method ``name`` of the class ``owner_of()``
    returns, which torch spawns a process with (``owner_of`` raising means "not this torch": ``None``).

    Not a ``wrapt`` wrapper: torch pickles the entry point by name into the
    spawned process, so it must be a plain module-level function. It is named
    here (``"module:function"``), not imported: the other process's code is
    loaded only when it is installed, and never imports this side back. Its
    module's ``TORCH_ENTRY`` is given torch's own function (which the
    replacement then runs; a forked child inherits it). Returns the function
    that restores torch's, or ``None`` if this torch has no such entry point.
    """
    try:
        owner = owner_of()
    except Exception as exc:  # noqa: BLE001 - any import failure means "not this torch"
        reraise_if_signalled(exc)
        return None
    original = vars(owner).get(name)
    if not isinstance(original, staticmethod):
        return None
    replacement = resolve_callable(replacement_spec)
    if original.__func__ is not replacement:
        sys.modules[replacement.__module__].TORCH_ENTRY = original.__func__  # type: ignore[attr-defined]
    placed = staticmethod(replacement)
    setattr(owner, name, placed)

    def restore() -> None:
        if vars(owner).get(name) is placed:  # only ours: not what another tool put over it since
            setattr(owner, name, original)

    return restore
