"""Every telemetry name dcp-otel emits, in one place.

Span names, attribute keys and environment variable names are defined here and
nowhere else: the code, the docs and the tests read them from this module, so a
rename is one edit and a typo is an ``AttributeError`` rather than a silent new
series.

Usage::

    from dcp_otel import semconv

    span.attributes[semconv.ATTR_RANK]           # -> 0
    span.name == semconv.span_name("write_data")   # -> "dcp.write_data"
"""

from __future__ import annotations

from typing import Final

#: Instrumentation scope name given to the tracer.
SCOPE_NAME: Final = "dcp_otel"

# --- span names -------------------------------------------------------------
#: Every DCP function logged by torch's ``_dcp_method_logger`` becomes a span
#: named ``SPAN_PREFIX + func_name`` (``dcp.save``, ``dcp.write_data``, ...).
SPAN_PREFIX: Final = "dcp."
#: The root of a checkpoint's trace, emitted by the coordinator rank only; every
#: rank's operation span is its child.
SPAN_CHECKPOINT: Final = "dcp.checkpoint"
#: Async save: from the hand-off to the background executor until the upload
#: future completes (the checkpoint is durable when this span ends).
SPAN_ASYNC_UPLOAD: Final = "dcp.async_upload"
#: Async save with an asynchronous stager: until the staging future completes.
SPAN_ASYNC_STAGING: Final = "dcp.async_staging"

# --- attribute keys (on every DCP span unless noted) -----------------------
ATTR_RANK: Final = "dcp.rank"  # int, global rank
ATTR_WORLD_SIZE: Final = "dcp.world_size"  # int
ATTR_GROUP_RANK: Final = "dcp.group_rank"  # int, rank in the checkpoint's process group
ATTR_CHECKPOINT_ID: Final = "dcp.checkpoint_id"  # str, credentials redacted
ATTR_OPERATION: Final = "dcp.operation"  # str: save, async_save, load, ...
ATTR_OPERATION_SEQ: Final = "dcp.operation.seq"  # int, per (operation, checkpoint id)
ATTR_RUN_ID: Final = "dcp.run_id"  # str
ATTR_GENERATION: Final = "dcp.generation"  # which round of workers (elastic restart, requeue) ran it
ATTR_COORDINATOR: Final = "dcp.coordinator"  # bool
ATTR_BACKEND: Final = "dcp.pg.backend"  # str, process-group backend (gloo, nccl, ...)
ATTR_STORAGE_WRITER: Final = "dcp.storage_writer"  # str, class name
ATTR_STORAGE_READER: Final = "dcp.storage_reader"  # str, class name
ATTR_PLANNER: Final = "dcp.planner"  # str, class name
#: True on a span whose end time was inferred (torch did not log the step's
#: exception; the span was closed when the failure became visible).
ATTR_END_INFERRED: Final = "dcp.end_inferred"
#: int[] on a span that failed with torch's ``CheckpointException``: the ranks
#: whose step raised, as every rank learns them from torch.
ATTR_FAILED_RANKS: Final = "dcp.failed_ranks"

# ``_stateful_to_state_dict`` logs one call per top-level key; these summarize
# them on the ``dcp._stateful_to_state_dict`` span instead of one span per key.
ATTR_STATE_DICT_KEYS: Final = "dcp.state_dict.keys"  # int, keys converted
ATTR_STATE_DICT_KEYS_SECONDS: Final = "dcp.state_dict.keys_seconds"  # float, total
ATTR_STATE_DICT_SLOWEST_KEYS: Final = "dcp.state_dict.slowest_keys"  # str[]
ATTR_STATE_DICT_SLOWEST_SECONDS: Final = "dcp.state_dict.slowest_keys_seconds"  # float[]
ATTR_STATE_DICT_FAILED_KEY: Final = "dcp.state_dict.failed_key"  # str

# Every rank's operation span carries a summary of its steps (see
# dcp_otel.tracing.detail): with ``detail="auto"`` most ranks export only that.
ATTR_DETAIL: Final = "dcp.detail"  # str: DETAIL_STEPS or DETAIL_SUMMARY
DETAIL_STEPS: Final = "steps"  # this rank's step spans are in the trace
DETAIL_SUMMARY: Final = "summary"  # only the summary below
ATTR_DETAIL_REASON: Final = "dcp.detail.reason"  # str: coordinator, failed, straggler, slow, sampled, full
ATTR_STEP_NAMES: Final = "dcp.steps.names"  # str[], in the order they started
ATTR_STEP_SECONDS: Final = "dcp.steps.seconds"  # float[], summed per name, parallel to ATTR_STEP_NAMES
ATTR_WAIT_SECONDS: Final = "dcp.wait_seconds"  # float: the operation's time outside its own steps
ATTR_THROUGHPUT: Final = "dcp.throughput_bytes_per_second"  # float: bytes / seconds in write_data, read_data

#: Resource attribute (``TorchDistributedResourceDetector``); the resource also
#: carries ATTR_RANK, ATTR_WORLD_SIZE and ATTR_RUN_ID, and ``host.name``.
RESOURCE_LOCAL_RANK: Final = "dcp.local_rank"  # int
#: Name of the resource detector entry point (OTEL_EXPERIMENTAL_RESOURCE_DETECTORS).
RESOURCE_DETECTOR: Final = "dcp_otel"

#: Link attribute telling why a link exists.
ATTR_LINK_KIND: Final = "dcp.link"
LINK_CALLER: Final = "caller"  # from a DCP span to the span active when DCP was called
LINK_CHECKPOINT: Final = "checkpoint"  # from the caller's span to the DCP span

# --- DCP function names we treat specially ---------------------------------
#: Operations a user calls; one of these with no enclosing DCP span starts a trace.
OPERATIONS: Final = frozenset({"save", "async_save", "load"})
#: Steps that run inside ``_DistWrapper`` collectives, whose exceptions torch
#: catches (``_wrap_exception``) without logging them.
COLLECTIVE_STEPS: Final = frozenset(
    {"local_step", "global_step", "write_data", "read_data", "finish_checkpoint"}
)
#: Prefix of the per-key calls that are summarized instead of traced.
STATEFUL_KEY_PREFIX: Final = "_stateful_to_state_dict."

# --- environment variables (documented in docs/configuration.md) ------
ENV_RUN_ID: Final = "DCP_OTEL_RUN_ID"
ENV_SLOWEST_KEYS: Final = "DCP_OTEL_SLOWEST_KEYS"
ENV_MAX_OPEN_SPANS: Final = "DCP_OTEL_MAX_OPEN_SPANS"
ENV_PROCESS_SETUP: Final = "DCP_OTEL_PROCESS_SETUP"  # module:function configuring the async save daemon
ENV_FLUSH_TIMEOUT_S: Final = "DCP_OTEL_FLUSH_TIMEOUT_S"  # seconds; bounds the flushes dcp-otel starts
ENV_DETAIL: Final = "DCP_OTEL_DETAIL"  # full or auto
ENV_SPAN_BUDGET: Final = "DCP_OTEL_SPAN_BUDGET"  # step spans one checkpoint may carry across all ranks (auto)
ENV_MAX_QUEUED_OPERATIONS: Final = "DCP_OTEL_MAX_QUEUED_OPERATIONS"  # finished operations waiting to be built
#: A value every rank of one rendezvous round shares (set by dcp-otel-run for its workers).
ENV_GENERATION: Final = "DCP_OTEL_GENERATION"
#: Store key under which the ranks of a round (or dcp-otel-run's agents) agree on their generation.
STORE_GENERATION_KEY: Final = "dcp_otel/generation"
#: Run-id sources set by launchers, tried in this order after ENV_RUN_ID.
ENV_TORCHELASTIC_RUN_ID: Final = "TORCHELASTIC_RUN_ID"
ENV_TORCHELASTIC_RESTART_COUNT: Final = "TORCHELASTIC_RESTART_COUNT"
ENV_SLURM_JOB_ID: Final = "SLURM_JOB_ID"
ENV_SLURM_STEP_ID: Final = "SLURM_STEP_ID"


def span_name(func_name: str) -> str:
    """The span name for a DCP function: ``span_name("save") == "dcp.save"``."""
    return SPAN_PREFIX + func_name

# --- Prometheus metrics (prometheus-client; names are the public contract) --
METRIC_OPERATION_DURATION: Final = "dcp_operation_duration_seconds"  # histogram: operation, status, rank
METRIC_STEP_DURATION: Final = "dcp_step_duration_seconds"  # histogram: operation, step, rank
METRIC_OPERATIONS: Final = "dcp_operations"  # counter (exposed as dcp_operations_total): operation, status, rank
METRIC_WRITTEN_BYTES: Final = "dcp_written_bytes"  # counter (..._total): rank
METRIC_READ_BYTES: Final = "dcp_read_bytes"  # counter (..._total): rank
METRIC_ASYNC_IN_FLIGHT: Final = "dcp_async_saves_in_flight"  # gauge: rank
METRIC_ASYNC_PHASE_DURATION: Final = "dcp_async_phase_duration_seconds"  # histogram: phase, rank
METRIC_COLLECTIVE_WAIT: Final = "dcp_collective_wait_seconds"  # histogram: operation, rank
METRIC_LAST_SUCCESS: Final = "dcp_last_success_timestamp_seconds"  # gauge: operation, rank
#: What dcp_otel.diagnostics() counts (dropped spans, malformed records...): reason, rank.
METRIC_TELEMETRY_PROBLEMS: Final = "dcp_otel_telemetry_problems"  # counter (..._total): reason, rank

LABEL_OPERATION: Final = "operation"
LABEL_STATUS: Final = "status"
LABEL_STEP: Final = "step"
LABEL_RANK: Final = "rank"
LABEL_PHASE: Final = "phase"
STATUS_SUCCESS: Final = "success"
STATUS_FAILURE: Final = "failure"
PHASE_STAGING: Final = "staging"
PHASE_UPLOAD: Final = "upload"
#: Exemplar labels on every histogram observation made inside a traced operation.
EXEMPLAR_TRACE_ID: Final = "trace_id"
EXEMPLAR_RANK: Final = "rank"

#: Checkpoint reality spans planning (milliseconds) to writing at scale (hours).
#: Twelve bounds keep one rank's exposition small (each bound is a series).
DURATION_BUCKETS: Final = (0.005, 0.025, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 7200.0)

#: Span attributes carrying the same byte counts as the counters.
ATTR_WRITTEN_BYTES: Final = "dcp.written_bytes"  # int, on the operation span
ATTR_READ_BYTES: Final = "dcp.read_bytes"  # int, on the operation span

ENV_METRICS_PORT: Final = "DCP_OTEL_METRICS_PORT"  # base port; each rank serves on base + LOCAL_RANK
ENV_METRICS_ADDR: Final = "DCP_OTEL_METRICS_ADDR"
#: Folder where each metrics endpoint writes its Prometheus file_sd target file.
ENV_FILE_SD_DIR: Final = "DCP_OTEL_FILE_SD_DIR"
#: Seconds a process waits at exit for one last scrape of its endpoint (0: not at all).
ENV_FINAL_SCRAPE_TIMEOUT_S: Final = "DCP_OTEL_FINAL_SCRAPE_TIMEOUT_S"
DEFAULT_METRICS_PORT: Final = 9710
DEFAULT_METRICS_ADDR: Final = "0.0.0.0"  # noqa: S104 - Prometheus scrapes from elsewhere; configurable

# --- torchelastic metrics (OTelMetricHandler) --------------------------------
METRIC_ELASTIC_DURATION: Final = "torchelastic_duration_seconds"  # histogram: group, name
METRIC_ELASTIC_CALLS: Final = "torchelastic_calls"  # counter (..._total): group, name, status
METRIC_ELASTIC_EVENTS: Final = "torchelastic_events"  # counter (..._total): group, name
METRIC_ELASTIC_LAST_VALUE: Final = "torchelastic_last_value"  # gauge: group, name
METRIC_ELASTIC_DROPPED: Final = "torchelastic_dropped_metrics"  # counter (..._total): reason
LABEL_GROUP: Final = "group"
LABEL_NAME: Final = "name"
LABEL_REASON: Final = "reason"
#: (group, name) pairs past the handler's series cap are folded into this one.
OVERFLOW: Final = "_overflow"
SPAN_ELASTIC_PREFIX: Final = "torchelastic."  # span "torchelastic.<name>" per <name>.duration.ms
ATTR_ELASTIC_GROUP: Final = "torchelastic.group"
ATTR_ELASTIC_NAME: Final = "torchelastic.name"
#: The launcher's (torchelastic agent's) own metrics endpoint; ranks use base + LOCAL_RANK.
ENV_AGENT_METRICS_PORT: Final = "DCP_OTEL_AGENT_METRICS_PORT"
DEFAULT_AGENT_METRICS_PORT: Final = 9709
