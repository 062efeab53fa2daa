"""The metrics catalogue: every metric's names in both APIs, its unit, labels and buckets (part of :mod:`dcp_otel.semconv`).

Read through ``dcp_otel.semconv`` (which re-exports every name here), never imported on its own.

Usage::

    from dcp_otel import semconv

    semconv.OPERATION_DURATION.prometheus   # -> "dcp_operation_duration_seconds"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# --- metrics: one catalogue for prometheus-client and the OpenTelemetry metrics API --
LABEL_OPERATION: Final = "operation"
LABEL_STATUS: Final = "status"
LABEL_STEP: Final = "step"
LABEL_RANK: Final = "rank"
LABEL_PHASE: Final = "phase"
LABEL_GROUP: Final = "group"
LABEL_NAME: Final = "name"
LABEL_REASON: Final = "reason"
LABEL_ERROR_TYPE: Final = "error_type"
LABEL_DEVICE: Final = "device"  # a device type: cuda, cpu, ...
LABEL_OVERLAPS: Final = "overlaps"  # a training step's: OVERLAPS_CHECKPOINT or OVERLAPS_NONE
OVERLAPS_CHECKPOINT, OVERLAPS_NONE = "checkpoint", "none"
#: Target labels of every endpoint's series (metrics/file_sd.py), named as the Collector's Prometheus exporter names the
#: resource's ``dcp.run_id``, ``host.name`` and ``service.name``: one query selects a run, scraped or pushed.
LABEL_RUN_ID: Final = "dcp_run_id"
LABEL_HOST: Final = "host_name"
LABEL_JOB: Final = "job"

#: What kind of instrument a metric is, in both APIs.
KIND_HISTOGRAM: Final = "histogram"
KIND_COUNTER: Final = "counter"
KIND_UPDOWN: Final = "updowncounter"  # a prometheus_client Gauge moved by inc/dec
KIND_GAUGE: Final = "gauge"  # a value that is set
KIND_OBSERVED: Final = "observed"  # a gauge read at collection time (an OTel observable gauge)


@dataclass(frozen=True)
class MetricSpec:
    """One metric, as both metrics APIs name it: ``prometheus`` (a counter's without ``_total``), and ``otel`` plus
    ``unit``, named so that the specification's OTLP-to-Prometheus translation (dots to underscores, the unit as a
    suffix, ``_total`` for counters) gives back exactly ``prometheus`` (``tests/test_otel_metrics.py`` proves it for
    every entry). Attribute keys are the Prometheus label names.
    """

    prometheus: str
    otel: str
    unit: str
    kind: str
    labels: tuple[str, ...]
    description: str
    buckets: tuple[float, ...] | None = None
    #: How prometheus-client combines a gauge across processes in multiprocess mode.
    multiprocess_mode: str = ""


#: Checkpoints span planning (ms) to writing at scale (hours): 19 round bounds at most 2.5x apart from 10 ms to 1 h, so a
#: quantile moves with the checkpoint. Over OTLP, OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=
#: base2_exponential_bucket_histogram sends exponential histograms instead.
DURATION_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 150.0,
                           300.0, 600.0, 1500.0, 3600.0, 7200.0)  # fmt: skip

OPERATION_DURATION: Final = MetricSpec(
    "dcp_operation_duration_seconds", "dcp.operation.duration", "s", KIND_HISTOGRAM,
    (LABEL_OPERATION, LABEL_STATUS, LABEL_RANK), "Duration of a checkpoint operation on one rank.", DURATION_BUCKETS,
)  # fmt: skip
STEP_DURATION: Final = MetricSpec(
    "dcp_step_duration_seconds", "dcp.step.duration", "s", KIND_HISTOGRAM, (LABEL_OPERATION, LABEL_STEP, LABEL_RANK),
    "Duration of one step of a checkpoint operation.", DURATION_BUCKETS,
)  # fmt: skip
OPERATION_COUNT: Final = MetricSpec(
    "dcp_operations", "dcp.operations", "{operation}", KIND_COUNTER, (LABEL_OPERATION, LABEL_STATUS, LABEL_RANK),
    "Checkpoint operations finished, by status.",
)  # fmt: skip
WRITTEN_BYTES: Final = MetricSpec("dcp_written_bytes", "dcp.written", "By", KIND_COUNTER, (LABEL_RANK,),
                                  "Bytes this rank wrote to checkpoint storage.")  # fmt: skip
READ_BYTES: Final = MetricSpec("dcp_read_bytes", "dcp.read", "By", KIND_COUNTER, (LABEL_RANK,),
                               "Bytes this rank read from checkpoint storage.")  # fmt: skip
ASYNC_IN_FLIGHT: Final = MetricSpec(
    "dcp_async_saves_in_flight", "dcp.async_saves_in_flight", "{save}", KIND_UPDOWN, (LABEL_RANK,),
    "Async saves handed off and not yet uploaded.", multiprocess_mode="livesum",
)  # fmt: skip
ASYNC_PHASE_DURATION: Final = MetricSpec(
    "dcp_async_phase_duration_seconds", "dcp.async_phase.duration", "s", KIND_HISTOGRAM, (LABEL_PHASE, LABEL_RANK),
    "Duration of async save phases: staging and upload.", DURATION_BUCKETS,
)  # fmt: skip
STAGED_BYTES: Final = MetricSpec(
    "dcp_staged_bytes", "dcp.staged", "By", KIND_COUNTER, (LABEL_DEVICE, LABEL_RANK),
    "Bytes this rank staged for async saves (copied out of the state dict), by the device they came from.",
)  # fmt: skip
COLLECTIVE_WAIT: Final = MetricSpec(
    "dcp_collective_wait_seconds", "dcp.collective_wait", "s", KIND_HISTOGRAM, (LABEL_OPERATION, LABEL_RANK),
    "Part of an operation not covered by this rank's own steps: waiting for other ranks.", DURATION_BUCKETS,
)  # fmt: skip
LAST_SUCCESS: Final = MetricSpec(
    "dcp_last_success_timestamp_seconds", "dcp.last_success_timestamp", "s", KIND_GAUGE, (LABEL_OPERATION, LABEL_RANK),
    "Unix time of the last successful operation.", multiprocess_mode="max",
)  # fmt: skip
#: The last operation's duration, held: a trend of checkpoints however far apart, exact (no bucket interpolation).
LAST_DURATION: Final = MetricSpec(
    "dcp_last_duration_seconds", "dcp.last_duration", "s", KIND_GAUGE, (LABEL_OPERATION, LABEL_STATUS, LABEL_RANK),
    "Duration of the last checkpoint operation on one rank, by status (held until the next one).",
    multiprocess_mode="max",
)  # fmt: skip
TRAINING_BLOCKED: Final = MetricSpec(
    "dcp_training_blocked_seconds", "dcp.training.blocked", "s", KIND_COUNTER, (LABEL_OPERATION, LABEL_RANK),
    "Seconds the calling (training) thread spent blocked in checkpoint calls (an async save until it returned).",
)  # fmt: skip
#: Training steps are told by torch's optimizer step hooks (tracing/steps.py); observed as checkpoints are built.
TRAINING_STEP: Final = MetricSpec(
    "dcp_training_step_seconds", "dcp.training.step", "s", KIND_HISTOGRAM, (LABEL_OVERLAPS, LABEL_RANK),
    "Training steps (one optimizer step to the next), by whether a checkpoint's background work overlapped them; "
    "time blocked in checkpoint calls left out.", DURATION_BUCKETS,
)  # fmt: skip
TRAINING_INTERFERENCE: Final = MetricSpec(
    "dcp_training_interference_seconds", "dcp.training.interference", "s", KIND_COUNTER, (LABEL_OPERATION, LABEL_RANK),
    "Seconds training steps lost, beyond their usual time, while a checkpoint's background work ran (0 within noise).",
)  # fmt: skip
FAILURES: Final = MetricSpec(
    "dcp_failures", "dcp.failures", "{failure}", KIND_COUNTER, (LABEL_OPERATION, LABEL_RANK, LABEL_ERROR_TYPE),
    "Failed checkpoint operations counted where the failure started: the rank whose own exception it was.",
)  # fmt: skip
#: What dcp_otel.diagnostics() counts (dropped spans, malformed records...), per reason and rank.
TELEMETRY_PROBLEMS: Final = MetricSpec(
    "dcp_otel_telemetry_problems", "dcp_otel.telemetry_problems", "{problem}", KIND_COUNTER, (LABEL_REASON, LABEL_RANK),
    "Telemetry dcp-otel dropped or failed to record (what dcp_otel.diagnostics() counts).",
)  # fmt: skip
#: Where every rank is now, from its open DCP calls at collection (observable; multiprocess: the watchdog publishes it).
IN_PROGRESS: Final = MetricSpec(
    "dcp_in_progress_since_timestamp_seconds", "dcp.in_progress_since_timestamp", "s", KIND_OBSERVED,
    (LABEL_OPERATION, LABEL_STEP, LABEL_RANK),
    "Unix time an open operation last made progress: when its innermost open step started (step \"-\": "
    "between steps, since the last one ended).", multiprocess_mode="livemax",
)  # fmt: skip
STALL_THRESHOLD: Final = MetricSpec(
    "dcp_stall_threshold_seconds", "dcp.stall_threshold", "s", KIND_OBSERVED, (LABEL_OPERATION, LABEL_RANK),
    "Seconds without progress after which an open operation is reported stalled (present while it is open).",
    multiprocess_mode="livemax",
)  # fmt: skip
STALLS: Final = MetricSpec(
    "dcp_stalls", "dcp.stalls", "{stall}", KIND_COUNTER, (LABEL_OPERATION, LABEL_STEP, LABEL_RANK),
    "DCP calls that stayed in one step past their stall threshold (counted once per stall).",
)  # fmt: skip
#: What finished operations record (the builder, from each operation's calls).
CHECKPOINT_METRICS: Final = (
    OPERATION_DURATION, STEP_DURATION, OPERATION_COUNT, WRITTEN_BYTES, READ_BYTES, ASYNC_IN_FLIGHT, ASYNC_PHASE_DURATION,
    STAGED_BYTES, COLLECTIVE_WAIT, LAST_SUCCESS, LAST_DURATION, TELEMETRY_PROBLEMS, FAILURES, TRAINING_BLOCKED,
    TRAINING_STEP, TRAINING_INTERFERENCE,
)  # fmt: skip
#: Read from the open calls when metrics are collected, not recorded: present only while a call is open.
LIVE_METRICS: Final = (IN_PROGRESS, STALL_THRESHOLD)
#: What is open now, and what stalled (the stall watchdog's, see dcp_otel.live).
PROGRESS_METRICS: Final = (*LIVE_METRICS, STALLS)

# --- torchelastic metrics (OTelMetricHandler) --------------------------------
ELASTIC_DURATION: Final = MetricSpec(
    "torchelastic_duration_seconds", "torchelastic.duration", "s", KIND_HISTOGRAM, (LABEL_GROUP, LABEL_NAME),
    "Duration of a torchelastic phase (@prof).", DURATION_BUCKETS,
)  # fmt: skip
ELASTIC_CALLS: Final = MetricSpec(
    "torchelastic_calls", "torchelastic.calls", "{call}", KIND_COUNTER, (LABEL_GROUP, LABEL_NAME, LABEL_STATUS),
    "torchelastic calls by outcome (@prof).",
)  # fmt: skip
ELASTIC_EVENTS: Final = MetricSpec(
    "torchelastic_events", "torchelastic.events", "1", KIND_COUNTER, (LABEL_GROUP, LABEL_NAME),
    "Other torchelastic metrics, summed.",
)  # fmt: skip
ELASTIC_LAST_VALUE: Final = MetricSpec(
    "torchelastic_last_value", "torchelastic.last_value", "1", KIND_GAUGE, (LABEL_GROUP, LABEL_NAME),
    "Last value of other torchelastic metrics.", multiprocess_mode="mostrecent",
)  # fmt: skip
ELASTIC_DROPPED: Final = MetricSpec(
    "torchelastic_dropped_metrics", "torchelastic.dropped_metrics", "{metric}", KIND_COUNTER, (LABEL_REASON,),
    "torchelastic metrics dropped or not counted.",
)  # fmt: skip
ELASTIC_METRICS: Final = (ELASTIC_DURATION, ELASTIC_CALLS, ELASTIC_EVENTS, ELASTIC_LAST_VALUE, ELASTIC_DROPPED)

#: The prometheus-client names, for code that only needs a name (dashboards, rules, tests).
METRIC_OPERATION_DURATION: Final = OPERATION_DURATION.prometheus
METRIC_STEP_DURATION: Final = STEP_DURATION.prometheus
METRIC_OPERATIONS: Final = OPERATION_COUNT.prometheus  # exposed as dcp_operations_total
METRIC_WRITTEN_BYTES: Final = WRITTEN_BYTES.prometheus  # dcp_written_bytes_total
METRIC_READ_BYTES: Final = READ_BYTES.prometheus  # dcp_read_bytes_total
METRIC_ASYNC_IN_FLIGHT: Final = ASYNC_IN_FLIGHT.prometheus
METRIC_ASYNC_PHASE_DURATION: Final = ASYNC_PHASE_DURATION.prometheus
METRIC_COLLECTIVE_WAIT: Final = COLLECTIVE_WAIT.prometheus
METRIC_LAST_SUCCESS: Final = LAST_SUCCESS.prometheus
METRIC_LAST_DURATION: Final = LAST_DURATION.prometheus
METRIC_TRAINING_BLOCKED: Final = TRAINING_BLOCKED.prometheus  # dcp_training_blocked_seconds_total
METRIC_TRAINING_STEP: Final = TRAINING_STEP.prometheus
METRIC_TRAINING_INTERFERENCE: Final = TRAINING_INTERFERENCE.prometheus  # dcp_training_interference_seconds_total
METRIC_TELEMETRY_PROBLEMS: Final = TELEMETRY_PROBLEMS.prometheus  # dcp_otel_telemetry_problems_total
METRIC_IN_PROGRESS: Final = IN_PROGRESS.prometheus
METRIC_STALL_THRESHOLD: Final = STALL_THRESHOLD.prometheus
METRIC_STALLS: Final = STALLS.prometheus  # dcp_stalls_total
METRIC_FAILURES: Final = FAILURES.prometheus  # dcp_failures_total
METRIC_ELASTIC_DURATION: Final = ELASTIC_DURATION.prometheus
METRIC_ELASTIC_CALLS: Final = ELASTIC_CALLS.prometheus  # torchelastic_calls_total
METRIC_ELASTIC_EVENTS: Final = ELASTIC_EVENTS.prometheus  # torchelastic_events_total
METRIC_ELASTIC_LAST_VALUE: Final = ELASTIC_LAST_VALUE.prometheus
METRIC_ELASTIC_DROPPED: Final = ELASTIC_DROPPED.prometheus  # torchelastic_dropped_metrics_total
METRIC_STAGED_BYTES: Final = STAGED_BYTES.prometheus  # dcp_staged_bytes_total
