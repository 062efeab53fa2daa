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
#: What one run is: every rule, alert and panel keeps these labels, so none adds up runs a Prometheus holds side by
#: side (the job's name, and the run id dcp-otel's discovery files and OTLP resources give every series).
RUN = f"job, {sc.LABEL_RUN_ID}"


def recent_operation_mean(cfg: MixinConfig) -> str:
    """Record name: mean duration of successful operations per job over the recent window."""
    return f"job_run_operation:{sc.METRIC_OPERATION_DURATION}:mean{cfg.recent_window}"


def recent_step_mean(cfg: MixinConfig) -> str:
    """Record name: mean duration of each step on each rank over the recent window."""
    return f"job_run_operation_step_rank:{sc.METRIC_STEP_DURATION}:mean{cfg.recent_window}"


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
            "record": f"job_run_operation_status:{sc.METRIC_OPERATIONS}:rate{r}",
            "expr": f"sum by ({RUN}, operation, status) (rate({OPERATIONS_TOTAL}{cfg.sel()}[{r}]))",
        },
        {
            "record": f"job_run_operation_le:{sc.METRIC_OPERATION_DURATION}_bucket:rate{r}",
            "expr": f"sum by ({RUN}, operation, le) (rate({sc.METRIC_OPERATION_DURATION}_bucket{cfg.sel()}[{r}]))",
        },
        {
            "record": f"job_run_operation_step_le:{sc.METRIC_STEP_DURATION}_bucket:rate{r}",
            "expr": f"sum by ({RUN}, operation, step, le) (rate({sc.METRIC_STEP_DURATION}_bucket{cfg.sel()}[{r}]))",
        },
        {"record": f"job_run:{sc.METRIC_WRITTEN_BYTES}:rate{r}", "expr": f"sum by ({RUN}) (rate({WRITTEN_TOTAL}{cfg.sel()}[{r}]))"},
        {"record": f"job_run:{sc.METRIC_READ_BYTES}:rate{r}", "expr": f"sum by ({RUN}) (rate({READ_TOTAL}{cfg.sel()}[{r}]))"},
        {"record": f"job_run:{sc.METRIC_ASYNC_IN_FLIGHT}:sum", "expr": f"sum by ({RUN}) ({sc.METRIC_ASYNC_IN_FLIGHT}{cfg.sel()})"},
        {
            "record": recent_operation_mean(cfg),
            "expr": _mean(sc.METRIC_OPERATION_DURATION, f"{RUN}, operation", cfg.recent_window, cfg, success),
        },
        {
            "record": recent_step_mean(cfg),
            "expr": _mean(sc.METRIC_STEP_DURATION, f"{RUN}, operation, step, rank", cfg.recent_window, cfg),
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


def stalled_ranks(cfg: MixinConfig, *matchers: str) -> str:
    """PromQL: each open operation of a rank with no progress past its stall threshold; the value, seconds
    since its last progress. Labels: the run's, ``operation``, ``step`` (``"-"``: between steps), ``rank``, and
    the target's ``instance`` and ``host_name``."""
    # "> 0": in multiprocess mode a finished operation's series reads 0 in the shared files.
    return (f"(time() - ({sc.METRIC_IN_PROGRESS}{cfg.sel(*matchers)} > 0))\n"
            f"> ignoring (step) group_left\n{sc.METRIC_STALL_THRESHOLD}{cfg.sel()}")  # fmt: skip


#: Matchers for the ranks of the alert's run and operation, for ``printf`` in a template (``%q``: a quoted string).
_OF_THIS_CHECKPOINT = f'job=%q,{sc.LABEL_RUN_ID}=%q,operation=%q'
_ITS_LABELS = f"$labels.job $labels.{sc.LABEL_RUN_ID} $labels.operation"


def _template_query(expr: str) -> str:
    """A Go template pipeline running ``expr`` (with ``_OF_THIS_CHECKPOINT``'s placeholders) as a query."""
    return "printf " + '"' + expr.replace("\n", " ").replace('"', '\\"') + '" ' + _ITS_LABELS + " | query"


def alerting_rules(cfg: MixinConfig) -> Rules:
    """The alerts infra teams page on when checkpointing breaks: one per run (and checkpoint), never per rank
    where every rank sees the same thing."""
    upload = f'{sc.LABEL_PHASE}="{sc.PHASE_UPLOAD}"'
    failures = f"{sc.METRIC_FAILURES}_total{cfg.sel()}"
    problems = f"{sc.METRIC_TELEMETRY_PROBLEMS}_total{cfg.sel()}"
    fw = cfg.failure_window
    no_save_s = int(seconds(cfg.no_save_window))
    op_mean, step_mean = recent_operation_mean(cfg), recent_step_mean(cfg)
    io_step_mean = f"{step_mean}{{{IO_STEPS}}}"
    run_of = f"{{{{ $labels.{sc.LABEL_RUN_ID} }}}}"
    waiting_steps = "|".join(sorted(sc.WAITING_STEPS))
    in_step, between = f'step!~"{waiting_steps}"', f'step=~"{waiting_steps}"'
    stuck, waiting = stalled_ranks(cfg, in_step), stalled_ranks(cfg, between)
    # The templates ask Prometheus for the other ranks of the alert's checkpoint (one alert, all its ranks named).
    this = ",".join(m for m in (cfg.selector, _OF_THIS_CHECKPOINT) if m)
    stuck_q = _template_query(f"(time() - ({sc.METRIC_IN_PROGRESS}{{{this},{in_step}}} > 0)) > ignoring (step) "
                              f"group_left {sc.METRIC_STALL_THRESHOLD}{cfg.sel()}")
    waiting_q = _template_query(f"count({sc.METRIC_IN_PROGRESS}{{{this},{between}}} > 0)")
    saves = f"{sc.METRIC_LAST_SUCCESS}{cfg.sel(SAVES)}"
    last_success = f"max_over_time({saves}[{cfg.baseline_window}])"
    alerts = [
        _alert(
            "DCPCheckpointOperationFailed",
            # Counted where each failure started (the rank whose own exception it was, not the ranks that only
            # re-raised torch's CheckpointException): one alert per run, operation, rank and error type.
            # A rank's first failure creates its series already at 1, which increase()
            # cannot see: the second term catches series that are new in the window.
            f"sum by ({RUN}, operation, rank, error_type) (increase({failures}[{fw}])) > 0\n"
            f"or\nsum by ({RUN}, operation, rank, error_type) ({failures} unless {failures} offset {fw}) > 0",
            "0m",
            "warning",
            "A checkpoint {{ $labels.operation }} of run " + run_of + " (job {{ $labels.job }}) failed on rank "
            "{{ $labels.rank }}: {{ $labels.error_type }}.",
            "{{ $value | printf \"%.0f\" }} failed {{ $labels.operation }} checkpoints started on rank "
            "{{ $labels.rank }} with {{ $labels.error_type }} in the last " + fw + ". The checkpoint's trace has "
            "that rank's exception (the dashboards' failure table links to it).",
        ),
        _alert(
            "DCPNoRecentSuccessfulSave",
            # max_over_time keeps the last success known across a restart of the run (torchrun keeps its
            # rendezvous id), whose new processes have no success yet; `up` stops the alert once the run is gone.
            f"time() - max by ({RUN}) (max_over_time({sc.METRIC_LAST_SUCCESS}{cfg.sel(SAVES)}[{cfg.baseline_window}]))"
            f" > {no_save_s}\nand on ({RUN})\n(max by ({RUN}) (up{cfg.sel()}) == 1)",
            "5m",
            "critical",
            "No successful checkpoint save in run " + run_of + " (job {{ $labels.job }}) for over "
            + cfg.no_save_window + ".",
            "The last save (or durable async save) of run " + run_of + " succeeded "
            "{{ $value | humanizeDuration }} ago. A crash now loses all progress since then.",
        ),
        _alert(
            "DCPRecoveryPointTooOld",
            # The run's usual interval between successful saves, from the last-success gauges over the baseline
            # window: (newest - oldest) / changes, per operation and rank; the most frequent kind sets it. A run
            # with fewer than two saves has no interval (DCPNoRecentSuccessfulSave still covers it).
            f"time() - max by ({RUN}) ({last_success})\n"
            f"> on ({RUN}) {cfg.recovery_point_factor:g} * min by ({RUN}) (\n"
            f"  (max_over_time({saves}[{cfg.baseline_window}]) - min_over_time({saves}[{cfg.baseline_window}]))\n"
            f"  / (changes({saves}[{cfg.baseline_window}]) > 0)\n)\n"
            f"and on ({RUN})\n(max by ({RUN}) (up{cfg.sel()}) == 1)",
            "5m",
            "warning",
            "The recovery point of run " + run_of + " (job {{ $labels.job }}) is too old.",
            "The last successful save of run " + run_of + " was {{ $value | humanizeDuration }} ago, over "
            f"{cfg.recovery_point_factor:g}x its usual interval between saves: a crash now loses that much training. "
            "Are saves failing, hanging, or no longer called?",
        ),
        _alert(
            "DCPCheckpointSlow",
            f"{op_mean}\n> {cfg.slow_factor:g} * quantile_over_time(0.5, {op_mean}[{cfg.baseline_window}])\n"
            f"and {op_mean} > {cfg.slow_min_seconds:g}",
            "1m",
            "warning",
            "{{ $labels.operation }} in run " + run_of + " (job {{ $labels.job }}) is much slower than usual.",
            "{{ $labels.operation }} took {{ $value | humanizeDuration }} on average over the last "
            f"{cfg.recent_window}, over {cfg.slow_factor:g}x its median of the last {cfg.baseline_window}.",
        ),
        _alert(
            "DCPStragglerRank",
            f"{io_step_mean}\n> on ({RUN}, operation, step) group_left\n"
            f"{cfg.straggler_factor:g} * quantile by ({RUN}, operation, step) (0.5, {io_step_mean})\n"
            f"and {io_step_mean} > {cfg.straggler_min_seconds:g}",
            "5m",
            "warning",
            "Rank {{ $labels.rank }} of run " + run_of + " (job {{ $labels.job }}) is a straggler in "
            "{{ $labels.step }}.",
            "Rank {{ $labels.rank }} spends {{ $value | humanizeDuration }} in {{ $labels.step }} of "
            "{{ $labels.operation }}, over " + f"{cfg.straggler_factor:g}x the median across ranks "
            f"(mean over {cfg.recent_window}); every other rank waits for it. Check its node's disk and network.",
        ),
        _alert(
            "DCPAsyncSaveStuck",
            f"sum by ({RUN}, rank) (min_over_time({sc.METRIC_ASYNC_IN_FLIGHT}{cfg.sel()}[{cfg.stuck_async_window}])) > 0\n"
            f"unless on ({RUN}, rank)\nsum by ({RUN}, rank) (increase({sc.METRIC_ASYNC_PHASE_DURATION}_count"
            f"{cfg.sel(upload)}[{cfg.stuck_async_window}])) > 0",
            "5m",
            "warning",
            "Async saves of rank {{ $labels.rank }} in run " + run_of + " (job {{ $labels.job }}) are not finishing.",
            "Rank {{ $labels.rank }} has had an async save in flight for over "
            f"{cfg.stuck_async_window} with no upload finished: the checkpoint is not durable yet. "
            "Look at its dcp.async_upload span.",
        ),
        _alert(
            "DCPCheckpointStalled",
            # One alert per run and open operation (one checkpoint), not one per rank: of 1,024 ranks one is stuck
            # in a step and 1,023 wait for it between steps ("-", or an async save's nested "save"), in DCP's
            # collectives. The alert is the stuck
            # rank that has gone longest without progress (labels: its rank, step, host); where every rank waits
            # between steps (the stuck one never reached the collective), the longest-waiting one. Its
            # description names every stuck rank and counts the waiting ones.
            f"topk by ({RUN}, operation) (1,\n{stuck}\n)\n"
            f"or on ({RUN}, operation)\ntopk by ({RUN}, operation) (1,\n{waiting}\n)",
            "0m",
            "critical",
            "Checkpoint {{ $labels.operation }} of run " + run_of + " (job {{ $labels.job }}) is stalled: rank "
            "{{ $labels.rank }} on {{ $labels.host_name }}, step {{ $labels.step }}.",
            "Rank {{ $labels.rank }} ({{ $labels.instance }}) has made no progress in step {{ $labels.step }} for "
            "{{ $value | humanizeDuration }}, past its stall threshold. Stuck in a step: "
            "{{ range " + stuck_q + " }}rank {{ .Labels.rank }} ({{ .Labels.step }}, "
            "{{ .Labels.host_name }}) {{ else }}none (all wait between steps: one rank never reached DCP's "
            "collective) {{ end }}; waiting between steps: "
            "{{ with " + waiting_q + " }}{{ . | first | value }}{{ else }}0"
            "{{ end }} ranks. `dcp-otel status` shows where each rank is; the checkpoint's dcp.stall spans carry "
            "the stuck thread's stack. Every other rank waits until the collective timeout.",
        ),
        _alert(
            "DCPTelemetryProblems",
            # As with failures, a reason's first problem creates its series at 1.
            f"sum by ({RUN}, reason) (increase({problems}[{fw}])) > 0\n"
            f"or\nsum by ({RUN}, reason) ({problems} unless {problems} offset {fw}) > 0",
            "0m",
            "warning",
            "dcp-otel dropped or failed to record telemetry in run " + run_of + " (job {{ $labels.job }}, "
            "{{ $labels.reason }}).",
            "{{ $value | printf \"%.0f\" }} times in the last " + fw + ", reason "
            "{{ $labels.reason }} (span_queue_full: the span exporter is slow, down or hung). Checkpoints are "
            "unaffected, but traces or metrics may be incomplete. Each rank logs one warning a minute per reason.",
        ),
    ]
    return {"groups": [{"name": "dcp-otel.alerts", "rules": alerts}]}
