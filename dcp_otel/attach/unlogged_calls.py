"""DCP functions torch does not log, made DCP calls: the state-dict API and safetensors consolidation.

torch logs a DCP function's start, end and exception through
``_dcp_method_logger``; for the functions below it does not, so dcp-otel gives
them the same records itself, fed to its recorder (and not to torch's logger:
its output stays as it was). They then become spans, steps and metrics exactly
like DCP's own calls.

**The state-dict API.** ``torch.distributed.checkpoint.state_dict`` converts sharded models and
optimizers (FSDP, DTensor) to and from the dicts DCP saves and loads, and is
often the slowest part of a checkpoint, but torch does not log it through
``_dcp_method_logger``:

* each public function (``get_model_state_dict``, ``get_optimizer_state_dict``,
  ``get_state_dict``, ``set_model_state_dict``, ``set_optimizer_state_dict``,
  ``set_state_dict``) is a call ``dcp.<function>``, from entering to leaving
  the ``_gc_context`` each of them runs in (all of the function);
* inside it, torch's workers ``_get_model_state_dict``, ``_get_optim_state_dict``,
  ``_load_model_state_dict`` and ``_load_optim_state_dict`` are calls of their
  own, so ``get_state_dict`` shows its model and optimizer halves.

torch's module-level helpers are wrapped rather than the public functions
because a training script usually imports those by name before it
instruments (``from torch.distributed.checkpoint.state_dict import
get_state_dict``), and its copy would never see a wrapper; the public
functions look the helpers up in their module on every call. Which public
function entered ``_gc_context`` is read from the calling frame.

Called inside a save or a load (a ``Stateful``'s ``state_dict()``, as
torchtitan does), a call is a step of that checkpoint's trace, on the step
histogram. Called on its own, it is an operation of its own: one trace across
the ranks making the same call, with the operation metrics under its name,
linked to the span current when it was called.

**Consolidating safetensors.** ``HuggingFaceStorageWriter`` saves each rank's
shards, then (``enable_consolidation=True``) merges them into the files Hugging
Face loads, in ``finish``; users also call ``consolidate_safetensors_files``
(or ``..._on_every_rank``) themselves. Each call is ``dcp.<function>``, a step
of the save's ``finish_checkpoint`` or an operation of its own, with the bytes
of the files it wrote (``dcp.written_bytes``, summed by the builder from the
output folder, off the caller's thread). Those bytes stay off the written-bytes
counter: that counts what DCP's ``write_data`` wrote, and a consolidation
rewrites the same tensors.

Usage (what :func:`dcp_otel.attach.patches.install` does)::

    wrapt.wrap_function_wrapper(state_dict_module, "_gc_context", public_call(tap.feed))
    wrapt.wrap_function_wrapper(state_dict_module, "_get_model_state_dict",
                                logged_call(tap.feed, "_get_model_state_dict"))
    wrapt.wrap_function_wrapper(hf_storage, "consolidate_safetensors_files",
                                logged_call(tap.feed, "consolidate_safetensors_files", consolidated(recorder.on_gathered)))
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from random import getrandbits as _getrandbits
from types import FrameType
from typing import Any, Final

from dcp_otel._selftelemetry import report
from dcp_otel.events import STATE_DICT_FUNCTIONS
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.tracing.cut_short import passes_records_along
from dcp_otel.tracing.light import get_current as light_get_current
from dcp_otel.tracing.operations import OPERATION_KEY

MODULE: Final = "torch.distributed.checkpoint.state_dict"
#: The context manager every public function runs in.
PUBLIC_CONTEXT: Final = "_gc_context"
PUBLIC: Final = STATE_DICT_FUNCTIONS
#: torch's workers, each a DCP call under its own name.
WORKERS: Final = ("_get_model_state_dict", "_get_optim_state_dict", "_load_model_state_dict", "_load_optim_state_dict")
#: Consolidation: where its functions live (hf_storage imports one of them by name), and their names.
CONSOLIDATE_MODULE: Final = "torch.distributed.checkpoint._consolidate_hf_safetensors"
HF_STORAGE_MODULE: Final = "torch.distributed.checkpoint.hf_storage"
CONSOLIDATE: Final = ("consolidate_safetensors_files", "consolidate_safetensors_files_on_every_rank")
#: The output files a consolidation writes.
SAFETENSORS_SUFFIX: Final = ".safetensors"
#: How far up from our wrapper the public function's frame may be (wrapt's pure-Python fallback adds one).
_MAX_FRAMES = 4

Feed = Callable[[dict[str, Any]], None]


def _base_record(func_name: str, with_ranks: bool, checkpoint_id: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """What torch's ``_dcp_method_logger`` puts in every record of a call: its name, its checkpoint id
    (``None`` for most), a call id unique in this process and, ``with_ranks``, the process group's ranks
    (when distributed).

    Only a call that may start an operation needs the ranks (they place it in the job); a
    worker always runs inside its public function, so it skips their lookups. The call id is
    a random 64-bit number rather than torch's ``uuid4``, which reads the OS's entropy on
    every call.
    """
    record: dict[str, Any] = {"checkpoint_id": None if checkpoint_id is None else os.fspath(checkpoint_id),
                              "uuid": str(_getrandbits(64))}  # fmt: skip
    if with_ranks:
        from torch.distributed.c10d_logger import _get_msg_dict

        record.update(_get_msg_dict(func_name))
    else:
        record["func_name"] = func_name
    return record


def _start(
    feed: Feed, func_name: str, with_ranks: bool = False, checkpoint_id: str | os.PathLike[str] | None = None
) -> dict[str, Any] | None:
    """Feed a call's start record; the record to end it with (``None``, counted, if that failed)."""
    record: dict[str, Any] | None = None
    try:
        try:
            record = _base_record(func_name, with_ranks, checkpoint_id)
            feed({**record, "event": "start", "time": time.time_ns(), "log_exceptions": True})
            return record
        except BaseException:  # the call will not be recorded (or not run): a start fed already is undone
            if record is not None:
                _cut_short(feed, record, None, "start")
            raise
    except Exception as exc:  # noqa: BLE001 - telemetry never breaks the call
        reraise_if_signalled(exc)
        report("recorder_error", "dcp_otel failed to record a state-dict call", exc_info=True)
        return None


def _end(feed: Feed, record: dict[str, Any], error: BaseException | None) -> None:
    """Feed a call's end, or its exception (call it while that exception is being handled).

    A signal handler's exception may come out of it before the end reached the recorder (at its very
    start, or as it reads the clock): its callers call it inside a ``try`` of their own, and then
    :func:`_cut_short`, which ends the call all the same.
    """
    try:
        if error is None:
            feed({**record, "event": "end", "time": time.time_ns()})
        else:
            feed({**record, "event": "exception", "error": f"{error}", "time": time.time_ns()})
    except Exception as exc:  # noqa: BLE001
        reraise_if_signalled(exc)
        report("recorder_error", "dcp_otel failed to record a state-dict call", exc_info=True)


def _cut_short(feed: Feed, record: dict[str, Any], error: BaseException | None, event: str = "") -> None:
    """An exception came out of :func:`_end`, maybe before the end reached the recorder (out of its first
    instruction, or as it read the clock): the call ended all the same; or (``event="start"``) out of
    :func:`_start` once the start was fed: the call will not run (see :mod:`dcp_otel.tracing.cut_short`).

    Callers of ``_end`` call it inside a ``try`` of their own, then this: a handler's exception can come out of
    a function's very first instruction, before any ``try`` of that function's.
    """
    cut_short = getattr(getattr(feed, "__self__", None), "cut_short", None)  # the tap's
    if cut_short is not None:
        cut_short({**record, "event": event or ("end" if error is None else "exception")})


def _public_caller() -> str | None:
    """The public state-dict function that is entering ``_gc_context``, if one is."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name in PUBLIC and frame.f_globals.get("__name__") == MODULE:
            return code.co_name
        frame = frame.f_back
    return None


class _LoggedContext:
    """torch's ``_gc_context`` manager, its span around it."""

    def __init__(self, inner: Any, feed: Feed, func_name: str) -> None:
        self._inner, self._feed, self._func_name = inner, feed, func_name
        self._record: dict[str, Any] | None = None

    def __enter__(self) -> Any:
        record = self._record = _start(self._feed, self._func_name, with_ranks=True)
        try:
            return self._inner.__enter__()
        except BaseException as error:  # __exit__ is not called for a failed __enter__: the call ends here
            if record is not None:
                try:
                    _end(self._feed, record, error)
                except BaseException:
                    _cut_short(self._feed, record, error)
                    raise
            raise

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> Any:
        try:
            return self._inner.__exit__(kind, error, tb)
        finally:
            if self._record is not None:
                try:
                    _end(self._feed, self._record, error)
                except BaseException:
                    _cut_short(self._feed, self._record, error)
                    raise


def public_call(feed: Feed) -> Callable[..., Any]:
    """A ``wrapt`` wrapper of ``_gc_context``: the public function entering it becomes a DCP call."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inner = wrapped(*args, **kwargs)
        try:
            func_name = _public_caller()
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            func_name = None
        return inner if func_name is None else _LoggedContext(inner, feed, func_name)

    return wrapper


#: Called after the wrapped call returned, before its end record: ``after(instance, args, kwargs)``.
After = Callable[[Any, tuple[Any, ...], dict[str, Any]], None]
#: The checkpoint id (a path) a call was given: ``checkpoint_id(args, kwargs)``.
CheckpointIdOf = Callable[[tuple[Any, ...], dict[str, Any]], object]


def logged_call(
    feed: Feed, func_name: str, after: After | None = None, *, starts_operations: bool = True,
    checkpoint_id: CheckpointIdOf | None = None,
) -> Callable[..., Any]:  # fmt: skip
    """A ``wrapt`` wrapper feeding ``func_name``'s start, end or exception records to ``feed``.

    ``starts_operations=False`` for a function only ever called inside another
    DCP call (its records then skip the ranks; so do those of any call made inside an operation). ``checkpoint_id`` reads the
    checkpoint id from the call's arguments, as torch logs one: every rank
    saving the same checkpoint then derives the same trace. ``after`` runs once
    the call returned, while it is still the innermost open call (to tell the
    recorder what it produced). Whatever the telemetry does, the wrapped call
    runs exactly once, with its own result or exception.
    """

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            ckpt = checkpoint_id(args, kwargs) if checkpoint_id is not None else None
        except Exception as exc:  # noqa: BLE001 - arguments torch will reject itself
            reraise_if_signalled(exc)
            ckpt = None
        # Only a call that starts an operation needs the ranks (a step inside one skips torch's lookups of them).
        with_ranks = starts_operations and light_get_current().get(OPERATION_KEY) is None
        record = _start(feed, func_name, with_ranks, ckpt if isinstance(ckpt, (str, os.PathLike)) else None)
        if record is None:
            return wrapped(*args, **kwargs)
        try:
            result = wrapped(*args, **kwargs)
            if after is not None:
                try:
                    after(instance, args, kwargs)
                except Exception as exc:  # noqa: BLE001
                    reraise_if_signalled(exc)  # (then it is the call's outcome, as the caller sees it)
                    report("recorder_error", "dcp_otel failed to record what %s produced", func_name, exc_info=True)
        except BaseException as error:
            try:
                _end(feed, record, error)  # inside the except block, as torch logs it
            except BaseException:
                _cut_short(feed, record, error)
                raise
            raise
        try:
            _end(feed, record, None)
        except BaseException:
            _cut_short(feed, record, None)
            raise
        return result

    return wrapper


class ConsolidatedOutput:
    """The safetensors files a consolidation wrote into ``folder``; the builder sums their sizes."""

    __slots__ = ("folder",)

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def size_in_bytes(self) -> int:
        """The bytes of the ``*.safetensors`` files in the folder now (0 for a folder that is gone)."""
        try:
            with os.scandir(self.folder) as entries:
                return sum(e.stat().st_size for e in entries if e.name.endswith(SAFETENSORS_SUFFIX) and e.is_file())
        except OSError:
            return 0


class CheckpointFile:
    """A rank's checkpoint files, written or read whole by a call; the builder counts their size.

    ``torch.distributed.checkpoint._experimental`` writes each rank's state dict
    to one file (``checkpoint_<rank>.pt``) and reads it back whole;
    ``torch_checkpointing`` writes one file per item into a temporary folder that
    its rank 0 renames onto the checkpoint's path (``moved``: that folder and
    where it went), maybe before the builder gets to them.
    """

    __slots__ = ("path", "written", "moved")

    def __init__(self, path: str | Callable[[], tuple[str, ...]], written: bool,
                 moved: Callable[[], tuple[str, str] | None] | None = None) -> None:  # fmt: skip
        """``path``: one file, or what lists them (called by the builder, off the caller's thread); ``moved``:
        what says where their folder went."""
        self.path, self.written, self.moved = path, written, moved

    def size_in_bytes(self) -> int:
        """The files' size now (0 for a file that is gone, here and where it was moved to)."""
        moved = self.moved() if self.moved is not None else None
        return sum(self._size(path, moved) for path in ((self.path,) if isinstance(self.path, str) else self.path()))

    @staticmethod
    def _size(path: str, moved: tuple[str, str] | None) -> int:
        try:
            return os.stat(path).st_size
        except OSError:
            pass
        if moved is not None and path.startswith(moved[0]):
            try:
                return os.stat(moved[1] + path[len(moved[0]):]).st_size
            except OSError:
                pass
        return 0


def consolidated(on_gathered: Callable[[object], None]) -> After:
    """What a consolidation call produced: its output folder (``output_dir``), for the builder to size."""

    def after(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        folder = kwargs.get("output_dir", args[1] if len(args) > 1 else None)
        if isinstance(folder, (str, os.PathLike)):
            on_gathered(ConsolidatedOutput(os.fspath(folder)))

    return after


passes_records_along(_start, _LoggedContext.__enter__)  # (its wrapper is the frame that runs a call)
