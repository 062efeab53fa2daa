"""torch's ``_experimental`` checkpointer, traced like DCP's own save and load (the rank's side).

``torch.distributed.checkpoint._experimental`` (``SyncCheckpointer``,
``AsyncCheckpointer``, built by ``make_sync_checkpointer`` /
``make_async_checkpointer``) writes each rank's state dict to one file with
``torch.save`` and never goes through ``_dcp_method_logger``. dcp-otel records
its calls itself (:func:`dcp_otel.attach.unlogged_calls.logged_call`), so they become
the same trace model, metrics and report as ``dcp.save``:

* **operations**: ``SyncCheckpointer.save`` is ``dcp.checkpointer_save``,
  ``AsyncCheckpointer.save`` is ``dcp.checkpointer_async_save``, and either's
  ``load`` is ``dcp.checkpointer_load``; the checkpoint id is the ``path``, so
  every rank saving it derives the same trace;
* **steps**: ``AsyncCheckpointer.save``'s wait for the previous checkpoint's write
  (``dcp.wait_previous_checkpoint``), ``DefaultStager.stage`` (``dcp.stage_checkpoint``, on the staging
  histogram), ``CheckpointProcess.write`` (``dcp.hand_off_checkpoint``: before
  the first write, waiting for the checkpoint process to start), ``CheckpointWriter.write`` (``dcp.write_checkpoint``, with the
  bytes of the rank's file), ``CheckpointReader.read``
  (``dcp.read_checkpoint``, the bytes it read), and the barrier the writer
  waits at, ``DistBarrier`` / ``TCPStoreBarrier.execute_barrier``
  (``dcp.barrier``), so waiting for the other ranks is its own span;
* **the async write**: ``CheckpointProcess.write`` hands the staged state dict
  to its executor thread, as DCP's ``async_save`` does:
  :class:`~dcp_otel.attach.async_thread.AsyncContextCarrier` opens
  ``dcp.async_upload`` (and ``dcp.async_staging`` for a staging future), ended
  by the write future, and runs ``_write`` in the operation's context. Its write
  request carries the operation (:meth:`OperationStarter.export
  <dcp_otel.tracing.operations.OperationStarter.export>`) to the checkpoint
  process, which continues it (:mod:`dcp_otel.processes.checkpoint_process`) and relays
  its metrics back; they are applied once the process answered.

The process is given its :class:`~dcp_otel.attach.async_process.DaemonBootstrap` on a
copy of the ``RankInfo`` the ``CheckpointProcess`` is built with (the user's own
object is untouched), since that is what torch pickles into the new process.

Usage (what :mod:`dcp_otel.attach.patches` installs)::

    wrapt.wrap_function_wrapper(checkpointer_module, "SyncCheckpointer.save", operation(CHECKPOINTER_SAVE)(hooks))
"""

from __future__ import annotations

import copy
import importlib
import os
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.attach.async_process import BOOTSTRAP_ATTR, replace_entry
from dcp_otel.attach.unlogged_calls import After, CheckpointFile, logged_call
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.processes import CHECKPOINT_PROCESS_MAIN

if TYPE_CHECKING:
    from dcp_otel.attach.patches import Hooks

MODULE = "torch.distributed.checkpoint._experimental"
CHECKPOINTER_MODULE = MODULE + ".checkpointer"
WRITER_MODULE = MODULE + ".checkpoint_writer"
READER_MODULE = MODULE + ".checkpoint_reader"
BARRIERS_MODULE = MODULE + ".barriers"
STAGING_MODULE = MODULE + ".staging"
PROCESS_MODULE = MODULE + ".checkpoint_process"
PROCESS_CLASS = "CheckpointProcess"
PROCESS_ENTRY = "_subprocess"
#: The file each rank writes into a checkpoint's folder.
RANK_FILE = "checkpoint_{rank}.pt"
#: ``RequestType.WRITE_CHECKPOINT.value``
WRITE_REQUEST = "write_checkpoint"
#: Key of a write request's payload carrying the rank's operation (torch reads only its own keys).
CARRIER_KEY = "_dcp_otel_operation"

Wrapper = Callable[..., Any]


def path_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """The ``path`` of ``save(path, ...)``, ``load(path, ...)``, ``write(path, ...)``, ``read(path, ...)``."""
    return args[0] if args else kwargs.get("path")


def operation(name: str) -> Callable[[Hooks], Wrapper]:
    """A checkpointer's ``save`` or ``load``: an operation whose checkpoint id is its path."""
    return lambda hooks: logged_call(hooks.feed, name, checkpoint_id=path_of)


def async_save(hooks: Hooks) -> Wrapper:
    """``AsyncCheckpointer.save``: an operation, whose wait for the previous checkpoint's write is a step.

    torch's ``save`` first waits for the previous write (``result()``), so a slow
    upload holds up the next checkpoint, and the training loop with it. When that
    write is still running, the wait happens here, as ``dcp.wait_previous_checkpoint``,
    with ``futures.wait`` (which never raises): torch's own ``result()`` (unbounded as
    well) then returns or raises at once, exactly as it would have.
    """
    operation_call = logged_call(hooks.feed, semconv.CHECKPOINTER_ASYNC_SAVE, checkpoint_id=path_of)
    waited = logged_call(hooks.feed, semconv.CHECKPOINTER_WAIT_PREVIOUS, starts_operations=False)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        def save(*args: Any, **kwargs: Any) -> Any:
            previous = getattr(instance, "_write_future", None)
            if isinstance(previous, Future) and not previous.done():
                waited(futures.wait, None, ([previous],), {})
            return wrapped(*args, **kwargs)

        return operation_call(save, instance, args, kwargs)

    return wrapper


def step(name: str, after: Callable[[Hooks], After] | None = None) -> Callable[[Hooks], Wrapper]:
    """A call inside a checkpointer's operation (an operation of its own when called alone)."""
    return lambda hooks: logged_call(hooks.feed, name, after(hooks) if after is not None else None)


def staged_by(hooks: Hooks) -> After:
    """After its ``DefaultStager.stage``: what it was given to copy (bytes, devices; pinned/shared from its config)."""
    on_staging = hooks.recorder.on_staging

    def after(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        on_staging(instance, args[0] if args else kwargs.get("state_dict"))

    return after


def rank_file(written: bool) -> Callable[[Hooks], After]:
    """After a writer's ``write`` (a reader's ``read``): its rank's file, for the builder to count."""

    def for_hooks(hooks: Hooks) -> After:
        on_gathered = hooks.recorder.on_gathered

        def after(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            path, rank = path_of(args, kwargs), getattr(getattr(instance, "_rank_info", None), "global_rank", None)
            if isinstance(path, (str, os.PathLike)) and isinstance(rank, int):
                # Absolute: the builder sizes it later, wherever the working directory is by then.
                on_gathered(CheckpointFile(os.path.abspath(os.path.join(path, RANK_FILE.format(rank=rank))), written))

        return after

    return for_hooks


# --- the checkpoint process ---------------------------------------------------
def process_class() -> Any:
    """torch's ``CheckpointProcess`` (raises if this torch has none)."""
    return getattr(importlib.import_module(PROCESS_MODULE), PROCESS_CLASS)


def process_init(hooks: Hooks) -> Wrapper:
    """Around ``CheckpointProcess.__init__``: the process it spawns gets a bootstrap, on a copy of ``rank_info``."""
    bridge = hooks.bridge

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            if args:
                args = (_with_bootstrap(args[0], bridge.bootstrap()), *args[1:])
            elif "rank_info" in kwargs:
                kwargs = {**kwargs, "rank_info": _with_bootstrap(kwargs["rank_info"], bridge.bootstrap())}
        except Exception as exc:  # noqa: BLE001 - the process then runs untraced
            reraise_if_signalled(exc)
            report("process_bridge_error", "dcp_otel could not prepare the checkpoint process", exc_info=True)
        return wrapped(*args, **kwargs)

    return wrapper


def _with_bootstrap(rank_info: Any, bootstrap: object) -> Any:
    carrier = copy.copy(rank_info)
    setattr(carrier, BOOTSTRAP_ATTR, bootstrap)
    return carrier


def process_created(hooks: Hooks) -> Wrapper:
    """Around ``CheckpointProcess._create_subprocess``: once the process is up, read its metrics pipe."""
    bridge = hooks.bridge

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ok = False
        try:
            result = wrapped(*args, **kwargs)
            ok = True
            return result
        finally:
            bridge.started(getattr(getattr(instance, "_rank_info", None), BOOTSTRAP_ATTR, None), ok)

    return wrapper


def process_hand_off(hooks: Hooks) -> Wrapper:
    """Around ``CheckpointProcess.write`` (the caller): the upload (and staging) calls open, then the hand-off.

    The hand-off is a step of its own: before the first write it waits for the
    checkpoint process to start (seconds: a new Python process importing torch).
    """
    execute_save = hooks.carrier.execute_save
    timed = logged_call(hooks.feed, semconv.CHECKPOINTER_HAND_OFF)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        def hand_off(*args: Any, **kwargs: Any) -> Any:
            return timed(wrapped, instance, args, kwargs)

        return execute_save(hand_off, instance, args, kwargs)

    return wrapper


def process_write(hooks: Hooks) -> Wrapper:
    """Around ``CheckpointProcess._write`` (its executor thread): in the operation's context; then its metrics."""
    carrier, bridge = hooks.carrier, hooks.bridge

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return carrier.save_wrapper(wrapped, instance, args, kwargs)
        finally:
            bridge.drain()  # the process sent this write's metrics before it answered

    return wrapper


def process_send(hooks: Hooks) -> Wrapper:
    """Around ``CheckpointProcess._send``: a write request carries the current operation in its payload."""
    starter = hooks.recorder.starter

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request_type = kwargs.get("request_type", args[0] if args else None)
        payload = kwargs.get("payload", args[1] if len(args) > 1 else None)
        if getattr(request_type, "value", None) == WRITE_REQUEST and isinstance(payload, dict):
            carried = starter.export()
            if carried is not None:  # a new dict: torch's own is left as it built it
                return wrapped(request_type, {**payload, CARRIER_KEY: carried})
        return wrapped(*args, **kwargs)

    return wrapper


def replace_process_entry() -> Callable[[], None] | None:
    """Make :data:`~dcp_otel.processes.CHECKPOINT_PROCESS_MAIN` the process's entry point."""
    return replace_entry(process_class, PROCESS_ENTRY, CHECKPOINT_PROCESS_MAIN)


#: What each attachment point is, and what is lost without it (for :data:`dcp_otel.attach.patches.PATCHES`).
_NO_PROCESS = "the checkpoint process's write is not part of the checkpoint's trace"
POINTS: tuple[tuple[str, str, str, Callable[[Hooks], Wrapper]], ...] = (
    (CHECKPOINTER_MODULE, "SyncCheckpointer.save", f"no dcp.{semconv.CHECKPOINTER_SAVE} span",
     operation(semconv.CHECKPOINTER_SAVE)),
    (CHECKPOINTER_MODULE, "SyncCheckpointer.load", f"no dcp.{semconv.CHECKPOINTER_LOAD} span",
     operation(semconv.CHECKPOINTER_LOAD)),
    (CHECKPOINTER_MODULE, "AsyncCheckpointer.save", f"no dcp.{semconv.CHECKPOINTER_ASYNC_SAVE} span", async_save),
    (CHECKPOINTER_MODULE, "AsyncCheckpointer.load", f"no dcp.{semconv.CHECKPOINTER_LOAD} span",
     operation(semconv.CHECKPOINTER_LOAD)),
    (STAGING_MODULE, "DefaultStager.stage", f"no dcp.{semconv.CHECKPOINTER_STAGE} span",
     step(semconv.CHECKPOINTER_STAGE, staged_by)),
    (WRITER_MODULE, "CheckpointWriter.write", f"no dcp.{semconv.CHECKPOINTER_WRITE} span or written bytes",
     step(semconv.CHECKPOINTER_WRITE, rank_file(written=True))),
    (READER_MODULE, "CheckpointReader.read", f"no dcp.{semconv.CHECKPOINTER_READ} span or read bytes",
     step(semconv.CHECKPOINTER_READ, rank_file(written=False))),
    (BARRIERS_MODULE, "DistBarrier.execute_barrier", f"no dcp.{semconv.CHECKPOINTER_BARRIER} span",
     step(semconv.CHECKPOINTER_BARRIER)),
    (BARRIERS_MODULE, "TCPStoreBarrier.execute_barrier", f"no dcp.{semconv.CHECKPOINTER_BARRIER} span",
     step(semconv.CHECKPOINTER_BARRIER)),
    (PROCESS_MODULE, "CheckpointProcess.__init__", _NO_PROCESS, process_init),
    (PROCESS_MODULE, "CheckpointProcess._create_subprocess", "no metrics from the checkpoint process", process_created),
    (PROCESS_MODULE, "CheckpointProcess.write", "no dcp.async_upload span for the checkpointer's async save",
     process_hand_off),
    (PROCESS_MODULE, "CheckpointProcess._write", _NO_PROCESS, process_write),
    (PROCESS_MODULE, "CheckpointProcess._send", _NO_PROCESS, process_send),
)  # fmt: skip
