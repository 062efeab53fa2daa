"""``torch_checkpointing``, where torch's checkpointer went: its saves and loads traced like DCP's (the rank's side).

torch removed ``torch.distributed.checkpoint._experimental`` after 2.15; its
checkpointer lives on as the ``torch_checkpointing`` package
(``CheckpointManager``), with the same design: a stager copying the state on a
``ckpt-staging`` thread, a writer in a process of its own, a barrier, a reader.
It logs through Python logging only. dcp-otel records its calls itself
(:func:`~dcp_otel.attach.unlogged_calls.logged_call`), as it does the
``_experimental`` checkpointer's (:mod:`dcp_otel.attach.checkpointer`, whose
wrappers are reused), so they become the same trace model, metrics, stalls and
report as ``dcp.save``:

* **operations**: ``SyncCheckpointSaver.save`` is ``dcp.checkpointing_save``,
  ``AsyncCheckpointSaver.save`` ``dcp.checkpointing_async_save`` and
  ``CheckpointLoader.load`` ``dcp.checkpointing_load`` (what
  ``CheckpointManager.save`` / ``load`` call); the checkpoint id is the path,
  so every rank saving it derives the same trace, with no collective;
* **steps**: the wait for the previous checkpoint's write
  (``dcp.wait_previous_checkpoint``), ``DefaultMetadataManager.compute_metadata``
  (``dcp.compute_metadata``), ``DefaultStager._stage`` (``dcp.stage_checkpoint``:
  the copy itself, on the staging thread when staging is asynchronous, with
  its bytes, devices, pinned/shared memory and rate), ``CheckpointProcess.write``
  (``dcp.hand_off_checkpoint``), then in the writer process (or the caller, for
  a sync save) ``CheckpointWriter.write`` (``dcp.write_checkpoint``), inside it
  ``_write_keys`` (``dcp.write_items``: every item's file; their count, the
  slowest items and the one that failed; their bytes go on ``dcp.write_checkpoint``), ``_write_metadata`` (``dcp.write_metadata``),
  the barrier (``dcp.barrier``) and, on role rank 0, the rename of the
  temporary folder onto the checkpoint's path (``dcp.finalize_checkpoint``:
  the moment the checkpoint became durable); ``CheckpointReader.read``
  (``dcp.read_checkpoint``, with the bytes of the files it read);
* **the async write**: ``dcp.async_upload`` (and ``dcp.async_staging``) end
  with the write future (the staged-info future); the write request carries the
  operation to the writer process (:mod:`dcp_otel.processes.writer_process`),
  whose spans join the trace and whose metrics are relayed to the rank;
* **its own events**: every ``EventLogger`` record (what its loggers are given as
  ``extra=``, whatever the logging configuration) is read as it is made: each
  latency it measured goes on the span open on that thread as
  ``torch_checkpointing.<write|read|metadata>.<phase>_ms``; the training step of
  its logging context (``checkpoint_logging_context.update(step=...)``) becomes
  the operation's ``dcp.training.step``. Per-item latencies are left to
  ``dcp.write_items``; an event type or field that 0.1.1 did not have is counted
  (``dcp_otel_errors_total{reason="library_schema"}``) and ignored.

Usage (what :mod:`dcp_otel.attach.patches` installs, when ``torch_checkpointing`` is installed)::

    wrapt.wrap_function_wrapper(saver_module, "AsyncCheckpointSaver.save", async_save(hooks))
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Final

from dcp_otel import semconv
from dcp_otel._selftelemetry import report
from dcp_otel.attach import checkpointer, releases
from dcp_otel.attach.checkpointing_files import WRITE_ITEMS, read_file, write, write_item, write_items
from dcp_otel.attach.unlogged_calls import After, logged_call
from dcp_otel.attach.wrapping import Replacer
from dcp_otel.live.signal_exceptions import reraise_if_signalled
from dcp_otel.tracing.light import get_current as light_get_current
from dcp_otel.tracing.operations import OPERATION_KEY

if TYPE_CHECKING:
    from dcp_otel.attach.patches import Hooks

PACKAGE: Final = "torch_checkpointing"
SAVER_MODULE: Final = PACKAGE + ".checkpoint_saver"
LOADER_MODULE: Final = PACKAGE + ".checkpoint_loader"
METADATA_MODULE: Final = PACKAGE + ".metadata_manager"
STAGING_MODULE: Final = PACKAGE + ".staging"
WRITER_MODULE: Final = PACKAGE + ".checkpoint_writer"
READER_MODULE: Final = PACKAGE + ".checkpoint_reader"
BARRIERS_MODULE: Final = PACKAGE + ".barriers"
STORAGE_MODULE: Final = PACKAGE + ".storage.filesystem"
LOGGING_MODULE: Final = PACKAGE + ".logging_utils"
LOCK_MODULE: Final = PACKAGE + ".lock"
PROCESS_MODULE: Final = PACKAGE + ".checkpoint_process"
PROCESS_CLASS: Final = "CheckpointProcess"
PROCESS_ENTRY: Final = "_subprocess"
#: The span attribute prefix of its own latencies.
LATENCY_PREFIX: Final = PACKAGE + "."
#: What an ``EventLogger`` record holds in 0.1.1; anything else is counted, then ignored.
KNOWN_FIELDS: Final = frozenset({"metric_name", "log_type_name", "log_type", "event_name", "step", "end_to_end",
                                 "total_time_ms", "last_interval_ms", "value", "context"})  # fmt: skip
KNOWN_EVENTS: Final = frozenset({
    "checkpoint_start", "checkpoint_end", "checkpoint_subprocess_barrier_start", "checkpoint_subprocess_barrier_end",
    "checkpoint_barrier_start", "checkpoint_barrier_end", "checkpoint_load_barrier_start",
    "checkpoint_load_barrier_end", "checkpoint_thread_start", "checkpoint_thread_end", "checkpoint_staging_start",
    "checkpoint_staging_end", "checkpoint_write_start", "checkpoint_write_end", "checkpoint_subprocess_init_start",
    "checkpoint_subprocess_init_end", "checkpoint_wait_for_request", "checkpoint_saved_tmp", "checkpoint_saved",
    "checkpoint_error", "log_metric", "generic",
    *(f"checkpoint_persistent_save_{what}_{edge}" for what in ("model", "optim", "data_loader", "all", "other")
      for edge in ("start", "end")),
})  # fmt: skip
_LATENCY_SUFFIX = ".latency_ms"

Wrapper = Callable[..., Any]
logger = logging.getLogger("dcp_otel")


def installed_version() -> str | None:
    """The installed ``torch_checkpointing``'s version (``None``: not installed, or not importable)."""
    try:
        return str(importlib.import_module(PACKAGE).__version__)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not installed here"
        reraise_if_signalled(exc)
        return None


def importable(module: str) -> bool:
    """Whether ``module`` imports here (an optional package installed; the ``_experimental`` checkpointer in
    this torch)."""
    try:
        importlib.import_module(module)
        return True
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        reraise_if_signalled(exc)
        return False


def say_instrumented(missing: list[str]) -> None:
    """The one line about ``torch_checkpointing`` at ``instrument()``: its version, and what was not attached."""
    version = installed_version()
    if missing:
        logger.warning("dcp_otel: torch_checkpointing %s instrumented (tested: %s); not attached: %s", version,
                       "/".join(releases.CHECKPOINTING_TESTED), "; ".join(missing))  # fmt: skip
    else:
        logger.info("dcp_otel: torch_checkpointing %s instrumented (tested: %s)", version,
                    "/".join(releases.CHECKPOINTING_TESTED))  # fmt: skip


def process_class() -> Any:
    """``torch_checkpointing``'s ``CheckpointProcess`` (raises if it is not installed)."""
    return getattr(importlib.import_module(PROCESS_MODULE), PROCESS_CLASS)


def logging_step() -> Callable[[], object] | None:
    """What reads the step in ``torch_checkpointing``'s logging context (what
    ``checkpoint_logging_context.update(step=...)`` said in this context), as each of its operations starts;
    ``None`` where it has no such context (a release that moved it: the step then comes from the path)."""
    try:
        context = getattr(importlib.import_module(LOGGING_MODULE), "checkpoint_logging_context", None)
    except Exception as exc:  # noqa: BLE001 - a release without that module
        reraise_if_signalled(exc)
        return None
    get = getattr(context, "get", None)
    return (lambda: get("step")) if callable(get) else None


# --- its events ---------------------------------------------------------------------------------------
def latency_attribute(metric_name: str) -> str | None:
    """The span attribute of one of its latencies: ``train.checkpoint_write.submit.wait_for_prev.latency_ms``
    is ``torch_checkpointing.write.submit.wait_for_prev_ms``; ``None`` for a per-item one (an item's key in
    the name: the items are summarized on ``dcp.write_items``) or a name of another shape."""
    name = metric_name[: -len(_LATENCY_SUFFIX)] if metric_name.endswith(_LATENCY_SUFFIX) else metric_name
    parts = name.split(".", 2)
    if len(parts) < 3:
        return None
    phase = parts[2]
    if (phase.startswith("execute.storage.") and phase.endswith(".save_task.e2e")) or (
        phase.startswith("execute.filesystem.") and phase.endswith(".read") and phase != "execute.filesystem.metadata.read"
    ):
        return None
    kind = parts[1].removeprefix("checkpoint_")
    return f"{LATENCY_PREFIX}{kind}.{phase}_ms"


def event_logger(hooks: Hooks) -> Replacer:
    """``EventLogger.__call__`` (every event it logs, on the thread logging it): its latency onto the open span.

    A hot patch (a plain replacement, one frame): a save logs a dozen on the caller's thread. Each metric
    name's attribute is worked out once (:data:`_ATTRIBUTES`).
    """
    on_call_facts = hooks.recorder.on_call_facts
    attributes = _ATTRIBUTES

    def replacer(original: Callable[..., Any]) -> Callable[..., Any]:
        def replacement(self: Any, *args: Any, **kwargs: Any) -> Any:
            metadata = original(self, *args, **kwargs)
            try:
                if type(metadata) is dict:
                    if not metadata.keys() <= KNOWN_FIELDS or metadata.get("log_type_name") not in KNOWN_EVENTS:
                        _unknown(metadata)
                    name = metadata.get("metric_name")
                    if name is not None:
                        attribute: Any = attributes.get(name, _UNSEEN)
                        if attribute is _UNSEEN:
                            attribute = _learn(name)
                        value = metadata.get("value")
                        if attribute is not None and type(value) in _NUMBERS:
                            on_call_facts({attribute: value})
            except Exception as exc:  # noqa: BLE001 - telemetry never breaks the call
                reraise_if_signalled(exc)
                report("recorder_error", "dcp_otel failed to read a torch_checkpointing event", exc_info=True)
            return metadata

        return replacement

    return replacer


#: Metric name -> its span attribute (``None``: none), learnt as events come; bounded (names with an item's key in
#: them are not kept).
_ATTRIBUTES: dict[str, str | None] = {}
_MAX_ATTRIBUTES: Final = 256
_UNSEEN: Final = object()
_NUMBERS: Final = (int, float)


def _learn(name: object) -> str | None:
    attribute = latency_attribute(name) if isinstance(name, str) else None
    if isinstance(name, str) and len(_ATTRIBUTES) < _MAX_ATTRIBUTES:
        _ATTRIBUTES[name] = attribute
    return attribute


def _unknown(metadata: dict[str, Any]) -> None:
    report("library_schema", "dcp_otel: torch_checkpointing logged an event type or field it does not know "
           "(ignored): %s", sorted(set(metadata) - KNOWN_FIELDS) or metadata.get("log_type_name"))  # fmt: skip


# --- the async save and its wait for the previous write -------------------------------------------------
#: The staging lock's write handle the save on this thread will wait at for the previous checkpoint's write (set
#: by :func:`async_save` only while that write is still running).
_pending = threading.local()


def async_save(hooks: Hooks) -> Wrapper:
    """``AsyncCheckpointSaver.save``: an operation; where the previous checkpoint's write is still running, the
    save's wait for it at its staging lock is ``dcp.wait_previous_checkpoint`` (:func:`lock_wait`): torch_checkpointing's
    own wait, with its own timeout (``wait_timeout_secs``) and its own exception when that passes."""
    operation_call = logged_call(hooks.feed, semconv.CHECKPOINTING_ASYNC_SAVE, checkpoint_id=checkpointer.path_of)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        def save(*args: Any, **kwargs: Any) -> Any:
            previous = getattr(instance, "_write_future", None)
            if isinstance(previous, Future) and not previous.done():
                _pending.handle = getattr(getattr(instance, "_staging_lock", None), "write", None)
            try:
                return wrapped(*args, **kwargs)
            finally:
                _pending.handle = None

        return operation_call(save, instance, args, kwargs)

    return wrapper


def lock_wait(hooks: Hooks) -> Replacer:
    """``_LockHandle.acquire_or_raise``: the one an async save marked (:func:`async_save`) is timed as the step
    ``dcp.wait_previous_checkpoint``. A hot patch: ``with manager.lock():`` around every optimizer step calls it
    too, and then it only reads a thread-local."""
    waited = logged_call(hooks.feed, semconv.CHECKPOINTER_WAIT_PREVIOUS, starts_operations=False)

    def replacer(original: Callable[..., Any]) -> Callable[..., Any]:
        def replacement(self: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(_pending, "handle", None) is not self:
                return original(self, *args, **kwargs)
            _pending.handle = None
            return waited(original, None, (self, *args), kwargs)

        return replacement

    return replacer


# --- steps --------------------------------------------------------------------------------------------
def staged_copy(hooks: Hooks) -> After:
    """After ``DefaultStager._stage(state_dict, stream_ready, keys_not_requiring_copy)``: what it copied."""
    on_staging = hooks.recorder.on_staging

    def after(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state_dict = args[0] if args else kwargs.get("state_dict")
        kept = args[2] if len(args) > 2 else kwargs.get("keys_not_requiring_copy", ())
        if kept and isinstance(state_dict, dict):  # (items passed through uncopied)
            state_dict = {key: value for key, value in state_dict.items() if key not in kept}
        on_staging(instance, state_dict)

    return after


def stage(hooks: Hooks) -> Wrapper:
    """``DefaultStager._stage``: the copy, ``dcp.stage_checkpoint``, inside a save (on the ``ckpt-staging`` thread,
    the save's context copied there by torch_checkpointing); a ``prewarm_staging`` copy outside one is no
    checkpoint, and goes untraced."""
    timed = logged_call(hooks.feed, semconv.CHECKPOINTER_STAGE, staged_copy(hooks), starts_operations=False)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if light_get_current().get(OPERATION_KEY) is None:
            return wrapped(*args, **kwargs)
        return timed(wrapped, instance, args, kwargs)

    return wrapper


def replace_process_entry() -> Callable[[], None] | None:
    """Make :data:`~dcp_otel.processes.WRITER_PROCESS_MAIN` the writer process's entry point."""
    from dcp_otel.attach.async_process import replace_entry
    from dcp_otel.processes import WRITER_PROCESS_MAIN

    return replace_entry(process_class, PROCESS_ENTRY, WRITER_PROCESS_MAIN)


_NO_PROCESS = "the writer process's write is not part of the checkpoint's trace"
_step = checkpointer.step
#: What each attachment point is, and what is lost without it (for :data:`dcp_otel.attach.patches.PATCHES`);
#: ``hot``: a plain replacement (called several times per save on the training thread).
POINTS: tuple[tuple[str, str, str, Callable[[Hooks], Any], bool], ...] = (
    (SAVER_MODULE, "SyncCheckpointSaver.save", f"no dcp.{semconv.CHECKPOINTING_SAVE} span",
     checkpointer.operation(semconv.CHECKPOINTING_SAVE), False),
    (SAVER_MODULE, "AsyncCheckpointSaver.save", f"no dcp.{semconv.CHECKPOINTING_ASYNC_SAVE} span", async_save, False),
    (LOCK_MODULE, "_LockHandle.acquire_or_raise", f"no dcp.{semconv.CHECKPOINTER_WAIT_PREVIOUS} span", lock_wait, True),
    (LOADER_MODULE, "CheckpointLoader.load", f"no dcp.{semconv.CHECKPOINTING_LOAD} span",
     checkpointer.operation(semconv.CHECKPOINTING_LOAD), False),
    (METADATA_MODULE, "DefaultMetadataManager.compute_metadata", f"no dcp.{semconv.CHECKPOINTING_METADATA} span",
     _step(semconv.CHECKPOINTING_METADATA), False),
    (STAGING_MODULE, "DefaultStager._stage", f"no dcp.{semconv.CHECKPOINTER_STAGE} span, staged bytes or rate",
     stage, False),
    (WRITER_MODULE, "CheckpointWriter.write", f"no dcp.{semconv.CHECKPOINTER_WRITE} span", write, False),
    (WRITER_MODULE, "CheckpointWriter._write_keys", f"no dcp.{WRITE_ITEMS} span or written bytes", write_items, False),
    (WRITER_MODULE, "CheckpointWriter._write_key", "no per-item times on dcp.write_items", write_item, False),
    (WRITER_MODULE, "CheckpointWriter._write_metadata", f"no dcp.{semconv.CHECKPOINTING_WRITE_METADATA} span",
     _step(semconv.CHECKPOINTING_WRITE_METADATA), False),
    (STORAGE_MODULE, "LocalFileSystemStorage.rename", f"no dcp.{semconv.CHECKPOINTING_FINALIZE} span (durable point)",
     _step(semconv.CHECKPOINTING_FINALIZE), False),
    (READER_MODULE, "CheckpointReader.read", f"no dcp.{semconv.CHECKPOINTER_READ} span",
     _step(semconv.CHECKPOINTER_READ), False),
    (READER_MODULE, "CheckpointReader._load_full_file", "no read bytes", read_file, False),
    *((BARRIERS_MODULE, f"{barrier}.execute_barrier", f"no dcp.{semconv.CHECKPOINTER_BARRIER} span",
       _step(semconv.CHECKPOINTER_BARRIER), False) for barrier in ("TCPStoreBarrier", "DefaultStoreBarrier")),
    (PROCESS_MODULE, "CheckpointProcess.__init__", _NO_PROCESS, checkpointer.process_init, False),
    (PROCESS_MODULE, "CheckpointProcess._create_subprocess", "no metrics from the writer process",
     checkpointer.process_created, False),
    (PROCESS_MODULE, "CheckpointProcess.write", "no dcp.async_upload span for its async save",
     checkpointer.process_hand_off, False),
    (PROCESS_MODULE, "CheckpointProcess._write", _NO_PROCESS, checkpointer.process_write, False),
    (PROCESS_MODULE, "CheckpointProcess._send", _NO_PROCESS, checkpointer.process_send, False),
    (LOGGING_MODULE, "EventLogger.__call__", "no torch_checkpointing.* latencies on the spans", event_logger, True),
)  # fmt: skip
