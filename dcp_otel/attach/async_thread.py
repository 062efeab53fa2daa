"""Carry the trace into DCP's async save thread.

``async_save`` (thread executor, torch's default) hands the upload to a fresh
``ThreadPoolExecutor``, which does not carry ``contextvars``: without help, the
background ``save`` would start a trace of its own. Two small wrappers fix it:

* around ``_ThreadBasedAsyncCheckpointExecutor.execute_save`` (caller thread):
  open the ``dcp.async_upload`` span (ended by the upload future) and, with an
  asynchronous stager, ``dcp.async_staging``; remember the context for the
  staged state dict object being handed over;
* around ``save_wrapper`` (executor thread): run the background ``save`` in
  that context, so it and its steps join the async save's trace.

The process-based executor (``AsyncCheckpointerType.PROCESS``) has the same
two steps, ``execute_save`` and ``_execute_save_impl``, wrapped the same way;
from its executor thread :mod:`dcp_otel.attach.async_process` carries the context on
into the daemon process. So does the ``_experimental`` ``CheckpointProcess``
(``write`` and ``_write``; see :mod:`dcp_otel.attach.checkpointer`).

The hand-over is keyed by the identity of the staged object, which the executor
keeps alive until ``save_wrapper`` runs; entries are removed when used, or when
the hand-off fails.

Usage (what :mod:`dcp_otel.attach.patches` installs)::

    carrier = AsyncContextCarrier(recorder)
    wrapt.wrap_function_wrapper(executor_module, "save_wrapper", carrier.save_wrapper)
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable

from opentelemetry import context as context_api

from dcp_otel import _forksafe
from dcp_otel._selftelemetry import report
from dcp_otel.tracing.tracker import SpanRecorder
from dcp_otel.tracing.uploads import begin_async_upload

#: Hand-overs waiting for their executor thread; bounded so a torch that never
#: calls ``save_wrapper`` cannot grow it.
MAX_PENDING_HANDOVERS = 1024


class AsyncContextCarrier:
    def __init__(self, recorder: SpanRecorder) -> None:
        self._recorder = recorder
        self._lock = threading.Lock()
        self._pending: dict[int, context_api.Context] = {}
        _forksafe.register(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._pending = {}  # hand-overs to the parent's executor threads, which the child does not have

    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)

    def execute_save(self, wrapped: Callable[..., Future[Any]], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future[Any]:
        staged = _staged_argument(args, kwargs)
        handle = None
        future: Future[Any] | None = None
        key = -1
        try:
            handle = begin_async_upload(self._recorder, staged if isinstance(staged, Future) else None)
            if handle is None:
                return wrapped(*args, **kwargs)
            carried, finish = handle
            key = id(staged)
            with self._lock:
                if len(self._pending) < MAX_PENDING_HANDOVERS:
                    self._pending[key] = carried
                else:
                    report("handover_limit", "async save context not carried: too many hand-overs pending")
            future = wrapped(*args, **kwargs)
            future.add_done_callback(finish)
        except BaseException as exc:
            # Whatever raised (the executor, or a signal handler anywhere in here): the upload ends with the future
            # if there is one (a callback added twice ends it once), else now, with the exception.
            if handle is not None:
                if future is None:
                    with self._lock:
                        self._pending.pop(key, None)
                    handle[1](exc)
                else:
                    future.add_done_callback(handle[1])
            raise
        return future

    def save_wrapper(self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self._lock:
            carried = self._pending.pop(id(_staged_argument(args, kwargs)), None)
        if carried is None:
            return wrapped(*args, **kwargs)
        token = context_api.attach(carried)
        depth = self._recorder.stack_depth()
        try:
            return wrapped(*args, **kwargs)
        except BaseException as exc:
            # A DCP call that raised without torch logging it (the daemon failing to start)
            # is still open on this thread: it ends here, with the exception.
            self._recorder.close_unfinished(depth, exc)
            raise
        finally:
            self._recorder.close_unfinished(depth, None)
            context_api.detach(token)


def _staged_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The staged state dict (or its future): DCP's executors name it ``staging_future_or_state_dict``,
    the ``_experimental`` ``CheckpointProcess`` ``state_dict``."""
    if args:
        return args[0]
    return kwargs.get("staging_future_or_state_dict", kwargs.get("state_dict"))
