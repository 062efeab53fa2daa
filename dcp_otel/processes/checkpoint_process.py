"""Tracing inside the ``_experimental`` checkpointer's checkpoint process (the process side).

``AsyncCheckpointer`` writes each checkpoint in a process of its own, which
``CheckpointProcess`` spawns with ``CheckpointProcess._subprocess`` as entry
point and then talks to over a pipe. :func:`checkpoint_process_main` replaces
that entry point (see :mod:`dcp_otel.attach.checkpointer` for the rank's side). It runs
torch's own entry point with three changes, none of which the checkpoint sees:

1. right after the user's ``subprocess_init_fn`` (which may configure
   OpenTelemetry in this process), tracing is set up as in torch's async save
   daemon (:class:`~dcp_otel.processes.daemon.DaemonSession`): the rank's options and
   resource, a tracer provider (the ``process_setup`` hook, the SDK the init
   function configured, or one built from the inherited ``OTEL_*`` variables),
   and metrics relayed to the rank;
2. each write request runs in the context of the operation the rank sent with
   it, so ``dcp.write_checkpoint`` and its ``dcp.barrier`` are children of the
   rank's ``dcp.async_upload``, in the checkpoint's one trace;
3. before torch answers the rank, that request's metrics are sent to it and a
   background flush of the spans is requested; the spans of the last request
   are flushed when the process ends.

A process started without a bootstrap (dcp-otel not instrumented when it was
spawned) runs torch's entry point untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from dcp_otel.attach.async_process import BOOTSTRAP_ATTR, DaemonBootstrap
from dcp_otel.attach.checkpointer import CARRIER_KEY, PROCESS_ENTRY, WRITE_REQUEST, process_class
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.processes.daemon import CHECKPOINT_PROCESS, DaemonSession

#: torch's own entry point, set when it is replaced in this process.
TORCH_ENTRY: Callable[..., None] | None = None


def checkpoint_process_main(
    sub_rank: int,
    rank_info: Any,
    parent_pipe: Any,
    subprocess_init_fn: Callable[..., None],
    subprocess_init_args: tuple[Any, ...],
    checkpoint_writer_init_fn: Callable[..., Any],
    checkpoint_writer_init_args: dict[str, Any],
) -> None:
    """The checkpoint process's entry point: torch's, traced (see the module)."""
    run_traced(_torch_entry(), (sub_rank, rank_info, parent_pipe, subprocess_init_fn, subprocess_init_args,
                                checkpoint_writer_init_fn, checkpoint_writer_init_args))  # fmt: skip


def run_traced(entry: Callable[..., None], args: tuple[Any, ...]) -> None:
    """Run a checkpoint process's own entry point ``entry(*args)``, traced (see the module).

    Both checkpointers' entry points begin ``(sub_rank, rank_info, parent_pipe, subprocess_init_fn,
    subprocess_init_args, ...)``: torch's ``_experimental`` one and ``torch_checkpointing``'s
    (:mod:`dcp_otel.processes.writer_process`); what follows is passed through untouched.
    """
    sub_rank, rank_info, parent_pipe, subprocess_init_fn, subprocess_init_args, *rest = args
    bootstrap = getattr(rank_info, BOOTSTRAP_ATTR, None)
    if not isinstance(bootstrap, DaemonBootstrap):
        entry(*args)
        return
    pipe = RequestPipe(parent_pipe, bootstrap)

    def init_then_trace(*init_args: Any) -> None:
        subprocess_init_fn(*init_args)  # torch reports its failure to the rank, as without dcp-otel
        pipe.start_tracing()

    try:
        entry(sub_rank, without_bootstrap(rank_info), pipe, init_then_trace, subprocess_init_args, *rest)
    finally:
        pipe.close_tracing()


def _torch_entry() -> Callable[..., None]:
    if TORCH_ENTRY is not None:
        return TORCH_ENTRY
    entry: Callable[..., None] = vars(process_class())[PROCESS_ENTRY].__func__
    return entry


def without_bootstrap(rank_info: Any) -> Any:
    """The rank's ``RankInfo`` as the user made it (the writer keeps it): a copy without the bootstrap."""
    try:
        clean = copy.copy(rank_info)
        vars(clean).pop(BOOTSTRAP_ATTR, None)
        return clean
    except Exception as exc:  # noqa: BLE001 - an extra attribute is harmless; torch ignores it
        reraise_if_signalled(exc)
        return rank_info


class RequestPipe:
    """torch's end of the pipe to the rank: each write request runs between its ``recv`` and its answer.

    Every other use of the connection passes straight through.
    """

    def __init__(self, conn: Any, bootstrap: DaemonBootstrap) -> None:
        self._conn = conn
        self._bootstrap = bootstrap
        self._session: DaemonSession | None = None
        self._open = False
        self._token: object | None = None

    def start_tracing(self) -> None:
        """Set up tracing (after the user's init function); a failure is counted and changes nothing."""
        self._session = DaemonSession.start(self._bootstrap, CHECKPOINT_PROCESS)

    def close_tracing(self) -> None:
        """The entry point returned: flush the last spans and undo the set-up."""
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def recv(self) -> Any:
        request = self._conn.recv()
        session = self._session
        if session is not None and getattr(getattr(request, "request_type", None), "value", None) == WRITE_REQUEST:
            payload = getattr(request, "payload", None)
            self._token = session.begin(payload.get(CARRIER_KEY) if isinstance(payload, dict) else None)
            self._open = True
        return request

    def send(self, obj: Any) -> None:
        session = self._session
        if self._open and session is not None:  # the answer to a write request, success or failure
            self._open = False
            token, self._token = self._token, None
            session.end(token)
        self._conn.send(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)
