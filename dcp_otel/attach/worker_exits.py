"""How the workers ended, seen from the process that started them: each exit status, told to the survivors.

torchelastic's agent (``torchrun``, ``dcp-otel-run``) starts the workers and,
when one fails or all are done, closes them all (``PContext.close``: SIGTERM to
those still running, SIGKILL after a grace). Once ``close`` returns, each
worker's exit status is known there, and only there: ``-9`` for the one the OOM
killer took, ``-15`` for those the agent stopped. This wraps ``close`` once per
process and hands ``{pid: status}`` to every :class:`~dcp_otel.spool.survivor.Survivor`
registered, which report the workers that died with a checkpoint open at once,
saying how each died, and learn the workers' run id: the records of the
processes a worker started (its async save or checkpoint process) are of the job too. ``close`` itself runs unchanged, its exceptions included
(torchelastic's own ``SignalException`` when the agent is stopped meanwhile).

``torch.multiprocessing.spawn`` (Lightning's ``ddp_spawn``) is watched the
same way: its ``ProcessContext.join`` reaps the ranks, so each call hands on
the statuses of the ranks that have ended by then.

Usage::

    undo = watch_worker_exits(survivor)   # when torch.distributed.elastic.multiprocessing.api is imported
    undo_spawn = watch_spawned_ranks(survivor)   # when torch.multiprocessing.spawn is imported
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import wrapt
from opentelemetry.instrumentation.utils import unwrap

from dcp_otel._selftelemetry import report
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.spool.layout import start_ticks

ELASTIC_MODULE = "torch.distributed.elastic.multiprocessing.api"
SPAWN_MODULE = "torch.multiprocessing.spawn"


class Expects(Protocol):
    def expect(self, statuses: Mapping[tuple[int, int | None], int | None], end_ns: int,
               job: str | None = None) -> None: ...  # fmt: skip


_told: list[Expects] = []
_told_spawn: list[Expects] = []


def exit_statuses(context: Any, pids: dict[int, int]) -> dict[int, int | None]:
    """``{pid: status}`` of a closed ``PContext``'s workers (``Popen.returncode`` style; ``None``: not known)."""
    statuses: dict[int, int | None] = dict.fromkeys(pids.values())
    handlers = getattr(context, "subprocess_handlers", None)  # SubprocessContext: a script per worker
    if isinstance(handlers, dict):
        for handler in handlers.values():
            proc = getattr(handler, "proc", None)
            if proc is not None:
                statuses[proc.pid] = proc.returncode
    processes = getattr(getattr(context, "_pc", None), "processes", None)  # MultiprocessContext: a function
    if isinstance(processes, list):
        for process in processes:
            statuses[process.pid] = process.exitcode
    return statuses


def _close(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        pids = dict(instance.pids())
    except Exception as exc:  # noqa: BLE001 - a context that never started
        reraise_if_signalled(exc)
        pids = {}
    starts = _starts(pids.values())  # (before they are reaped: a pid alone may be another process's later)
    try:
        return wrapped(*args, **kwargs)
    finally:
        if pids:
            _tell(instance, pids, starts)


def workers_job(context: Any) -> str | None:
    """The run id the workers resolve (``DCP_OTEL_RUN_ID``, else the one torchelastic gave them): records with
    it are of this agent's job, its workers' checkpoint processes' too."""
    explicit = os.environ.get("DCP_OTEL_RUN_ID", "").strip()
    if explicit:
        return explicit
    envs = getattr(context, "envs", None)
    first = next(iter(envs.values()), None) if isinstance(envs, dict) else None
    found = first.get("TORCHELASTIC_RUN_ID", "").strip() if isinstance(first, dict) else ""
    return found if found.lower() not in ("", "none") else None


def _starts(pids: Iterable[int]) -> dict[int, int | None]:
    return {pid: start_ticks(pid) for pid in pids}


def _tell(instance: Any, pids: dict[int, int], starts: dict[int, int | None], told: list[Expects] = _told) -> None:
    try:
        statuses = {(pid, starts.get(pid)): status for pid, status in exit_statuses(instance, pids).items()}
        now, job = time.time_ns(), workers_job(instance)
        for survivor in tuple(told):
            survivor.expect(statuses, now, job)
    except Exception as exc:  # noqa: BLE001 - the agent goes on as without us
        reraise_if_signalled(exc)
        report("survivor_error", "dcp_otel could not read how torchelastic's workers ended", exc_info=True)


def watch_worker_exits(survivor: Expects) -> Callable[[], None]:
    """Tell ``survivor`` how the workers of every ``PContext`` closed in this process ended; returns the undo."""
    return _watch(ELASTIC_MODULE, "PContext", "close", _close, _told, survivor)


def _watch(module_name: str, owner: str, method: str, wrapper: Callable[..., Any], told: list[Expects],
           survivor: Expects) -> Callable[[], None]:  # fmt: skip
    """Wrap ``owner.method`` of ``module_name`` once per process (while anyone is told), tell ``survivor`` too."""
    module = importlib.import_module(module_name)  # (torch.multiprocessing's `spawn` is also a function's name)
    if not told:
        wrapt.wrap_function_wrapper(module, f"{owner}.{method}", wrapper)
    if survivor not in told:
        told.append(survivor)

    def undo() -> None:
        if survivor in told:
            told.remove(survivor)
            cls = getattr(module, owner)
            if not told and isinstance(vars(cls).get(method), wrapt.FunctionWrapper):
                unwrap(cls, method)

    return undo


def _join(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:  # (while they run, before join reaps them)
        starts = _starts(p.pid for p in getattr(instance, "processes", []) if p.exitcode is None)
    except Exception as exc:  # noqa: BLE001
        reraise_if_signalled(exc)
        starts = {}
    try:
        return wrapped(*args, **kwargs)
    finally:
        try:
            ended = {p.pid: p.pid for p in getattr(instance, "processes", []) if p.exitcode is not None and p.pid in starts}
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            ended = {}
        if ended:
            _tell(_Spawned(instance), ended, starts, _told_spawn)


class _Spawned:
    """A ``torch.multiprocessing.spawn`` context as :func:`exit_statuses` reads one."""

    def __init__(self, context: Any) -> None:
        self._pc = context


def watch_spawned_ranks(survivor: Expects) -> Callable[[], None]:
    """Tell ``survivor`` how the ranks ``torch.multiprocessing.spawn`` started in this process ended; the undo."""
    return _watch(SPAWN_MODULE, "ProcessContext", "join", _join, _told_spawn, survivor)
