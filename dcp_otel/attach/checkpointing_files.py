"""``torch_checkpointing``'s files: what its writer wrote (each item's file, timed on its ``ckpt-write`` threads)
and what its reader read, for the builder to count and summarize off the caller's thread.

Part of :mod:`dcp_otel.attach.torch_checkpointing` (its attachment points): ``CheckpointWriter.write`` is
``dcp.write_checkpoint`` (the bytes of its items' files, once it returned), ``_write_keys`` is
``dcp.write_items`` (the items: how many, the slowest, the one that failed; the threads writing them join its
stall reports), ``_write_key`` times each item, ``CheckpointReader._load_full_file`` gives each file read.

Usage (what :data:`dcp_otel.attach.torch_checkpointing.POINTS` lists)::

    wrapt.wrap_function_wrapper(writer_module, "CheckpointWriter._write_keys", write_items(hooks))
"""

from __future__ import annotations

import os
import pathlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from dcp_otel import semconv
from dcp_otel.attach.unlogged_calls import CheckpointFile, logged_call

if TYPE_CHECKING:
    from dcp_otel.attach.patches import Hooks

#: ``CheckpointWriter._write_keys``: every item's file (``_write_key`` on its ``ckpt-write`` threads).
WRITE_ITEMS: Final = "write_items"

Wrapper = Callable[..., Any]


class ItemTimes(list[tuple[int, str, bool]]):
    """The items one ``_write_keys`` call wrote: (nanoseconds, key, failed), appended by its ``ckpt-write``
    threads (``list.append`` is atomic); summarized by the builder, off the caller's thread."""

    def __init__(self, slowest: int) -> None:
        super().__init__()
        self.slowest = slowest

    def to_attributes(self) -> dict[str, Any]:
        """How many items, the slowest (and their seconds), the one that failed."""
        done = list(self)
        if not done:
            return {}
        ordered = sorted(done, reverse=True)[: self.slowest]
        facts: dict[str, Any] = {semconv.ATTR_ITEMS: len(done), semconv.ATTR_ITEMS_SLOWEST: [k for _, k, _ in ordered],
                                 semconv.ATTR_ITEMS_SLOWEST_SECONDS: [ns / 1e9 for ns, _, _ in ordered]}  # fmt: skip
        failed = next((key for _, key, bad in done if bad), None)
        if failed is not None:
            facts[semconv.ATTR_ITEMS_FAILED] = failed
        return facts


#: On a ``CheckpointWriter`` while it writes: the checkpoint's path, the files its items went to; while its items are
#: written, their times and the ``ckpt-write`` threads writing one (their stacks join the step's stall reports).
_PATH, _FILES = "_dcp_otel_path", "_dcp_otel_files"
_ITEM_TIMES, _HELPERS = "_dcp_otel_item_times", "_dcp_otel_helpers"


def write(hooks: Hooks) -> Wrapper:
    """``CheckpointWriter.write(path, ...)``: ``dcp.write_checkpoint``; once it returned, the files its
    ``write_items`` wrote, for the builder to count (on this step, as the checkpointer's rank file)."""
    on_gathered = hooks.recorder.on_gathered

    def after(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        written = vars(instance).pop(_FILES, None)
        if isinstance(written, CheckpointFile):
            on_gathered(written)

    timed = logged_call(hooks.feed, semconv.CHECKPOINTER_WRITE, after)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state = vars(instance)
        state.pop(_FILES, None)
        path = args[0] if args else kwargs.get("path")
        if isinstance(path, (str, os.PathLike)):
            state[_PATH] = os.fspath(path)
        return timed(wrapped, instance, args, kwargs)

    return wrapper


def write_items(hooks: Hooks) -> Wrapper:
    """``CheckpointWriter._write_keys(save_items, state_dict)``: ``dcp.write_items``, its files and items (listed,
    sized and summarized by the builder: on the caller's thread only references are kept)."""
    innermost_call = hooks.recorder.innermost_call
    slowest = hooks.recorder.options.slowest_keys
    timed = logged_call(hooks.feed, WRITE_ITEMS)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state = vars(instance)

        def run(*args: Any, **kwargs: Any) -> Any:
            call = innermost_call()  # (inside the step: this is it)
            if call is not None:
                state[_ITEM_TIMES] = call.summary = ItemTimes(slowest)
                state[_HELPERS] = call.helpers = set()
            result = wrapped(*args, **kwargs)
            items = args[0] if args else kwargs.get("save_items", ())
            if items:
                path, config = state.get(_PATH), getattr(getattr(instance, "_args", None), "config", None)
                # Relative paths are the working directory's now (the builder sizes them later).
                here = os.getcwd() if not (isinstance(path, str) and os.path.isabs(path)) else ""
                state[_FILES] = CheckpointFile(lambda: tuple(os.path.join(here, item[2]) for item in items),
                                               written=True, moved=lambda: _moved(config, path, here))  # fmt: skip
            return result

        try:
            return timed(run, instance, args, kwargs)
        finally:
            state.pop(_ITEM_TIMES, None)
            state.pop(_HELPERS, None)

    return wrapper


def _moved(config: Any, path: object, here: str) -> tuple[str, str] | None:
    """The writer's temporary folder and the checkpoint's path it is renamed onto, if it writes to one: as
    ``torch_checkpointing``'s ``_temp_dir_path`` makes them (``Path``: ``./ck`` and ``ck/.`` are ``ck``), under
    ``here`` (the working directory when it wrote) if relative."""
    prefix = getattr(config, "temp_dir_prefix", None)
    if not isinstance(path, str) or not getattr(config, "write_to_temp_dir", False) or not isinstance(prefix, str):
        return None
    final = pathlib.Path(here, path)
    return os.fspath(final.parent / f"{prefix}{final.name}"), os.fspath(final)


def write_item(hooks: Hooks) -> Wrapper:
    """``CheckpointWriter._write_key(key, ...)`` (a ``ckpt-write`` thread, no span): its time, for ``write_items``."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        started = time.perf_counter_ns()
        helpers, me = vars(instance).get(_HELPERS), threading.get_ident()
        if isinstance(helpers, set):
            helpers.add(me)
        failed = True
        try:
            result = wrapped(*args, **kwargs)
            failed = False
            return result
        finally:
            if isinstance(helpers, set):
                helpers.discard(me)
            times = vars(instance).get(_ITEM_TIMES)
            if isinstance(times, ItemTimes):
                times.append((time.perf_counter_ns() - started, str(args[0] if args else kwargs.get("key")), failed))

    return wrapper


def read_file(hooks: Hooks) -> Wrapper:
    """``CheckpointReader._load_full_file(file_path, ...)``: the file, for the builder to count."""
    on_gathered = hooks.recorder.on_gathered

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        path = args[0] if args else kwargs.get("file_path")
        if isinstance(path, (str, os.PathLike)):
            on_gathered(CheckpointFile(os.path.abspath(path), written=False))  # (sized later, wherever the cwd is)
        return result

    return wrapper
