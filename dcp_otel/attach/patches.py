"""Where dcp-otel touches torch, and how it degrades when torch differs.

Everything we attach to lives in torch's private DCP modules, which change
between releases. Each attachment point is declared once in :data:`PATCHES`
(plus the DCP logger itself, replaced by a
:class:`~dcp_otel.attach.logger_tap.DCPLoggerTap`); :func:`install` attaches whatever exists and
emits ONE warning naming whatever does not, with what is lost. It never
raises for a torch it does not recognize. :meth:`Installed.remove` undoes
everything, restoring the original objects.

Every point below was checked against torch 2.11.0, 2.13.0, 2.14.1 and 2.15.0: the
test command runs the core suites on 2.11.0, 2.13.0 and 2.15.0, and ``test_instrumentor.py`` fails if
``install`` finds anything missing or ``uninstrument`` leaves anything behind.

Usage::

    installed = install(recorder)
    ...
    installed.remove()
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dcp_otel.attach import checkpointer, torch_checkpointing, unlogged_calls
from dcp_otel.attach.async_process import (
    DAEMON_CLASS,
    DAEMON_ENTRY,
    PROCESS_MODULE,
    ProcessBridge,
    replace_daemon_entry,
)
from dcp_otel.attach.async_thread import AsyncContextCarrier
from dcp_otel.attach.call_arguments import CallArguments
from dcp_otel.attach.collective_points import collective_scope_wrapper, collective_wrapper, object_bytes_wrapper
from dcp_otel.attach.logger_tap import DCPLoggerTap
from dcp_otel.attach.unlogged_calls import consolidated, logged_call, public_call
from dcp_otel.attach.wrapping import attribute, wrap
from dcp_otel.config import InstrumentOptions
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.metrics.prometheus import MetricsSink
from dcp_otel.tracing import training_step
from dcp_otel.tracing.tracker import SpanRecorder

logger = logging.getLogger("dcp_otel")

LOGGER_MODULE = "torch.distributed.checkpoint.logger"
LOGGER_ATTR = "_dcp_logger"


@dataclass(frozen=True)
class Patch:
    """One torch callable we wrap, and what is lost without it.

    ``wrapper`` makes a wrapper in ``wrapt``'s signature, ``wrapper(wrapped, instance, args, kwargs)``.
    ``hot``: called for every collective of every save on the training thread. ``wrapper`` then makes a
    *replacer* instead: given the original function, the function that takes its place, called exactly
    as the original is (a method's with ``self`` first) and calling it directly (:func:`~dcp_otel.attach.wrapping.replace_plainly`).
    One frame per call: ``wrapt``'s bound wrapper, made at every call of a method, cost about 44,000
    instructions per save, and a plain function calling a wrapper in wrapt's signature (a bound method
    made per call, the arguments packed twice) some 25,000 more (counted by callgrind, as
    ``benchmarks/instructions.py`` counts).
    """

    module: str
    name: str  # "function" or "Class.method"
    lost: str
    wrapper: Callable[[Hooks], Callable[..., Any]]
    hot: bool = False
    #: A package that may well be absent (``torch_checkpointing``; the ``_experimental`` checkpointer, gone from
    #: torch after 2.15): without it, its points are skipped without a word.
    group: str = ""


@dataclass(frozen=True)
class Hooks:
    """The objects the wrappers report to."""

    recorder: SpanRecorder
    carrier: AsyncContextCarrier
    bridge: ProcessBridge
    #: Hands a DCP record to the recorder as the tap does (without logging it); a no-op without a tap.
    feed: Callable[[dict[str, Any]], None]


def _wrap_exception_wrapper(hooks: Hooks) -> Callable[..., Any]:
    recorder = hooks.recorder

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            recorder.on_wrapped_exception(args[0])
        return wrapped(*args, **kwargs)

    return wrapper


def _stager_wrapper(hooks: Hooks) -> Callable[..., Any]:
    recorder = hooks.recorder

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        recorder.on_staging(instance, args[0] if args else kwargs.get("state_dict"))
        return wrapped(*args, **kwargs)

    return wrapper


def _storage_setup_wrapper(hooks: Hooks) -> Callable[..., Any]:
    recorder = hooks.recorder

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        storage = wrapped(*args, **kwargs)
        reader = kwargs.get("reader", args[2] if len(args) > 2 else False)
        recorder.on_storage_resolved(storage, bool(reader))
        return storage

    return wrapper


def _state_dict_wrapper(call: str) -> Callable[[Hooks], Callable[..., Any]]:
    # torch's workers run inside the public function that _gc_context makes a call of.
    return lambda hooks: logged_call(hooks.feed, call, starts_operations=False)


def _consolidation_wrapper(call: str) -> Callable[[Hooks], Callable[..., Any]]:
    return lambda hooks: logged_call(hooks.feed, call, consolidated(hooks.recorder.on_gathered))


_DCP_UTILS = "torch.distributed.checkpoint.utils"
_C10D = "torch.distributed.distributed_c10d"
_NO_STORAGE_CLASS = "no storage class on spans when DCP infers it from checkpoint_id"
_NO_STAGING_FACTS = "no staged bytes, device or rate on the staging spans"
_NO_PROCESS_TRACE = "the save in the async save process is not part of the checkpoint's trace"
_NO_DAEMON = "the async save process is not traced"
_NO_DAEMON_METRICS = "no metrics from the async save process"

PATCHES: tuple[Patch, ...] = (
    # save and load each import _storage_setup into their own namespace.
    Patch("torch.distributed.checkpoint.state_dict_saver", "_storage_setup", _NO_STORAGE_CLASS, _storage_setup_wrapper),
    Patch("torch.distributed.checkpoint.state_dict_loader", "_storage_setup", _NO_STORAGE_CLASS, _storage_setup_wrapper),
    # What an async save stages (bytes, devices, pinned/shared): DefaultStager, and BlockingAsyncStager (whose
    # stage FileSystemWriter inherits).
    *(Patch("torch.distributed.checkpoint.staging", f"{stager}.stage", _NO_STAGING_FACTS, _stager_wrapper)
      for stager in ("DefaultStager", "BlockingAsyncStager")),  # fmt: skip
    Patch(
        "torch.distributed.checkpoint.utils",
        "_DistWrapper.gather_object",
        "no written/read byte counts, no dcp.collective.gather_object span",
        collective_wrapper("gather_object"),
        hot=True,
    ),
    # DCP's other object collectives, and the methods whose step names them ("plan", "write", "read").
    *(Patch(_DCP_UTILS, f"_DistWrapper.{method}", f"no dcp.collective.{method} span", collective_wrapper(method),
            hot=True)
      for method in ("scatter_object", "broadcast_object", "all_gather_object", "barrier")),  # fmt: skip
    *(Patch(_DCP_UTILS, f"_DistWrapper.{pattern}", "dcp.collective.* spans without dcp.collective.step",
            collective_scope_wrapper(pattern), hot=True)
      for pattern in ("reduce_scatter", "all_reduce", "all_gather", "broadcast")),  # fmt: skip
    # Where torch.distributed pickles and unpickles the objects of a collective (module-level functions
    # its collectives call by name): the bytes a collective moved.
    Patch(_C10D, "_object_to_tensor", "no dcp.collective.sent_bytes", object_bytes_wrapper(sent=True), hot=True),
    Patch(_C10D, "_tensor_to_object", "no dcp.collective.received_bytes", object_bytes_wrapper(sent=False),
          hot=True),
    Patch(
        "torch.distributed.checkpoint.utils",
        "_wrap_exception",
        "failed steps end when their parent ends, without the exception object",
        _wrap_exception_wrapper,
    ),
    Patch(
        "torch.distributed.checkpoint._async_thread_executor",
        "_ThreadBasedAsyncCheckpointExecutor.execute_save",
        "no dcp.async_upload span; the background save of async_save starts its own trace",
        lambda hooks: hooks.carrier.execute_save,
    ),
    Patch(
        "torch.distributed.checkpoint._async_thread_executor",
        "save_wrapper",
        "the background save of async_save starts its own trace",
        lambda hooks: hooks.carrier.save_wrapper,
    ),
    # async_save in a daemon process (AsyncCheckpointerType.PROCESS): the same
    # hand-over to the executor thread, then across the process boundary.
    Patch(
        PROCESS_MODULE,
        "_ProcessBasedAsyncCheckpointExecutor.execute_save",
        _NO_PROCESS_TRACE,
        lambda hooks: hooks.carrier.execute_save,
    ),
    Patch(
        PROCESS_MODULE,
        "_ProcessBasedAsyncCheckpointExecutor._execute_save_impl",
        _NO_PROCESS_TRACE,
        lambda hooks: hooks.carrier.save_wrapper,
    ),
    Patch(PROCESS_MODULE, "_ProcessGroupInitInfo.__init__", _NO_DAEMON, lambda hooks: hooks.bridge.init_info),
    Patch(PROCESS_MODULE, "_AsyncCheckpointProcess.__init__", _NO_DAEMON_METRICS,
          lambda hooks: hooks.bridge.daemon_started),  # fmt: skip
    Patch(PROCESS_MODULE, "_AsyncCheckpointProcess._send", _NO_PROCESS_TRACE, lambda hooks: hooks.bridge.send),
    Patch(PROCESS_MODULE, "_AsyncCheckpointProcess.save", _NO_DAEMON_METRICS, lambda hooks: hooks.bridge.save),
    # The state-dict API (get_state_dict, set_state_dict, ...), which torch does not log.
    Patch(unlogged_calls.MODULE, unlogged_calls.PUBLIC_CONTEXT, "no dcp.get_state_dict, dcp.set_state_dict, ... spans",
          lambda hooks: public_call(hooks.feed)),  # fmt: skip
    *(Patch(unlogged_calls.MODULE, worker, f"no dcp.{worker} span", _state_dict_wrapper(worker))
      for worker in unlogged_calls.WORKERS),  # fmt: skip
    # Safetensors consolidation (HuggingFaceStorageWriter, or called directly).
    # hf_storage imports the first function into its own namespace: both places are wrapped.
    *(Patch(module, name, f"no dcp.{name} span", _consolidation_wrapper(name))
      for module, name in ((unlogged_calls.HF_STORAGE_MODULE, unlogged_calls.CONSOLIDATE[0]),
                           (unlogged_calls.CONSOLIDATE_MODULE, unlogged_calls.CONSOLIDATE[0]),
                           (unlogged_calls.CONSOLIDATE_MODULE, unlogged_calls.CONSOLIDATE[1]))),  # fmt: skip
    # torch's _experimental checkpointer (SyncCheckpointer, AsyncCheckpointer and its checkpoint process).
    *(Patch(module, name, lost, wrapper, group=checkpointer.MODULE) for module, name, lost, wrapper in checkpointer.POINTS),
    # torch_checkpointing, where that checkpointer went (an optional package).
    *(Patch(module, name, lost, wrapper, hot, group=torch_checkpointing.PACKAGE)
      for module, name, lost, wrapper, hot in torch_checkpointing.POINTS),
)  # fmt: skip


@dataclass
class Installed:
    """What :func:`install` attached; :meth:`remove` detaches all of it."""

    tap: DCPLoggerTap | None = None
    logger_module: Any = None  # torch's module whose ``_dcp_logger`` the tap replaced
    carrier: AsyncContextCarrier | None = None
    bridge: ProcessBridge | None = None
    wrapped: list[tuple[Any, str, Any, Any]] = field(default_factory=list)  # (owner, attribute, original, ours)
    #: On while installed: the non-hot wrappers pass calls through once it is off (see :meth:`remove`).
    switch: list[bool] = field(default_factory=lambda: [True])
    left_in_place: list[str] = field(default_factory=list)
    restore_entries: list[Callable[[], None]] = field(default_factory=list)  # of spawned processes
    missing: list[str] = field(default_factory=list)
    #: What of torch_checkpointing (installed) was not attached: said in its own line.
    library_missing: list[str] = field(default_factory=list)

    def remove(self) -> None:
        """Detach: put back each original where our replacement is still in place.

        Where another tool has put its own wrapper over ours since, theirs stays (removing it would undo
        their work): ours, under it, only passes calls through from now on (a non-hot wrapper is switched
        off; a hot one finds no DCP operation open, as the recorder gets no records any more).
        """
        self.switch[0] = False
        for owner, attr, original, placed in reversed(self.wrapped):
            if attribute(owner, attr) is placed:
                # The exact object we replaced: unwrapping a staticmethod would leave its bare
                # function behind, which the class would then bind as a method.
                setattr(owner, attr, original)
            else:
                self.left_in_place.append(f"{getattr(owner, '__name__', owner)}.{attr}")
        self.wrapped.clear()
        for restore in reversed(self.restore_entries):
            restore()
        self.restore_entries.clear()
        if self.bridge is not None:
            self.bridge.close()
        if self.tap is not None:
            original, current = self.tap.logger, getattr(self.logger_module, LOGGER_ATTR, None)
            if current is self.tap:  # only ours: not what someone set since
                setattr(self.logger_module, LOGGER_ATTR, original)
            else:  # under someone else's stand-in: passes records on to torch's logger, feeds nothing
                self.tap.go_inert()
                self.left_in_place.append(f"{LOGGER_MODULE}.{LOGGER_ATTR}")
        if self.left_in_place:
            logger.info("dcp_otel: uninstrumented; left in place under another tool's wrapper (passing calls "
                        "through): %s", ", ".join(self.left_in_place))  # fmt: skip
        self.tap = self.logger_module = None


def _no_feed(record: dict[str, Any]) -> None:
    pass


def find_dcp_logger() -> tuple[Any, logging.Logger] | None:
    """torch's DCP logger module and the logger its ``_dcp_method_logger`` calls, if this torch has them."""
    try:
        module = importlib.import_module(LOGGER_MODULE)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not this torch"
        reraise_if_signalled(exc)
        return None
    candidate = getattr(module, LOGGER_ATTR, None)
    if isinstance(candidate, DCPLoggerTap):  # another recorder's tap (never two instrumentations at once)
        candidate = candidate.logger
    return (module, candidate) if isinstance(candidate, logging.Logger) else None


def resolve(patch: Patch) -> tuple[Any, str] | None:
    """The (owner, attribute) to wrap, or ``None`` if this torch lacks it."""
    try:
        owner: Any = importlib.import_module(patch.module)
    except Exception as exc:  # noqa: BLE001
        reraise_if_signalled(exc)
        return None
    *path, attr = patch.name.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    # On a class, only a method it defines itself: an inherited (say abstract) one is not the path we wrap.
    found = attribute(owner, attr)
    return (owner, attr) if callable(found) else None


def install(
    recorder: SpanRecorder, options: InstrumentOptions | None = None, metrics: MetricsSink | None = None
) -> Installed:
    """Attach to torch; warn once about anything this torch does not have.

    ``metrics`` receive what the async save process observed (``None``: dropped).
    """
    carrier = AsyncContextCarrier(recorder)
    bridge = ProcessBridge(recorder, options or InstrumentOptions(), metrics)
    installed = Installed(carrier=carrier, bridge=bridge)
    found = find_dcp_logger()
    if found is None:
        installed.missing.append(f"{LOGGER_MODULE}.{LOGGER_ATTR} (no spans at all)")
    else:
        module, dcp_logger = found
        installed.tap, installed.logger_module = DCPLoggerTap(dcp_logger, recorder), module
        setattr(module, LOGGER_ATTR, installed.tap)
        recorder.call_arguments = CallArguments.of(module)
        if recorder.call_arguments is None:
            installed.missing.append(f"{LOGGER_MODULE}._dcp_method_logger's arguments (no_dist saves are counted "
                                     "with the group's checkpoints)")  # fmt: skip
    hooks = Hooks(recorder, carrier, bridge, installed.tap.feed if installed.tap is not None else _no_feed)
    present = {group: torch_checkpointing.importable(group) for group in {patch.group for patch in PATCHES if patch.group}}
    library_missing = installed.library_missing
    for patch in PATCHES:
        if patch.group and not present[patch.group]:
            continue
        target = resolve(patch)
        if target is None:
            missing = library_missing if patch.group == torch_checkpointing.PACKAGE else installed.missing
            missing.append(f"{patch.module}.{patch.name} ({patch.lost})")
            continue
        owner, attr = target
        original = attribute(owner, attr)
        placed = wrap(owner, attr, patch.wrapper(hooks), patch.hot, installed.switch)
        installed.wrapped.append((owner, attr, original, placed))
    entries = (
        (replace_daemon_entry, f"{PROCESS_MODULE}.{DAEMON_CLASS}.{DAEMON_ENTRY} ({_NO_DAEMON})", installed.missing),
        *(((checkpointer.replace_process_entry, f"{checkpointer.PROCESS_MODULE}.{checkpointer.PROCESS_CLASS}."
            f"{checkpointer.PROCESS_ENTRY} (the checkpoint process is not traced)", installed.missing),)
          if present[checkpointer.MODULE] else ()),
        *(((torch_checkpointing.replace_process_entry, f"{torch_checkpointing.PROCESS_MODULE}."
            f"{torch_checkpointing.PROCESS_CLASS}.{torch_checkpointing.PROCESS_ENTRY} (the writer process is not "
            "traced)", library_missing),)
          if present[torch_checkpointing.PACKAGE] else ()),
    )  # fmt: skip
    for replace, missing, lost in entries:
        restore = replace()
        if restore is None:
            lost.append(missing)
        else:
            installed.restore_entries.append(restore)
    if present[torch_checkpointing.PACKAGE]:
        step_of = torch_checkpointing.logging_step()
        if step_of is None:
            installed.library_missing.append(f"{torch_checkpointing.LOGGING_MODULE}.checkpoint_logging_context "
                                             "(the training step from its path only)")  # fmt: skip
        else:
            training_step.library_steps[:] = [step_of]
            installed.restore_entries.append(training_step.library_steps.clear)
        torch_checkpointing.say_instrumented(library_missing)
    if installed.missing:
        logger.warning(
            "dcp_otel: this torch's DCP internals differ from what dcp_otel expects; instrumenting "
            "what exists. Missing: %s",
            "; ".join(installed.missing),
        )
    return installed
