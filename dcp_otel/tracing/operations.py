"""Start a rank's part of a checkpoint's trace, once per operation, and carry it across processes.

:class:`OperationStarter` runs on the caller's thread when a DCP operation
(``save``, ``async_save``, ``load``) begins with no enclosing DCP call: it
derives the trace id every rank agrees on (:mod:`dcp_otel.tracing.trace_ids`), takes
the sampling decision with the user's sampler, once, and chooses the span ids
of the operation span and (on the coordinator) the root span. Every later
call of the operation inherits all of that through the context.

Usage (what :class:`~dcp_otel.tracing.tracker.SpanRecorder` does)::

    op, parent_ctx = starter.begin(event, context_api.get_current(), sequences)
"""

from __future__ import annotations

import os
import re
import sys
import time
import warnings
from typing import Any, NamedTuple

from opentelemetry import context as context_api
from opentelemetry import propagate, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from dcp_otel import semconv
from dcp_otel._selftelemetry import logger, report
from dcp_otel.config import InstrumentOptions, traces_off
from dcp_otel.events import DCPEvent, operation_fields
from dcp_otel.live.signal_exceptions import away_from_signals, reraise_if_signalled
from dcp_otel.redact import redact_checkpoint_id
from dcp_otel.tracing.light import SPAN_KEY, with_span
from dcp_otel.tracing.light import span_context as light_span_context
from dcp_otel.tracing.records import Operation, new_span_id
from dcp_otel.tracing.trace_ids import (
    CheckpointKey,
    RunIdentity,
    SequenceTables,
    derive_ids,
    remote_root_context,
    resolve_run_id,
    round_generation,
    sampling_flags,
    static_sampling_flags,
    supports_chosen_ids,
)
from dcp_otel.tracing.training_step import current_step
from dcp_otel.version import __version__

#: Context key holding the :class:`Operation` a DCP call belongs to; it travels
#: with the context, into the async save thread too.
OPERATION_KEY = context_api.create_key("dcp_otel.operation")
_CLASS_FIELDS = (
    ("storage_writer", semconv.ATTR_STORAGE_WRITER),
    ("storage_reader", semconv.ATTR_STORAGE_READER),
    ("planner", semconv.ATTR_PLANNER),
)


def has_class_fields(details: Any) -> bool:
    return "storage_writer" in details or "storage_reader" in details or "planner" in details


class _Environment(NamedTuple):
    """What an operation's start reads from the environment: read once, at the first operation."""

    restart_count: str  # $TORCHELASTIC_RESTART_COUNT
    generation: str  # $DCP_OTEL_GENERATION ("": the ranks agree on one through their store)
    rank: int  # $RANK and $WORLD_SIZE: a single process's, when torch.distributed is not initialized
    world_size: int

    @classmethod
    def read(cls) -> _Environment:
        return cls(os.environ.get(semconv.ENV_TORCHELASTIC_RESTART_COUNT, "0"),
                   os.environ.get(semconv.ENV_GENERATION, "").strip(), _env_int("RANK", 0), _env_int("WORLD_SIZE", 1))  # fmt: skip


#: Operations of a checkpointing library whose own context may say their training step (torch_checkpointing's).
_LIBRARY_OPERATIONS = frozenset({semconv.CHECKPOINTING_SAVE, semconv.CHECKPOINTING_ASYNC_SAVE,
                                 semconv.CHECKPOINTING_LOAD})  # fmt: skip


class OperationStarter:
    """Begins operations for one recorder.

    What does not change from one operation to the next is derived once, not per save: the tracer of
    the current provider and what it supports, whether its sampler's decision is the same for every
    trace id, the environment a process is started with, and the run id. Per operation remain the
    trace ids (a hash of the checkpoint's key) and the span ids; the exemplar is made by whoever first
    reads it (the builder), off the caller's thread.
    """

    def __init__(self, options: InstrumentOptions, recorder: Any) -> None:
        self._options = options
        self._recorder = recorder
        # (provider, its tracer, whether spans can be emitted with chosen ids, the sampler's constant flags)
        self._cache: tuple[object, trace.Tracer, bool, TraceFlags | None] | None = None
        self._environment: _Environment | None = None  # at the first operation: instrument() may come first
        self._identities: dict[int, RunIdentity] = {}  # by the world size the run id is resolved for
        #: The last operation's attributes (one store per operation): who this process is, for its dcp.process span.
        self.last_attributes: dict[str, Any] | None = None

    def close(self) -> None:
        self._cache = None

    def tracer(self) -> tuple[trace.Tracer, bool]:
        """Our tracer, and whether the builder can give its spans the ids chosen here."""
        cache = self._tracer()
        return cache[1], cache[2]

    def _tracer(self) -> tuple[object, trace.Tracer, bool, TraceFlags | None]:
        provider = self._recorder.provider()
        cache = self._cache
        if cache is None or cache[0] is not provider:
            # (Once per provider. The SDK's code in it catches what it calls: off the main thread, that is never
            # a signal handler's exception; see away_from_signals.)
            cache = self._cache = away_from_signals(lambda: self._resolve(provider))
        return cache

    def _resolve(self, provider: trace.TracerProvider) -> tuple[object, trace.Tracer, bool, TraceFlags | None]:
        tracer = get_tracer_quietly(provider)
        warn_if_spans_go_nowhere(provider, tracer)  # before our own flush hook joins its processors
        self._recorder.hook_provider(provider)
        return (provider, tracer, supports_chosen_ids(tracer), static_sampling_flags(tracer))

    def _run_identity(self, world_size: int) -> RunIdentity:
        identity = self._identities.get(world_size)
        if identity is None:
            identity = self._identities[world_size] = resolve_run_id(self._options.run_id, world_size)
        return identity

    @staticmethod
    def class_attributes(event: DCPEvent) -> dict[str, str]:
        """The storage and planner class names torch logged for this call, if any."""
        details = event.details
        return {attr: str(details[field]) for field, attr in _CLASS_FIELDS if details.get(field)}

    def begin(
        self, event: DCPEvent, ctx: context_api.Context, sequences: SequenceTables
    ) -> tuple[Operation, context_api.Context]:
        """A DCP call with no enclosing DCP call: this rank's part of a trace, and its parent context.

        A ``no_dist`` call inside a process group is this process's alone, as outside torch.distributed:
        a trace of one rank, its own coordinator, counted apart from the group's checkpoints.
        """
        _, tracer, chosen_ids, static_flags = self._tracer()
        environment = self._environment
        if environment is None:
            environment = self._environment = _Environment.read()
        watch = self._recorder.watch
        if watch is not None:
            watch()
        fields = operation_fields(event.details)
        read_arguments = self._recorder.call_arguments
        arguments = read_arguments() if read_arguments is not None else None
        private = arguments is not None and arguments.get("no_dist") is True
        if fields.global_rank is not None and fields.world_size is not None and not private:
            distributed = True
            rank, world_size = fields.global_rank, fields.world_size
            group_rank = fields.group_rank if fields.group_rank is not None else rank
        else:  # torch.distributed not initialized, or no_dist: DCP runs as a single process
            distributed = False
            rank, world_size = environment.rank, environment.world_size
            if private:
                rank = fields.global_rank if fields.global_rank is not None else rank
                world_size = 1
            group_rank = 0
        identity = self._run_identity(world_size if distributed else 1)
        if identity.source == "fallback":
            report(
                "no_run_id",
                "no run id found for a %d-rank job (set %s, or torchrun --rdzv-id): checkpoints of two runs "
                "saved to the same path may share a trace",
                world_size,
                semconv.ENV_RUN_ID,
            )
        checkpoint_id = redact_checkpoint_id(fields.checkpoint_id)
        # Outside torch.distributed every process is its own coordinator: keep
        # processes apart so two of them never emit the same root span id.
        scope = "" if distributed else f"/rank{rank}/pid{os.getpid()}"
        generation = round_generation(environment.generation) if distributed else ""
        key = CheckpointKey(
            identity.run_id + scope,
            environment.restart_count,
            event.func_name,
            checkpoint_id,
            generation,
        )
        group = arguments.get("process_group") if arguments is not None else None
        seq = sequences.counter(group, not distributed).next(key)
        ids = derive_ids(key, seq)
        is_coordinator = group_rank == 0
        attributes: dict[str, Any] = {
            semconv.ATTR_OPERATION: event.func_name,
            semconv.ATTR_RANK: rank,
            semconv.ATTR_WORLD_SIZE: world_size,
            semconv.ATTR_GROUP_RANK: group_rank,
            semconv.ATTR_CHECKPOINT_ID: checkpoint_id,
            semconv.ATTR_OPERATION_SEQ: seq,
            semconv.ATTR_RUN_ID: identity.run_id,
            semconv.ATTR_COORDINATOR: is_coordinator,
        }
        if generation:
            attributes[semconv.ATTR_GENERATION] = generation
        self.last_attributes = attributes
        training_step = current_step(checkpoint_id, self._options.step_pattern, event.func_name in _LIBRARY_OPERATIONS)
        if training_step is not None:
            attributes[semconv.ATTR_TRAINING_STEP] = training_step
        if fields.backend:
            attributes[semconv.ATTR_BACKEND] = fields.backend
        if has_class_fields(event.details):
            attributes.update(self.class_attributes(event))
        # Once per operation (every call of it inherits it), and not even that when the sampler is constant.
        flags = static_flags if static_flags is not None else sampling_flags(tracer, ids.trace_id)
        op = Operation(event.func_name, rank, tracer, attributes, ids.trace_id, flags)
        op.start_uuid = event.uuid
        op.span_id = op.exemplar_span_id = new_span_id()

        caller = ctx.get(SPAN_KEY)  # trace.get_current_span(ctx), without its calls; None: no span
        if isinstance(caller, trace.Span):
            caller_ctx = caller.get_span_context()
            if caller_ctx.is_valid:
                op.caller = caller_ctx
                if caller.is_recording():
                    add_link = getattr(caller, "add_link", None)
                    if add_link is not None:
                        add_link(SpanContext(ids.trace_id, op.span_id, False, flags),
                                 {semconv.ATTR_LINK_KIND: semconv.LINK_CHECKPOINT})  # fmt: skip
        record = self._recorder.record
        if is_coordinator and chosen_ids:  # the builder emits the root with these ids
            op.root_span_id = ids.root_span_id
            if record is not None:
                record.op_begin(op, event.time_ns, ids.root_span_id)
            return op, with_span(ctx, NonRecordingSpan(light_span_context(ids.trace_id, ids.root_span_id, flags)))
        # A proxy or no-op tracer (no SDK configured) records nothing: nothing to warn about.
        if is_coordinator and not _is_noop(tracer):
            report(
                "no_chosen_ids",
                "the tracer provider %s cannot start a span with chosen ids: ranks share a trace, "
                "but its root span is missing",
                type(tracer).__name__,
            )
        parent_ctx = remote_root_context(tracer, ids, ctx, flags)
        if record is not None:
            record.op_begin(op, event.time_ns, trace.get_current_span(parent_ctx).get_span_context().span_id)
        return op, parent_ctx

    # --- across a process boundary (async save in a daemon process) -------
    def export(self) -> dict[str, Any] | None:
        """The current DCP operation and span as plain data another process can adopt.

        The span context travels as propagation headers (the global
        propagator's, W3C ``traceparent`` by default), as OpenTelemetry's
        messaging instrumentations carry it; the operation as its name, rank and
        step attributes. ``None`` when no DCP operation is current.
        """
        try:
            op = context_api.get_value(OPERATION_KEY)
            if not isinstance(op, Operation):
                return None
            headers: dict[str, str] = {}
            propagate.inject(headers)
            return {"headers": headers, "operation": op.name, "rank": op.rank_label,
                    "attributes": dict(op.step_attributes)}  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("recorder_error", "dcp_otel failed to carry a DCP operation to another process", exc_info=True)
            return None

    def adopt(self, carried: object) -> context_api.Context | None:
        """The context in which DCP calls continue the operation :meth:`export` described.

        Calls made in it are children of the exported span, carry the
        operation's attributes, and their metrics are that operation's steps.
        ``None`` (with a counted warning) for anything malformed.
        """
        try:
            if not isinstance(carried, dict):
                raise TypeError(f"expected a dict, got {type(carried).__name__}")
            headers, name, rank, attributes = (
                carried["headers"], carried["operation"], carried["rank"], carried["attributes"]
            )  # fmt: skip
            if not (isinstance(headers, dict) and isinstance(name, str) and isinstance(attributes, dict)):
                raise TypeError("malformed operation carrier")
            ctx = propagate.extract({str(k): str(v) for k, v in headers.items()})
            parent = trace.get_current_span(ctx).get_span_context()
            if not parent.is_valid:
                raise ValueError("no span context in the carrier")
            tracer, _ = self.tracer()
            watch = self._recorder.watch
            if watch is not None:
                watch()
            op = Operation(name, int(rank), tracer, attributes, parent.trace_id, parent.trace_flags, attributes)
            op.adopted = True
            op.exemplar_span_id = parent.span_id
            record = self._recorder.record
            if record is not None:
                record.op_begin(op, time.time_ns(), parent.span_id)
            return context_api.set_value(OPERATION_KEY, op, ctx)
        except Exception as exc:  # noqa: BLE001
            reraise_if_signalled(exc)
            report("malformed_carrier", "dcp_otel could not continue a DCP operation from another process", exc_info=True)
            return None


def _is_noop(tracer: trace.Tracer) -> bool:
    return isinstance(tracer, (trace.ProxyTracer, trace.NoOpTracer))


def warn_if_spans_go_nowhere(provider: trace.TracerProvider, tracer: trace.Tracer) -> bool:
    """Say in one line that this process's DCP spans will be dropped, and why.

    Runs once per tracer provider, at the first DCP call that uses it. A job
    whose OpenTelemetry set-up did not happen (``opentelemetry-instrument``
    without a configurator, a provider set after the first checkpoint, one with
    no span processor) otherwise trains on with no trace and no word of why.
    ``OTEL_TRACES_EXPORTER=none`` says no traces are wanted: then nothing is said.
    A set-up, not a telemetry failure: logged, not counted (a metrics-only job
    must not raise the telemetry-problems alert).
    """
    if traces_off():
        return False
    if _is_noop(tracer):
        why = ("no OpenTelemetry tracer provider is set in this process (under opentelemetry-instrument: "
               "pip install opentelemetry-distro; in code: set one before the first checkpoint)")  # fmt: skip
    elif not getattr(getattr(provider, "_active_span_processor", None), "_span_processors", True):
        why = "the tracer provider has no span processor (add a BatchSpanProcessor with an exporter)"
    else:
        return False
    logger.warning("dcp_otel: DCP spans go nowhere: %s; OTEL_TRACES_EXPORTER=none silences this", why)
    return True


def get_tracer_quietly(provider: trace.TracerProvider) -> trace.Tracer:
    """``provider.get_tracer(...)`` without resetting which warnings Python has already shown.

    The SDK's ``get_tracer`` calls ``warnings.filterwarnings`` each time, and
    every change to the filters makes Python forget which warnings it already
    showed: each of torch's warnings a process had shown would appear once
    more after the first checkpoint. The same filter is added here without
    that reset (the filter still applies to every warning not yet shown).
    """
    module = sys.modules.get("opentelemetry.sdk.trace")
    if module is None or getattr(module, "filterwarnings", None) is not warnings.filterwarnings:
        return provider.get_tracer(semconv.SCOPE_NAME, __version__)
    module.filterwarnings = _add_filter_quietly  # type: ignore[attr-defined]
    try:
        return provider.get_tracer(semconv.SCOPE_NAME, __version__)
    finally:
        module.filterwarnings = warnings.filterwarnings  # type: ignore[attr-defined]


def _add_filter_quietly(
    action: str, message: str = "", category: type[Warning] = Warning, module: str = "", lineno: int = 0,
    append: bool = False,
) -> None:  # fmt: skip
    item = (action, re.compile(message, re.I) if message else None, category,
            re.compile(module) if module else None, lineno)  # fmt: skip
    if item not in warnings.filters:
        if append:
            warnings.filters.append(item)  # type: ignore[attr-defined]
        else:
            warnings.filters.insert(0, item)  # type: ignore[attr-defined]


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default
