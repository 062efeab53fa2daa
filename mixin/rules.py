"""Prometheus recording and alerting rules for checkpoints, from :class:`MixinConfig`.

Recording rules are named ``level:metric:operations`` (the labels kept, the
metric, what was done to it). Every alert carries ``severity``, a ``for``
duration, and ``summary`` / ``description`` annotations. Metric names come
from :mod:`dcp_otel.semconv`.

Usage::

    from mixin.config import MixinConfig
    from mixin.rules import alerting_rules, recording_rules

    groups = recording_rules(MixinConfig())["groups"]   # the YAML file's content
"""

from __future__ import annotations

from typing import Any

from dcp_otel import semconv as sc
from mixin.config import MixinConfig, seconds

Rules = dict[str, Any]

OPERATIONS_TOTAL = sc.METRIC_OPERATIONS + "_total"
WRITTEN_TOTAL = sc.METRIC_WRITTEN_BYTES + "_total"
READ_TOTAL = sc.METRIC_READ_BYTES + "_total"
#: Every operation that saves a checkpoint: DCP's save and async_save, and the _experimental checkpointer's.
SAVES = f'{sc.LABEL_OPERATION}=~"{"|".join(sorted(sc.SAVE_OPERATIONS))}"'
#: The steps that move the bytes: where a slow disk or link shows.
IO_STEPS = f'{sc.LABEL_STEP}=~"{"|".join(sorted(sc.IO_STEPS))}"'


def recent_operation_mean(cfg: MixinConfig) -> str:
    """Record name: mean duration of successful operations per job over the recent window."""
    return f"job_operation:{sc.METRIC_OPERATION_DURATION}:mean{cfg.recent_window}"


def recent_step_mean(cfg: MixinConfig) -> str:
    """Record name: mean duration of each step on each rank over the recent window."""
    return f"job_operation_step_rank:{sc.METRIC_STEP_DURATION}:mean{cfg.recent_window}"


def _mean(metric: str, by: str, window: str, cfg: MixinConfig, *matchers: str) -> str:
    # Only where something happened in the window: 0/0 would record NaN, which
    # poisons quantile_over_time and every comparison downstream.
    sel = cfg.sel(*matchers)
    return (
        f"sum by ({by}) (increase({metric}_sum{sel}[{window}]))\n"
        f"/\n(sum by ({by}) (increase({metric}_count{sel}[{window}])) > 0)"
    )


def recording_rules(cfg: MixinConfig) -> Rules:
    """Aggregates the dashboards and alerts read; they drop the rank label where it is not needed."""
    r = cfg.rate_window
    success = f'{sc.LABEL_STATUS}="{sc.STATUS_SUCCESS}"'
    rules = [
        {
            "record": f"job_operation_status:{sc.METRIC_OPERATIONS}:rate{r}",
            "expr": f"sum by (job, operation, status) (rate({OPERATIONS_TOTAL}{cfg.sel()}[{r}]))",
        },
        {
            "record": f"job_operation_le:{sc.METRIC_OPERATION_DURATION}_bucket:rate{r}",
            "expr": f"sum by (job, operation, le) (rate({sc.METRIC_OPERATION_DURATION}_bucket{cfg.sel()}[{r}]))",
        },
        {
            "record": f"job_operation_step_le:{sc.METRIC_STEP_DURATION}_bucket:rate{r}",
            "expr": f"sum by (job, operation, step, le) (rate({sc.METRIC_STEP_DURATION}_bucket{cfg.sel()}[{r}]))",
        },
        {"record": f"job:{sc.METRIC_WRITTEN_BYTES}:rate{r}", "expr": f"sum by (job) (rate({WRITTEN_TOTAL}{cfg.sel()}[{r}]))"},
        {"record": f"job:{sc.METRIC_READ_BYTES}:rate{r}", "expr": f"sum by (job) (rate({READ_TOTAL}{cfg.sel()}[{r}]))"},
        {"record": f"job:{sc.METRIC_ASYNC_IN_FLIGHT}:sum", "expr": f"sum by (job) ({sc.METRIC_ASYNC_IN_FLIGHT}{cfg.sel()})"},
        {
            "record": recent_operation_mean(cfg),
            "expr": _mean(sc.METRIC_OPERATION_DURATION, "job, operation", cfg.recent_window, cfg, success),
        },
        {
            "record": recent_step_mean(cfg),
            "expr": _mean(sc.METRIC_STEP_DURATION, "job, operation, step, rank", cfg.recent_window, cfg),
        },
    ]
    return {"groups": [{"name": "dcp-otel.rules", "rules": rules}]}


def _alert(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description},
    }


def alerting_rules(cfg: MixinConfig) -> Rules:
    """The alerts infra teams page on when checkpointing breaks."""
    failed, upload = f'{sc.LABEL_STATUS}="{sc.STATUS_FAILURE}"', f'{sc.LABEL_PHASE}="{sc.PHASE_UPLOAD}"'
    failures = f"{OPERATIONS_TOTAL}{cfg.sel(failed)}"
    problems = f"{sc.METRIC_TELEMETRY_PROBLEMS}_total{cfg.sel()}"
    fw = cfg.failure_window
    no_save_s = int(seconds(cfg.no_save_window))
    op_mean, step_mean = recent_operation_mean(cfg), recent_step_mean(cfg)
    io_step_mean = f"{step_mean}{{{IO_STEPS}}}"
    alerts = [
        _alert(
            "DCPCheckpointOperationFailed",
            # Failed checkpoints, not rank-level failures: every rank of a failed checkpoint counts it once,
            # so the most any rank counted is how many checkpoints failed (not 1,024 for one on 1,024 ranks).
            # A rank's first failure creates its series already at 1, which increase()
            # cannot see: the second term catches series that are new in the window.
            f"max by (job, operation) (increase({failures}[{fw}])) > 0\n"
            f"or\nmax by (job, operation) ({failures} unless {failures} offset {fw}) > 0",
            "0m",
            "warning",
            "A checkpoint {{ $labels.operation }} failed in job {{ $labels.job }}.",
            "{{ $value | printf \"%.0f\" }} failed {{ $labels.operation }} checkpoints in job {{ $labels.job }} in the last "
            f"{fw}. {sc.METRIC_FAILURES}_total says on which rank each started and its error type; the checkpoint's "
            "trace has that rank's exception.",
        ),
        _alert(
            "DCPNoRecentSuccessfulSave",
            # max_over_time keeps the last success known across a restart of the job, whose
            # new processes have no success yet; `up` stops the alert once the job is gone.
            f"time() - max by (job) (max_over_time({sc.METRIC_LAST_SUCCESS}{cfg.sel(SAVES)}[{cfg.baseline_window}]))"
            f" > {no_save_s}\nand on (job)\n(max by (job) (up{cfg.sel()}) == 1)",
            "5m",
            "critical",
            "No successful checkpoint save in job {{ $labels.job }} for over " + cfg.no_save_window + ".",
            "The last save (or durable async save) of job {{ $labels.job }} succeeded "
            "{{ $value | humanizeDuration }} ago. A crash now loses all progress since then.",
        ),
        _alert(
            "DCPCheckpointSlow",
            f"{op_mean}\n> {cfg.slow_factor:g} * quantile_over_time(0.5, {op_mean}[{cfg.baseline_window}])\n"
            f"and {op_mean} > {cfg.slow_min_seconds:g}",
            "1m",
            "warning",
            "{{ $labels.operation }} in job {{ $labels.job }} is much slower than usual.",
            "{{ $labels.operation }} took {{ $value | humanizeDuration }} on average over the last "
            f"{cfg.recent_window}, over {cfg.slow_factor:g}x its median of the last {cfg.baseline_window}.",
        ),
        _alert(
            "DCPStragglerRank",
            f"{io_step_mean}\n> on (job, operation, step) group_left\n"
            f"{cfg.straggler_factor:g} * quantile by (job, operation, step) (0.5, {io_step_mean})\n"
            f"and {io_step_mean} > {cfg.straggler_min_seconds:g}",
            "5m",
            "warning",
            "Rank {{ $labels.rank }} of job {{ $labels.job }} is a straggler in {{ $labels.step }}.",
            "Rank {{ $labels.rank }} spends {{ $value | humanizeDuration }} in {{ $labels.step }} of "
            "{{ $labels.operation }}, over " + f"{cfg.straggler_factor:g}x the median across ranks "
            f"(mean over {cfg.recent_window}); every other rank waits for it. Check its node's disk and network.",
        ),
        _alert(
            "DCPAsyncSaveStuck",
            f"sum by (job, rank) (min_over_time({sc.METRIC_ASYNC_IN_FLIGHT}{cfg.sel()}[{cfg.stuck_async_window}])) > 0\n"
            f"unless on (job, rank)\nsum by (job, rank) (increase({sc.METRIC_ASYNC_PHASE_DURATION}_count"
            f"{cfg.sel(upload)}[{cfg.stuck_async_window}])) > 0",
            "5m",
            "warning",
            "Async saves of rank {{ $labels.rank }} in job {{ $labels.job }} are not finishing.",
            "Rank {{ $labels.rank }} has had an async save in flight for over "
            f"{cfg.stuck_async_window} with no upload finished: the checkpoint is not durable yet. "
            "Look at its dcp.async_upload span.",
        ),
        _alert(
            "DCPCheckpointStalled",
            # A rank whose open operation has made no progress (no step began or ended) for longer than its
            # stall threshold: the watchdog's own (from the operation's history, or DCP_OTEL_STALL_AFTER_S).
            # "> 0": in multiprocess mode a finished operation's series reads 0 in the shared files.
            f"(time() - ({sc.METRIC_IN_PROGRESS}{cfg.sel()} > 0))\n"
            f"> ignoring (step) group_left\n{sc.METRIC_STALL_THRESHOLD}{cfg.sel()}",
            "0m",
            "critical",
            "A checkpoint {{ $labels.operation }} of job {{ $labels.job }} stalled on rank {{ $labels.rank }} "
            "(step {{ $labels.step }}).",
            "No progress for {{ $value | humanizeDuration }}, past its stall threshold (step \"-\": between steps, "
            "waiting in DCP's collectives for the ranks that are stuck in a step). Its dcp.stall spans, in the "
            "checkpoint's trace now, carry the stuck thread's stack; every other rank waits until the collective "
            "timeout.",
        ),
        _alert(
            "DCPTelemetryProblems",
            # As with failures, a reason's first problem creates its series at 1.
            f"sum by (job, reason) (increase({problems}[{fw}])) > 0\n"
            f"or\nsum by (job, reason) ({problems} unless {problems} offset {fw}) > 0",
            "0m",
            "warning",
            "dcp-otel dropped or failed to record telemetry in job {{ $labels.job }} ({{ $labels.reason }}).",
            "{{ $value | printf \"%.0f\" }} times in the last " + fw + " in job {{ $labels.job }}, reason "
            "{{ $labels.reason }} (span_queue_full: the span exporter is slow, down or hung). Checkpoints are "
            "unaffected, but traces or metrics may be incomplete. Each rank logs one warning a minute per reason.",
        ),
    ]
    return {"groups": [{"name": "dcp-otel.alerts", "rules": alerts}]}
