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

# The metrics catalogue (every MetricSpec, label and METRIC_* name), re-exported: still one place for every name.
from dcp_otel.semconv.metrics import *  # noqa: F403

#: Instrumentation scope name given to the tracer.
SCOPE_NAME: Final = "dcp_otel"

# --- span names -------------------------------------------------------------
#: Every DCP function logged by torch's ``_dcp_method_logger`` becomes a span ``SPAN_PREFIX + func_name`` (``dcp.save``).
SPAN_PREFIX: Final = "dcp."
#: The root of a checkpoint's trace, emitted by the coordinator rank only; every rank's operation span is its child.
SPAN_CHECKPOINT: Final = "dcp.checkpoint"
#: Async save: from the hand-off to the background executor until the upload future completes (then durable).
SPAN_ASYNC_UPLOAD: Final = "dcp.async_upload"
#: Async save with an asynchronous stager: until the staging future completes.
SPAN_ASYNC_STAGING: Final = "dcp.async_staging"
#: A DCP call with no progress past its stall threshold: a zero-length span under the open step, emitted at once (live/).
SPAN_STALL: Final = "dcp.stall"
#: One of DCP's object collectives (``_DistWrapper.gather_object``, ...): ``dcp.collective.gather_object``, a child of
#: the rank's operation span. Its time is waiting for the others; with "auto" it goes with the ranks' step spans.
SPAN_COLLECTIVE_PREFIX: Final = "dcp.collective."

# --- attribute keys (on every DCP span unless noted) -----------------------
ATTR_RANK: Final = "dcp.rank"  # int, global rank
ATTR_WORLD_SIZE: Final = "dcp.world_size"  # int
ATTR_GROUP_RANK: Final = "dcp.group_rank"  # int, rank in the checkpoint's process group
ATTR_CHECKPOINT_ID: Final = "dcp.checkpoint_id"  # str, credentials redacted
ATTR_OPERATION: Final = "dcp.operation"  # str: save, async_save, load, ...
ATTR_OPERATION_SEQ: Final = "dcp.operation.seq"  # int, per (operation, checkpoint id)
ATTR_RUN_ID: Final = "dcp.run_id"  # str
#: int: the training step the checkpoint is of: dcp_otel.set_training_step(), else read from the checkpoint id.
ATTR_TRAINING_STEP: Final = "dcp.training.step"
ATTR_GENERATION: Final = "dcp.generation"  # which round of workers (elastic restart, requeue) ran it
ATTR_COORDINATOR: Final = "dcp.coordinator"  # bool
ATTR_BACKEND: Final = "dcp.pg.backend"  # str, process-group backend (gloo, nccl, ...)
ATTR_STORAGE_WRITER: Final = "dcp.storage_writer"  # str, class name
ATTR_STORAGE_READER: Final = "dcp.storage_reader"  # str, class name
ATTR_PLANNER: Final = "dcp.planner"  # str, class name
ATTR_END_INFERRED: Final = "dcp.end_inferred"  # True: its end was inferred (torch did not log the step's exception)
#: True on a span whose call returned after uninstrument(): ended by then, with no error seen, its end unrecorded.
ATTR_END_UNKNOWN: Final = "dcp.end_unknown"
#: int[] on a span that failed with torch's ``CheckpointException``: the ranks whose step raised, as torch tells them.
ATTR_FAILED_RANKS: Final = "dcp.failed_ranks"
#: str on a span ended as its process terminated with it open: ``SIGTERM``, or INTERRUPTED_AT_EXIT (not Ctrl-C's).
ATTR_INTERRUPTED: Final = "dcp.interrupted"
#: float on a failed (or interrupted) operation span: seconds since this process's last durable save, the work at risk.
ATTR_RECOVERY_POINT_AGE: Final = "dcp.recovery_point.age_seconds"
ATTR_RECOVERY_POINT_ID: Final = "dcp.recovery_point.checkpoint_id"  # str: that save's checkpoint id
#: A rank process's life as dcp-otel saw it, from instrument() to its end, ended at exit or SIGTERM after its first
#: operation: a generation's last sign of life, with its recovery point and the last training step said.
SPAN_PROCESS: Final = "dcp.process"
ATTR_ENDED_BY: Final = "dcp.process.ended_by"  # str: ENDED_BY_EXIT, ENDED_BY_EXCEPTION or a signal's name
ENDED_BY_EXIT, ENDED_BY_EXCEPTION = "exit", "exception"
INTERRUPTED_AT_EXIT: Final = "exit"

# On a dcp.collective.* span:
#: str: torch's name for the step the collective belongs to (``plan``, ``write``, ``read``: the ``step`` argument of
#: ``_DistWrapper``'s patterns), absent when DCP called it directly (the barrier of a save without collectives).
ATTR_COLLECTIVE_STEP: Final = "dcp.collective.step"
#: str: the ``_DistWrapper`` method it is part of: ``reduce_scatter``, ``all_reduce``, ``all_gather``, ``broadcast``.
ATTR_COLLECTIVE_PATTERN: Final = "dcp.collective.pattern"
#: int: bytes of pickled objects this rank sent, and received, in it (plans, write results, metadata; not a barrier).
ATTR_COLLECTIVE_SENT_BYTES: Final = "dcp.collective.sent_bytes"
ATTR_COLLECTIVE_RECEIVED_BYTES: Final = "dcp.collective.received_bytes"
#: On the coordinator's write gather and the root of a save it waited in for one rank (attach/arrivals.py): that rank
#: (int), its and the other ranks' median seconds from the plan's release to sending their write results (floats),
#: and how many ranks' results said (int: instrumented ones). Named at SLOW_FACTOR x that median (tracing/detail.py).
ATTR_STRAGGLER_RANK: Final = "dcp.straggler.rank"
ATTR_STRAGGLER_SECONDS: Final = "dcp.straggler.seconds"
ATTR_STRAGGLER_MEDIAN_SECONDS: Final = "dcp.straggler.median_seconds"
ATTR_STRAGGLER_RANKS: Final = "dcp.straggler.ranks_said"
#: True on a span whose exception one of DCP's collectives raised (a peer gone, a timeout): not this rank's own.
ATTR_FAILED_IN_COLLECTIVE: Final = "dcp.failed_in_collective"

# On a dcp.stall span (it also carries the operation's rank, checkpoint id and classes):
ATTR_STEP: Final = "dcp.step"  # str: the innermost open step, or STEP_NONE between steps
ATTR_STALL_SECONDS: Final = "dcp.stall.seconds"  # float: since the call last made progress
ATTR_STALL_THRESHOLD: Final = "dcp.stall.threshold_seconds"  # float: the threshold it passed
ATTR_STALL_REPORT: Final = "dcp.stall.report"  # int: 1 for the first report of this stall, then 2, 3, ...
#: str: the torch.distributed collective the stuck thread is blocked in, waiting for other ranks, and its DCP caller.
ATTR_STALL_COLLECTIVE: Final = "dcp.stall.collective"
ATTR_STALL_COLLECTIVE_CALLER: Final = "dcp.stall.collective.caller"
#: str: where the stuck work runs when it is not this process's own thread (``async save process``).
ATTR_STALL_WHERE: Final = "dcp.stall.where"
#: OpenTelemetry's semantic conventions: the stuck thread's Python stack, its id and name.
ATTR_CODE_STACKTRACE: Final = "code.stacktrace"
ATTR_THREAD_ID: Final = "thread.id"
ATTR_THREAD_NAME: Final = "thread.name"
#: The step of an operation that is between steps (in DCP's own code or its collectives).
STEP_NONE: Final = "-"

# ``_stateful_to_state_dict`` logs a call per top-level key; these summarize them on its span (no span per key).
ATTR_STATE_DICT_KEYS: Final = "dcp.state_dict.keys"  # int, keys converted
ATTR_STATE_DICT_KEYS_SECONDS: Final = "dcp.state_dict.keys_seconds"  # float, total
ATTR_STATE_DICT_SLOWEST_KEYS: Final = "dcp.state_dict.slowest_keys"  # str[]
ATTR_STATE_DICT_SLOWEST_SECONDS: Final = "dcp.state_dict.slowest_keys_seconds"  # float[]
ATTR_ITEMS: Final = "dcp.items"  # int: the items torch_checkpointing's ``dcp.write_items`` wrote (a file each)
ATTR_ITEMS_SLOWEST: Final = "dcp.items.slowest"  # str[]: the slowest items' keys, slowest first
ATTR_ITEMS_SLOWEST_SECONDS: Final = "dcp.items.slowest_seconds"  # float[]
ATTR_ITEMS_FAILED: Final = "dcp.items.failed"  # str: the item whose write raised
ATTR_STATE_DICT_FAILED_KEY: Final = "dcp.state_dict.failed_key"  # str

# Every rank's operation span carries a summary of its steps (tracing/detail.py): with "auto" most ranks send only it.
ATTR_DETAIL: Final = "dcp.detail"  # str: DETAIL_STEPS or DETAIL_SUMMARY
DETAIL_STEPS: Final = "steps"  # this rank's step spans are in the trace
DETAIL_SUMMARY: Final = "summary"  # only the summary below
ATTR_DETAIL_REASON: Final = "dcp.detail.reason"  # str: coordinator, failed, straggler, slow, sampled, full
ATTR_STEP_NAMES: Final = "dcp.steps.names"  # str[], in the order they started
ATTR_STEP_SECONDS: Final = "dcp.steps.seconds"  # float[], summed per name, parallel to ATTR_STEP_NAMES
ATTR_WAIT_SECONDS: Final = "dcp.wait_seconds"  # float: the operation's time outside its own steps
#: float: of that wait, the time in DCP's collectives (dcp.collective.* spans); the rest is DCP's own code.
ATTR_COLLECTIVE_SECONDS: Final = "dcp.collective_seconds"
ATTR_THROUGHPUT: Final = "dcp.throughput_bytes_per_second"  # float: bytes / seconds in write_data, read_data

# On an operation span (and its root) whose background work (staging, upload) overlapped training steps, measured
# against the steps before it (tracing/interference.py); absent where it cannot tell (too few steps, no optimizer).
ATTR_INTERFERENCE_STEPS: Final = "dcp.interference.steps"  # int: the training steps that overlapped it
ATTR_INTERFERENCE_RATIO: Final = "dcp.interference.ratio"  # float: their mean time over the usual step's
ATTR_INTERFERENCE_LOST: Final = "dcp.interference.lost_seconds"  # float: beyond their usual time (0: within noise)
ATTR_USUAL_STEP: Final = "dcp.training.usual_step_seconds"  # float: the median step before the checkpoint

#: Resource attribute (``TorchDistributedResourceDetector``), beside ATTR_RANK, ATTR_WORLD_SIZE, ATTR_RUN_ID, host.name.
RESOURCE_LOCAL_RANK: Final = "dcp.local_rank"  # int
#: Name of the resource detector entry point (OTEL_EXPERIMENTAL_RESOURCE_DETECTORS).
RESOURCE_DETECTOR: Final = "dcp_otel"

#: Link attribute telling why a link exists.
ATTR_LINK_KIND: Final = "dcp.link"
LINK_CALLER: Final = "caller"  # from a DCP span to the span active when DCP was called
LINK_CHECKPOINT: Final = "checkpoint"  # from the caller's span to the DCP span

# --- DCP function names we treat specially ---------------------------------
#: torch's ``_experimental`` checkpointer's calls, which torch does not log, under these names (attach/checkpointer.py).
CHECKPOINTER_SAVE: Final = "checkpointer_save"
CHECKPOINTER_ASYNC_SAVE: Final = "checkpointer_async_save"
CHECKPOINTER_LOAD: Final = "checkpointer_load"
CHECKPOINTER_STAGE: Final = "stage_checkpoint"  # DefaultStager.stage
#: CheckpointProcess.write: handing the staged state dict to the checkpoint process (waits for it to start).
CHECKPOINTER_HAND_OFF: Final = "hand_off_checkpoint"
CHECKPOINTER_WRITE: Final = "write_checkpoint"  # CheckpointWriter.write: the rank's file, then the barrier
CHECKPOINTER_READ: Final = "read_checkpoint"  # CheckpointReader.read
CHECKPOINTER_BARRIER: Final = "barrier"  # DistBarrier / TCPStoreBarrier.execute_barrier: waiting for the others
#: AsyncCheckpointer.save waiting for the previous checkpoint's write to finish before it stages the next.
CHECKPOINTER_WAIT_PREVIOUS: Final = "wait_previous_checkpoint"
#: ``torch_checkpointing``'s (attach/torch_checkpointing.py): its savers' save, its loader's load; steps as above and:
CHECKPOINTING_SAVE: Final = "checkpointing_save"
CHECKPOINTING_ASYNC_SAVE: Final = "checkpointing_async_save"
CHECKPOINTING_LOAD: Final = "checkpointing_load"
CHECKPOINTING_METADATA: Final = "compute_metadata"  # DefaultMetadataManager.compute_metadata (may all-gather)
CHECKPOINTING_WRITE_METADATA: Final = "write_metadata"  # CheckpointWriter._write_metadata (role rank 0)
CHECKPOINTING_FINALIZE: Final = "finalize_checkpoint"  # the rename onto the checkpoint's path (role rank 0): durable
CHECKPOINTER_OPERATIONS: Final = frozenset({CHECKPOINTER_SAVE, CHECKPOINTER_ASYNC_SAVE, CHECKPOINTER_LOAD,
                                            CHECKPOINTING_SAVE, CHECKPOINTING_ASYNC_SAVE, CHECKPOINTING_LOAD})  # fmt: skip
#: Operations a user calls; one of these with no enclosing DCP span starts a trace.
OPERATIONS: Final = frozenset({"save", "async_save", "load", *CHECKPOINTER_OPERATIONS})
#: Operations that load one (their bytes are read bytes).
LOAD_OPERATIONS: Final = frozenset({"load", CHECKPOINTER_LOAD, CHECKPOINTING_LOAD})
#: Operations that save a checkpoint (what "the last successful save" means).
SAVE_OPERATIONS: Final = OPERATIONS - LOAD_OPERATIONS
#: Operations whose checkpoint is durable only when their upload (``dcp.async_upload``) ends.
ASYNC_OPERATIONS: Final = frozenset({"async_save", CHECKPOINTER_ASYNC_SAVE, CHECKPOINTING_ASYNC_SAVE})
#: A rank's in-progress step while it waits between steps, in DCP's collectives: "-", or a nested operation's own call
#: (an async save's background ``save``). Any other step (``write_data``) is one the rank itself is stuck in.
WAITING_STEPS: Final = frozenset({STEP_NONE, *OPERATIONS})
#: Steps that move a checkpoint's bytes, to or from storage.
IO_STEPS: Final = frozenset({"write_data", "read_data", CHECKPOINTER_WRITE, CHECKPOINTER_READ})
#: Steps that stage a state dict for an async save, on the caller's side.
STAGING_STEPS: Final = frozenset({"stage_state_dict", CHECKPOINTER_STAGE})
#: The checkpointer's steps (each runs on one rank; a failure in one is that rank's own).
CHECKPOINTER_STEPS: Final = frozenset({CHECKPOINTER_STAGE, CHECKPOINTER_HAND_OFF, CHECKPOINTER_WRITE, CHECKPOINTER_READ,
                                       CHECKPOINTER_BARRIER, CHECKPOINTER_WAIT_PREVIOUS, CHECKPOINTING_METADATA,
                                       CHECKPOINTING_WRITE_METADATA, CHECKPOINTING_FINALIZE})  # fmt: skip
#: Steps that are waiting, not the rank's own work: for the other ranks, or for the previous checkpoint.
WAIT_STEPS: Final = frozenset({CHECKPOINTER_BARRIER, CHECKPOINTER_WAIT_PREVIOUS})
#: Steps that run inside ``_DistWrapper`` collectives, whose exceptions torch catches (``_wrap_exception``) unlogged.
COLLECTIVE_STEPS: Final = frozenset({"local_step", "global_step", "write_data", "read_data", "finish_checkpoint"})
#: Prefix of the per-key calls that are summarized instead of traced.
STATEFUL_KEY_PREFIX: Final = "_stateful_to_state_dict."

# --- environment variables (documented in docs/configuration.md) ------
ENV_RUN_ID: Final = "DCP_OTEL_RUN_ID"
ENV_STEP_PATTERN: Final = "DCP_OTEL_STEP_PATTERN"  # regex: the training step in a checkpoint id ("off": none)
ENV_SLOWEST_KEYS: Final = "DCP_OTEL_SLOWEST_KEYS"
ENV_MAX_OPEN_SPANS: Final = "DCP_OTEL_MAX_OPEN_SPANS"
ENV_PROCESS_SETUP: Final = "DCP_OTEL_PROCESS_SETUP"  # module:function configuring the async save daemon
ENV_FLUSH_TIMEOUT_S: Final = "DCP_OTEL_FLUSH_TIMEOUT_S"  # seconds; bounds the flushes dcp-otel starts
ENV_DETAIL: Final = "DCP_OTEL_DETAIL"  # full or auto
ENV_SPAN_EXPORT: Final = "DCP_OTEL_SPAN_EXPORT"  # process or node: who exports the checkpoint spans
#: ``span_export``'s values: the process exports its checkpoint spans, or the node's exporter (the agent) does.
SPAN_EXPORT_PROCESS: Final = "process"
SPAN_EXPORT_NODE: Final = "node"
SPAN_EXPORT_MODES: Final = (SPAN_EXPORT_PROCESS, SPAN_EXPORT_NODE)
ENV_SPAN_BUDGET: Final = "DCP_OTEL_SPAN_BUDGET"  # step spans one checkpoint may carry across all ranks (auto)
ENV_MAX_QUEUED_OPERATIONS: Final = "DCP_OTEL_MAX_QUEUED_OPERATIONS"  # finished operations waiting to be built
#: Seconds without progress after which an open DCP call is reported stalled; "auto" (default): from its history.
ENV_STALL_AFTER_S: Final = "DCP_OTEL_STALL_AFTER_S"
ENV_SPOOL_DIR: Final = "DCP_OTEL_SPOOL_DIR"  # where each process's record is kept ("off": nowhere; spool.layout)
ENV_SIGNALS_RETIRED: Final = "DCP_OTEL_SIGNALS"  # read only to say that it is ignored (no signal handler any more)
ENV_GENERATION: Final = "DCP_OTEL_GENERATION"  # what every rank of a rendezvous round shares (from dcp-otel-run)
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


def is_collective_span(name: str) -> bool:
    """Whether a span is one of DCP's collectives (``dcp.collective.gather_object``): waiting, not a step."""
    return name.startswith(SPAN_COLLECTIVE_PREFIX)

# --- metrics: the catalogue is semconv/metrics.py (re-exported above); what the sinks share besides it ----
#: Where checkpoint and torchelastic metrics are recorded (DCP_OTEL_METRICS, comma-separated; "none" for neither).
SINK_PROMETHEUS: Final = "prometheus"  # prometheus-client: a scrape endpoint, multiprocess files
SINK_OPENTELEMETRY: Final = "opentelemetry"  # the OpenTelemetry metrics API: whatever the MeterProvider exports
ALL_METRIC_SINKS: Final = (SINK_PROMETHEUS, SINK_OPENTELEMETRY)
ENV_METRICS: Final = "DCP_OTEL_METRICS"
#: The OpenTelemetry SDK's variable: when it names an exporter, the OpenTelemetry sink is on by default.
ENV_OTEL_METRICS_EXPORTER: Final = "OTEL_METRICS_EXPORTER"
#: The SDK's span exporters; "none" says no traces are wanted (dcp-otel then never warns that spans go nowhere).
ENV_OTEL_TRACES_EXPORTER: Final = "OTEL_TRACES_EXPORTER"
#: An observable instrument that never reports a value: called at each collection's start, it lets the builder record.
OTEL_COLLECTION_BARRIER: Final = "dcp_otel.collection_barrier"

STATUS_SUCCESS: Final = "success"
STATUS_FAILURE: Final = "failure"
PHASE_STAGING: Final = "staging"
PHASE_UPLOAD: Final = "upload"
EXEMPLAR_TRACE_ID: Final = "trace_id"  # exemplar labels on every histogram observation inside a traced operation
EXEMPLAR_RANK: Final = "rank"
#: The operation span (OTel exemplars carry it; Prometheus exemplars too, so Grafana can open the span).
EXEMPLAR_SPAN_ID: Final = "span_id"

#: Span attributes carrying the same byte counts as the counters.
ATTR_WRITTEN_BYTES: Final = "dcp.written_bytes"  # int, on the operation span
ATTR_READ_BYTES: Final = "dcp.read_bytes"  # int, on the operation span
#: On the staging step (``dcp.stage_state_dict``) and the staging future's span (``dcp.async_staging``): what an
#: async save copied out of the state dict before it returned (the copy that blocks training).
ATTR_STAGING_BYTES: Final = "dcp.staging.bytes"  # int: the tensors' bytes (a DTensor's or ShardedTensor's local part)
ATTR_STAGING_DEVICE: Final = "dcp.staging.device"  # str: where they were, "cuda:0"; several: "cpu,cuda:0"
ATTR_STAGING_PINNED: Final = "dcp.staging.pinned"  # bool: into pinned (page-locked) host memory
ATTR_STAGING_SHARED: Final = "dcp.staging.shared"  # bool: into shared memory (for the async save process)
#: float: bytes over the seconds of the span that covers the copy (the staging future's where there is one).
ATTR_STAGING_RATE: Final = "dcp.staging.bytes_per_second"

ENV_METRICS_PORT: Final = "DCP_OTEL_METRICS_PORT"  # base port; each rank serves on base + LOCAL_RANK
ENV_METRICS_ADDR: Final = "DCP_OTEL_METRICS_ADDR"
#: Folder where each metrics endpoint writes its Prometheus file_sd target file.
ENV_FILE_SD_DIR: Final = "DCP_OTEL_FILE_SD_DIR"
#: Seconds a process waits at exit for one last scrape of its endpoint (0: not at all).
ENV_FINAL_SCRAPE_TIMEOUT_S: Final = "DCP_OTEL_FINAL_SCRAPE_TIMEOUT_S"
DEFAULT_METRICS_PORT: Final = 9710
DEFAULT_METRICS_ADDR: Final = "0.0.0.0"  # noqa: S104 - Prometheus scrapes from elsewhere; configurable

# --- torchelastic spans (OTelMetricHandler) --------------------------------
#: (group, name) pairs past the handler's series cap are folded into this one.
OVERFLOW: Final = "_overflow"
SPAN_ELASTIC_PREFIX: Final = "torchelastic."  # span "torchelastic.<name>" per <name>.duration.ms
ATTR_ELASTIC_GROUP: Final = "torchelastic.group"
ATTR_ELASTIC_NAME: Final = "torchelastic.name"
#: The launcher's (torchelastic agent's) own metrics endpoint; ranks use base + LOCAL_RANK.
ENV_AGENT_METRICS_PORT: Final = "DCP_OTEL_AGENT_METRICS_PORT"
DEFAULT_AGENT_METRICS_PORT: Final = 9709
