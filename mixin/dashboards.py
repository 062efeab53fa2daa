"""The Grafana dashboards, built with grafana-foundation-sdk from :class:`MixinConfig`.

Three dashboards, linked to each other: **Checkpoints** (is checkpointing
healthy, how long, how many bytes), **Ranks** (which rank is slow) and
**torchelastic agent** (rendezvous, restarts, run results). Each has variables
for the datasource and the job (and the rank and step where it helps); duration
panels show exemplars, which the provisioned Prometheus datasource links to the
checkpoint's trace. Metric names come from :mod:`dcp_otel.semconv`.

Usage::

    from mixin.config import MixinConfig
    from mixin.dashboards import dashboards

    for filename, model in dashboards(MixinConfig()).items():
        ...  # model: the dashboard's JSON as a dict
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from grafana_foundation_sdk.builders import bargauge, heatmap, stat, table, timeseries
from grafana_foundation_sdk.builders.dashboard import (
    AnnotationQuery,
    Dashboard,
    DashboardLink,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import BigValueColorMode, GraphDrawStyle, LineInterpolation, VisibilityMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    DataTransformerConfig,
    DynamicConfigValue,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from dcp_otel import semconv as sc
from mixin.config import MixinConfig, seconds
from mixin.rules import IO_STEPS, OPERATIONS_TOTAL, READ_TOTAL, RUN, SAVES, WRITTEN_TOTAL

#: The Grafana version the SDK targets (its package version; see pyproject's pin).
GRAFANA_TARGET = "11.6"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
TAG = "dcp-otel"
RATE = "$__rate_interval"
RANGE = "$__range"
#: Every series of a panel says its run in its legend (a Prometheus may hold many side by side), last: what tells
#: the series of one run apart comes first.
RUN_LEGEND = "{{" + sc.LABEL_RUN_ID + "}}"

Panel = Any  # an SDK panel builder


def _query(expr: str, legend: str = "", *, exemplar: bool = False, instant: bool = False, fmt: str = "") -> Dataquery:
    q = Dataquery().expr(expr).datasource(DATASOURCE).exemplar(exemplar)
    if legend:
        q = q.legend_format(legend)
    q = q.instant() if instant else q.range()
    if fmt:
        q = q.format(PromQueryFormat(fmt))
    return q


def _ref_ids(panel: Panel, queries: list[Dataquery]) -> Panel:
    for ref, q in zip("ABCDEFGH", queries, strict=False):
        panel = panel.with_target(q.ref_id(ref))
    return panel


def _timeseries(title: str, unit: str, description: str, *queries: Dataquery, w: int = 12, h: int = 8) -> Panel:
    panel = timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE).span(w).height(h)
    return _ref_ids(panel, list(queries))


def thresholds(base: str, *steps: tuple[float, str]) -> ThresholdsConfig:
    """Absolute thresholds: ``base`` below the first step, then each ``(value, colour)`` from its value up."""
    return ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
        [Threshold(None, base), *(Threshold(value, colour) for value, colour in steps)])


#: A figure that is neither good nor bad (a size): one neutral colour, and the stat not coloured by it.
NEUTRAL = thresholds("text")


def _stat(title: str, unit: str, description: str, query: Dataquery, limits: ThresholdsConfig, w: int = 6,
          h: int = 4, no_value: str = "") -> Panel:  # fmt: skip
    # Every stat says what its colours mean: Grafana's default (red from 80) means nothing for any of ours.
    panel = (stat.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE).span(w).height(h)
             .thresholds(limits))  # fmt: skip
    if limits is NEUTRAL:
        panel = panel.color_mode(BigValueColorMode.NONE)
    if no_value:
        panel = panel.no_value(no_value)
    return _ref_ids(panel, [query])


def _trend(title: str, unit: str, description: str, *queries: Dataquery, w: int = 12, h: int = 8) -> Panel:
    """A value held between events (a gauge set once per checkpoint): drawn as steps, with points."""
    return (_timeseries(title, unit, description, *queries, w=w, h=h).draw_style(GraphDrawStyle.LINE)
            .line_interpolation(LineInterpolation.STEP_AFTER).show_points(VisibilityMode.ALWAYS))  # fmt: skip


def _table(title: str, unit: str, description: str, *queries: Dataquery, w: int = 12, h: int = 8) -> Panel:
    panel = table.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE).span(w).height(h)
    # An instant query's table: one row per series; its time column says nothing.
    panel = panel.with_transformation(DataTransformerConfig(id_val="organize", options={"excludeByName": {"Time": True}}))
    return _ref_ids(panel, list(queries))


def _bars(title: str, unit: str, description: str, query: Dataquery, w: int = 12, h: int = 8) -> Panel:
    panel = bargauge.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE).span(w).height(h)
    return _ref_ids(panel, [query])


def _variables(cfg: MixinConfig, job_metric: str, *, rank: bool, step: bool) -> list[Any]:
    job, run = 'job=~"$job"', f'{sc.LABEL_RUN_ID}=~"$run"'
    variables: list[Any] = [
        DatasourceVariable("datasource").label("Data source").type("prometheus"),
        _label_variable("job", "Job", f"label_values({job_metric}{cfg.sel()}, job)"),
        # "All" takes series without a run too (a static scrape config, an agent pushing OTLP without the run
        # on its resource): each is then a run of its own, "".
        _label_variable("run", "Run", f"label_values({job_metric}{cfg.sel(job)}, {sc.LABEL_RUN_ID})", all_value=".*"),
    ]
    if rank:
        variables.append(_label_variable("rank", "Rank", f"label_values({OPERATIONS_TOTAL}{cfg.sel(job, run)}, rank)"))
    if step:
        variables.append(
            _label_variable("step", "Step", f"label_values({sc.METRIC_STEP_DURATION}_count{cfg.sel(job, run)}, step)")
        )
    return variables


def _label_variable(name: str, label: str, query: str, all_value: str = ".+") -> QueryVariable:
    return (
        QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.NATURAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(all_value)
    )


def _dashboard(cfg: MixinConfig, uid: str, title: str, description: str, variables: list[Any]) -> Dashboard:
    # One click between the three: a dropdown of every dcp-otel dashboard, keeping time and variables.
    siblings = (
        DashboardLink("dcp-otel")
        .type(DashboardLinkType.DASHBOARDS)
        .tags([TAG])
        .as_dropdown(True)
        .include_vars(True)
        .keep_time(True)
    )
    return (
        Dashboard(title)
        .uid(uid)
        .description(description)
        .tags([TAG])
        .time("now-6h", "now")
        .refresh("30s")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .link(siblings)
        .link(traces_link(cfg))
        .variables(variables)
    )


def explore_url(cfg: MixinConfig, tempo: str, jaeger: dict[str, str], start: str, end: str) -> str:
    """A Grafana Explore URL on the trace datasource: the TraceQL query ``tempo`` (Tempo) or the search
    ``jaeger`` (Jaeger: service, operation, tags), from ``start`` to ``end``. Grafana's ``${...}`` variables
    stay as they are, for Grafana to fill in when the link is followed."""
    query: dict[str, Any] = {"refId": "A", "datasource": {"type": cfg.traces_datasource_type,
                                                          "uid": cfg.traces_datasource_uid}}  # fmt: skip
    if cfg.traces_datasource_type == "tempo":
        query |= {"queryType": "traceql", "query": tempo}
    else:
        query |= {"queryType": "search", **jaeger}
    pane = {"datasource": cfg.traces_datasource_uid, "queries": [query], "range": {"from": start, "to": end}}
    return "/explore?schemaVersion=1&panes=" + urllib.parse.quote(
        json.dumps({"traces": pane}, separators=(",", ":")), safe="${}:,._-")


def traces_link(cfg: MixinConfig) -> DashboardLink:
    """"Checkpoint traces": Explore on the trace datasource, over the dashboard's time range, on the
    checkpoints of the selected runs (Tempo: TraceQL, every run; Jaeger searches one service: select one job)."""
    tempo = f'{{ name = "{sc.SPAN_CHECKPOINT}" && .{sc.ATTR_RUN_ID} =~ "${{run:regex}}" }}'
    jaeger = {"service": "${job}", "operation": sc.SPAN_CHECKPOINT}
    return (
        DashboardLink("Checkpoint traces")
        .type(DashboardLinkType.LINK)
        .url(explore_url(cfg, tempo, jaeger, "${__from}", "${__to}"))
        .icon("external link")
        .tooltip(f"The checkpoints' traces in {cfg.traces_datasource_type.capitalize()}")
        .target_blank(True)
    )


#: TraceQL: every checkpoint's root span (docs/receiving-stack.md has more).
TRACEQL_CHECKPOINTS = f'{{ name = "{sc.SPAN_CHECKPOINT}" }}'
#: "Where each rank is now": the hidden column of when each rank last made progress (Unix ms).
SINCE_MS = "since_ms"
#: A table row's fields, as a data link reads them.
_ROW_RUN, _ROW_RANK, _ROW_JOB = (f"${{__data.fields.{name}}}" for name in (sc.LABEL_RUN_ID, "rank", "job"))


def failure_trace_link(cfg: MixinConfig) -> DashboardLink:
    """From a row of the failures table: the failed checkpoints of that run whose exception started on that rank,
    over the dashboard's time range (the table counts the failures in it)."""
    tempo = f'{{ .{sc.ATTR_RUN_ID} = "{_ROW_RUN}" && .{sc.ATTR_RANK} = {_ROW_RANK} && status = error }}'
    jaeger = {"service": _ROW_JOB, "tags": f"{sc.ATTR_RUN_ID}={_ROW_RUN} {sc.ATTR_RANK}={_ROW_RANK} error=true"}
    return (DashboardLink("Trace of this failure").url(explore_url(cfg, tempo, jaeger, "${__from}", "${__to}"))
            .target_blank(True))  # fmt: skip


def stall_trace_link(cfg: MixinConfig) -> DashboardLink:
    """From a row of "Where each rank is now": that run's checkpoint with this rank's stall reports (their
    ``dcp.stall`` spans leave at once, with the stuck thread's stack), from its last progress to now."""
    tempo = f'{{ .{sc.ATTR_RUN_ID} = "{_ROW_RUN}" }} && {{ name = "{sc.SPAN_STALL}" && .{sc.ATTR_RANK} = {_ROW_RANK} }}'
    jaeger = {"service": _ROW_JOB, "operation": sc.SPAN_STALL, "tags": f"{sc.ATTR_RANK}={_ROW_RANK}"}
    start = f"${{__data.fields.{SINCE_MS}}}"  # when the rank last made progress: its stall reports came after
    return DashboardLink("Stall reports of this rank").url(explore_url(cfg, tempo, jaeger, start, "now")).target_blank(True)


def marks(cfg: MixinConfig) -> list[dict[str, Any]]:
    """Marks on every time panel: failures (where each started, and its error type), stall reports and worker
    restarts of the selected runs. Each is a Prometheus query evaluated per minute."""
    sel = cfg.sel('job=~"$job"', f'{sc.LABEL_RUN_ID}=~"$run"')
    restart = cfg.sel('job=~"$job"', f'{sc.LABEL_RUN_ID}=~"$run"', 'name=~".*_restart_workers"')
    queries = [
        ("Checkpoint failures", "red",
         f"sum by ({RUN}, operation, rank, error_type) (increase({sc.METRIC_FAILURES}_total{sel}[1m])) > 0",
         "{{operation}} failed", "run {{" + sc.LABEL_RUN_ID + "}}: rank {{rank}} raised {{error_type}}",
         f"{sc.LABEL_RUN_ID},operation,rank,error_type"),
        ("Stall reports", "orange",
         f"sum by ({RUN}, operation, step, rank) (increase({sc.METRIC_STALLS}_total{sel}[1m])) > 0",
         "{{operation}} stalled", "run {{" + sc.LABEL_RUN_ID + "}}: rank {{rank}} in {{step}}",
         f"{sc.LABEL_RUN_ID},operation,rank,step"),
        ("Worker restarts", "blue",
         f"sum by ({RUN}) (increase({sc.METRIC_ELASTIC_CALLS}_total{restart}[1m])) > 0",
         "workers restarted", "run {{" + sc.LABEL_RUN_ID + "}}", sc.LABEL_RUN_ID),
    ]
    found = []
    for name, colour, expr, title, text, tags in queries:
        mark = json.loads(json.dumps(AnnotationQuery().name(name).datasource(DATASOURCE).expr(expr).enable(True)
                                     .icon_color(colour).build(), cls=JSONEncoder))  # fmt: skip
        # What the SDK has no builder for: Prometheus annotations' step and how a mark is worded.
        mark |= {"step": "1m", "titleFormat": title, "textFormat": text, "tagKeys": tags, "useValueForTime": False}
        found.append(mark)
    return found


def _with_ids(built: Any, annotated: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The dashboard as JSON, with every panel (rows and their panels too) numbered from 1, and its marks."""
    model: dict[str, Any] = json.loads(json.dumps(built, cls=JSONEncoder))
    next_id = 1
    for panel in model["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            p["id"] = next_id
            next_id += 1
    if annotated:
        model.setdefault("annotations", {}).setdefault("list", []).extend(annotated)
    return model


def checkpoints(cfg: MixinConfig) -> dict[str, Any]:
    """Is checkpointing healthy: rates, failures, durations, bytes, async saves, age of the last success."""
    def s(*m: str) -> str:
        return cfg.sel('job=~"$job"', f'{sc.LABEL_RUN_ID}=~"$run"', 'rank=~"$rank"', *m)

    op_dur, step_dur = sc.METRIC_OPERATION_DURATION, sc.METRIC_STEP_DURATION
    failed = f'{sc.LABEL_STATUS}="{sc.STATUS_FAILURE}"'
    success = f'{sc.LABEL_STATUS}="{sc.STATUS_SUCCESS}"'
    write, read = f'{sc.LABEL_STEP}="write_data"', f'{sc.LABEL_STEP}="read_data"'
    R = RUN_LEGEND
    no_save_s = seconds(cfg.no_save_window)
    # Shares of wall time (seconds per second) per rank, over the blocked window: what checkpointing cost training.
    blocked = f"sum by ({RUN}, rank) (rate({sc.METRIC_TRAINING_BLOCKED}_total{s()}[{cfg.blocked_window}]))"
    interference = f"sum by ({RUN}, rank) (rate({sc.METRIC_TRAINING_INTERFERENCE}_total{s()}[{cfg.blocked_window}]))"
    # Steps are observed as checkpoints are built, in bursts: over the same long window, not a rate interval.
    step_time = (f"histogram_quantile(0.5, sum by ({RUN}, {sc.LABEL_OVERLAPS}, le) "
                 f"(increase({sc.METRIC_TRAINING_STEP}_bucket{s()}[{cfg.blocked_window}])))")  # fmt: skip

    def quantile(q: str, metric: str, by: str, extra: str = "") -> str:
        return (f"histogram_quantile({q}, sum by ({RUN}, {by}, le) "
                f"(rate({metric}_bucket{s(extra) if extra else s()}[{RATE}])))")  # fmt: skip

    d = _dashboard(
        cfg, cfg.checkpoints_uid, "dcp-otel / Checkpoints",
        "PyTorch Distributed Checkpoint: is checkpointing healthy? Every figure is per run. Click an exemplar for "
        "the checkpoint's trace.",
        _variables(cfg, OPERATIONS_TOTAL, rank=True, step=False),
    )  # fmt: skip
    failures = _table(
        "Where failures started", "short",
        "Failed checkpoint operations, counted on the rank whose own exception it was (not on the ranks that only "
        "re-raised torch's CheckpointException), by run, operation, rank and error type; since each rank started. "
        "Each row links to the traces of its failures.",
        _query(f"sort_desc(sum by ({RUN}, operation, rank, error_type) "
               f"(max_over_time({sc.METRIC_FAILURES}_total{s()}[{RANGE}])))", instant=True, fmt="table"), w=24)
    d = (
        d.with_row(Row("Now"))
        .with_panel(_stat(
            "Since the last successful save", "s",
            "Per run: time since the last save or durable async save succeeded on any selected rank. Orange from "
            f"half of the no-save alert's window ({cfg.no_save_window}), red from it: a crash now would lose that much "
            "training.",
            _query(f"time() - max by ({RUN}) ({sc.METRIC_LAST_SUCCESS}{s(SAVES)})", R, instant=True),
            thresholds("green", (no_save_s / 2, "orange"), (no_save_s, "red"))))
        .with_panel(_stat(
            "Failed checkpoints", "short",
            "Per run: checkpoint operations that failed in the time range (each counted once, however many ranks it "
            "failed on). Red from one: a failed checkpoint is not there to restart from.",
            _query(f"sum by ({RUN}) (max by ({RUN}, operation) (increase({OPERATIONS_TOTAL}{s(failed)}[{RANGE}])))",
                   R, instant=True),
            thresholds("green", (1, "red"))))
        .with_panel(_stat(
            "Async saves in flight (most on one rank)", "short",
            "Per run, the rank with the most async saves handed off and not yet durable. 1 is the normal overlap "
            "with training; orange from 2: a save began before the last one was durable (uploads fall behind).",
            _query(f"max by ({RUN}) ({sc.METRIC_ASYNC_IN_FLIGHT}{s()})", R, instant=True),
            thresholds("green", (2, "orange"))))
        .with_panel(_stat(
            "Bytes written", "bytes",
            "Per run: bytes all selected ranks wrote to checkpoint storage in the time range. A size, neither good "
            "nor bad: not coloured.",
            _query(f"sum by ({RUN}) (increase({WRITTEN_TOTAL}{s()}[{RANGE}]))", R, instant=True), NEUTRAL))
        .with_row(Row("Failures"))
        .with_panel(failures.data_links([failure_trace_link(cfg)]))
        .with_row(Row("Operations"))
        .with_panel(_trend(
            "Duration of each checkpoint", "s",
            "Per run and operation, the slowest selected rank's last successful operation, held until the next one: "
            "every checkpoint is a step, however far apart they are (hourly checkpoints too), and exact (no histogram "
            "buckets). Is checkpointing getting slower?",
            _query(f"max by ({RUN}, operation) ({sc.METRIC_LAST_DURATION}{s(success)})", "{{operation}} (" + R + ")"), w=24))
        .with_panel(_timeseries(
            "Training time lost to checkpointing", "percentunit",
            f"Per run, over the last {cfg.blocked_window}, the share of wall time the most affected rank's training "
            "lost to checkpointing: blocked, its training thread inside checkpoint calls (a save whole, an async "
            "save until it returned, a load); interference, its training steps slower than usual while an async "
            "save's upload ran beside them (steps told by torch's optimizer hook; 0 within noise); and the two "
            "together. It leaves out a copy to the host done in your own code before the call.",
            _query(f"max by ({RUN}) (({blocked} + {interference}) or {blocked})", "lost (" + R + ")"),
            _query(f"max by ({RUN}) ({blocked})", "blocked (" + R + ")"),
            _query(f"max by ({RUN}) ({interference})", "interference (" + R + ")"), w=12))
        .with_panel(_timeseries(
            "Training step time, beside a checkpoint or not", "s",
            "Per run, the median training step (one optimizer step to the next, time blocked in checkpoint calls "
            "left out) of the selected ranks: steps that an async save's background work overlapped against the "
            "others. Steps are counted as each checkpoint is built; an exemplar opens the checkpoint beside them.",
            _query(step_time, "p50 overlaps {{overlaps}} (" + R + ")", exemplar=True), w=12))
        .with_panel(_timeseries(
            "Operations by status", "ops",
            "Checkpoint operations finished per second on the selected ranks, by run, operation and status.",
            _query(f"sum by ({RUN}, operation, status) (rate({OPERATIONS_TOTAL}{s()}[{RATE}]))",
                   "{{operation}} {{status}} (" + R + ")")))
        .with_panel(_timeseries(
            "Operation duration", "s",
            "p50 and p95 from the histogram (interpolated within its buckets); max: the slowest rank's mean. Empty "
            "between checkpoints further apart than the rate window: see \"Duration of each checkpoint\". Exemplars "
            "link to traces.",
            _query(quantile("0.5", op_dur, "operation"), "p50 {{operation}} (" + R + ")", exemplar=True),
            _query(quantile("0.95", op_dur, "operation"), "p95 {{operation}} (" + R + ")", exemplar=True),
            _query(f"max by ({RUN}, operation) (rate({op_dur}_sum{s()}[{RATE}]) / rate({op_dur}_count{s()}[{RATE}]) > 0)",
                   "max {{operation}} (" + R + ")")))
        .with_panel(_timeseries(
            "Step duration p95", "s", "p95 of each step of each operation (write_data, read_data, planning...).",
            _query(quantile("0.95", step_dur, "operation, step"), "{{operation}} {{step}} (" + R + ")", exemplar=True), w=8))
        .with_panel(_timeseries(
            "Step duration p50", "s", "p50 of each step of each operation.",
            _query(quantile("0.5", step_dur, "operation, step"), "{{operation}} {{step}} (" + R + ")", exemplar=True), w=8))
        .with_panel(_timeseries(
            "Step duration max", "s", "Each step's slowest rank (its mean per call): the Ranks dashboard says which.",
            _query(f"max by ({RUN}, operation, step) (rate({step_dur}_sum{s()}[{RATE}]) / "
                   f"rate({step_dur}_count{s()}[{RATE}]) > 0)", "{{operation}} {{step}} (" + R + ")"), w=8))
        .with_row(Row("Bytes"))
        .with_panel(_timeseries(
            "Bytes per second", "Bps", "Checkpoint bytes written and read per second, all selected ranks of each run.",
            _query(f"sum by ({RUN}) (rate({WRITTEN_TOTAL}{s()}[{RATE}]))", "written (" + R + ")"),
            _query(f"sum by ({RUN}) (rate({READ_TOTAL}{s()}[{RATE}]))", "read (" + R + ")")))
        .with_panel(_timeseries(
            "Storage throughput while writing / reading", "Bps",
            "Bytes per second of time spent in write_data / read_data: what the storage delivers.",
            _query(f"sum by ({RUN}) (rate({WRITTEN_TOTAL}{s()}[{RATE}])) / "
                   f"(sum by ({RUN}) (rate({step_dur}_sum{s(write)}[{RATE}])) > 0)", "write (" + R + ")"),
            _query(f"sum by ({RUN}) (rate({READ_TOTAL}{s()}[{RATE}])) / "
                   f"(sum by ({RUN}) (rate({step_dur}_sum{s(read)}[{RATE}])) > 0)", "read (" + R + ")")))
        .with_row(Row("Async saves"))
        .with_panel(_timeseries(
            "Async save phases p95", "s", "Staging (blocks training) and upload (until durable).",
            _query(quantile("0.95", sc.METRIC_ASYNC_PHASE_DURATION, "phase"), "{{phase}} (" + R + ")", exemplar=True)))
        .with_panel(_timeseries(
            "Bytes staged per second", "Bps",
            "What async saves copied out of the state dict (the copy that blocks training), by the device it came from.",
            _query(f"sum by ({RUN}, device) (rate({sc.METRIC_STAGED_BYTES}_total{s()}[{RATE}]))", "{{device}} (" + R + ")")))
        .with_panel(_timeseries(
            "Async saves in flight", "short",
            f"Per rank, the {cfg.per_rank_limit} ranks with the most in flight in each run; one that stays up means "
            "an upload that does not finish.",
            _query(f"topk by ({RUN}) ({cfg.per_rank_limit}, sum by ({RUN}, rank) ({sc.METRIC_ASYNC_IN_FLIGHT}{s()}))",
                   "rank {{rank}} (" + R + ")")))
        .with_panel(_timeseries(
            "Age of the last successful checkpoint", "s",
            "Per run and operation: how much progress a crash would lose.",
            _query(f"time() - max by ({RUN}, operation) ({sc.METRIC_LAST_SUCCESS}{s()})", "{{operation}} (" + R + ")")))
        .with_row(Row("dcp-otel itself"))
        .with_panel(_stat(
            "Telemetry problems", "short",
            "What dcp-otel dropped or failed to record on the selected ranks since they started, by run and reason "
            "(span_queue_full: the span exporter is slow, down or hung). Checkpoints are unaffected; orange from one: "
            "traces or metrics may be incomplete.",
            _query(f"sum by ({RUN}, reason) (max_over_time({sc.METRIC_TELEMETRY_PROBLEMS}_total{s()}[{RANGE}]))",
                   "{{reason}} (" + R + ")", instant=True),
            thresholds("green", (1, "orange")), w=24, no_value="0"))
    )  # fmt: skip
    return _with_ids(d.build(), marks(cfg))


def ranks(cfg: MixinConfig) -> dict[str, Any]:
    """Which rank is slow: per-rank step durations, the top-k slowest, collective wait per rank."""
    def s(*m: str) -> str:
        return cfg.sel('job=~"$job"', f'{sc.LABEL_RUN_ID}=~"$run"', 'rank=~"$rank"', *m)

    step_dur, wait = sc.METRIC_STEP_DURATION, sc.METRIC_COLLECTIVE_WAIT
    steps = 'step=~"$step"'
    R, k, rows = RUN_LEGEND, cfg.per_rank_limit, cfg.per_rank_rows

    def mean(metric: str, by: str, window: str, *m: str) -> str:
        return (f"sum by ({RUN}, {by}) (increase({metric}_sum{s(*m)}[{window}])) / "
                f"(sum by ({RUN}, {by}) (increase({metric}_count{s(*m)}[{window}])) > 0)")  # fmt: skip

    io_mean = mean(step_dur, "rank", RANGE, IO_STEPS)
    d = _dashboard(
        cfg, cfg.ranks_uid, "dcp-otel / Ranks",
        "Which rank makes the checkpoint slow? Every rank waits for the slowest one in each collective step. "
        f"Per-rank panels show the {k} worst ranks of each run; pick ranks with the Rank variable.",
        _variables(cfg, OPERATIONS_TOTAL, rank=True, step=True),
    )  # fmt: skip
    in_progress = f"({sc.METRIC_IN_PROGRESS}{s()} > 0)"  # (0 in multiprocess files: ended)
    where_now = (
        table.Panel().title("Where each rank is now").unit("s").datasource(DATASOURCE).span(16).height(8)
        .description("Every open checkpoint operation: its run, rank, host, operation and innermost open step (\"-\": "
                     "between steps, in DCP's collectives) and how long since it last made progress, the oldest "
                     f"first ({rows} per run at most). A rank stuck in a step while the others sit at \"-\" is the one "
                     "they wait for. Each row links to its stall reports (with the stuck thread's stack); "
                     "`dcp-otel status` prints the same from the ranks.")
        # A: how long without progress; B: since when (ms, hidden), the start of each row's trace link. The same
        # rows (the oldest are the smallest timestamps), merged on their labels into one row each.
        .with_target(_query(f"sort_desc(topk by ({RUN}) ({rows}, time() - {in_progress}))", instant=True,
                            fmt="table").ref_id("A"))
        .with_target(_query(f"bottomk by ({RUN}) ({rows}, 1000 * {in_progress})", instant=True,
                            fmt="table").ref_id("B"))
        .with_transformation(DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(DataTransformerConfig(id_val="organize", options={
            "excludeByName": {"Time": True},
            "renameByName": {"Value #A": "seconds without progress", "Value #B": SINCE_MS}}))
        .override_by_name(SINCE_MS, [DynamicConfigValue(id_val="custom.hidden", value=True)])
        .data_links([stall_trace_link(cfg)])
    )  # fmt: skip
    d = (
        d.with_row(Row("Now"))
        .with_panel(where_now)
        .with_panel(_stat(
            "Ranks stalled now", "short",
            "Per run: open operations with no progress for longer than their stall threshold (DCPCheckpointStalled). "
            "Red from one: that checkpoint will not finish by itself.",
            _query(f"count by ({RUN}) ((time() - {in_progress}) > ignoring (step) group_left "
                   f"{sc.METRIC_STALL_THRESHOLD}{s()})", R, instant=True),
            thresholds("green", (1, "red")), w=8, no_value="0"))
        .with_panel(_timeseries(
            "Stall reports", "short",
            f"DCP calls reported stalled (the watchdog counts each stall once), by rank and step; {k} per run at most.",
            _query(f"topk by ({RUN}) ({k}, sum by ({RUN}, rank, operation, step) "
                   f"(increase({sc.METRIC_STALLS}_total{s()}[{RATE}])))", "rank {{rank}} {{operation}} {{step}} (" + R + ")"),
            w=8, h=4))
        .with_row(Row("Stragglers"))
        .with_panel(_bars(
            "Top 5 slowest ranks in write_data / read_data", "s",
            "Per run, mean time per call in the steps that move the bytes, over the time range.",
            _query(f"topk by ({RUN}) (5, {io_mean})", "rank {{rank}} (" + R + ")", instant=True)))
        .with_panel(_bars(
            "Skew: slowest rank / median rank", "none",
            "Per step, over the time range: 1 is perfectly even; the straggler alert fires above its factor.",
            _query(f"max by ({RUN}, operation, step) ({mean(step_dur, 'operation, step, rank', RANGE, steps)}) / "
                   f"quantile by ({RUN}, operation, step) (0.5, {mean(step_dur, 'operation, step, rank', RANGE, steps)})",
                   "{{operation}} {{step}} (" + R + ")", instant=True)))
        .with_panel(_table(
            "Mean step duration per rank", "s",
            f"Over the time range, the {rows} slowest rank and step pairs of each run; sort by Value.",
            _query(f"topk by ({RUN}) ({rows}, {mean(step_dur, 'operation, step, rank', RANGE, steps)})", instant=True,
                   fmt="table"), w=24))
        .with_row(Row("Over time"))
        .with_panel(_timeseries(
            "Step duration per rank", "s", f"Mean per call of the selected steps: the {k} slowest ranks of each run.",
            _query(f"topk by ({RUN}) ({k}, {mean(step_dur, 'rank, step', RATE, steps)})", "rank {{rank}} {{step}} (" + R + ")")))
        .with_panel(_timeseries(
            "Collective wait per rank", "s",
            "Operation time not covered by the rank's own steps: waiting for the others. "
            f"The straggler is the rank that waits least: the {k} that wait least in each run.",
            _query(f"bottomk by ({RUN}) ({k}, {mean(wait, 'rank', RATE)})", "rank {{rank}} (" + R + ")")))
        .with_panel(heatmap.Panel()
            .title("Step duration distribution").unit("s").datasource(DATASOURCE).span(24).height(8)
            .description("How often the selected steps took how long, all selected ranks (histogram buckets), per run. "
                         "Exemplars link to the traces of the checkpoints in each bucket.")
            .calculate(False)
            .with_target(_query(f"sum by ({RUN}, le) (increase({step_dur}_bucket{s(steps)}[{RATE}]))", "{{le}}",
                                exemplar=True, fmt="heatmap").ref_id("A")))
    )  # fmt: skip
    return _with_ids(d.build(), marks(cfg))


def torchelastic(cfg: MixinConfig) -> dict[str, Any]:
    """The torchelastic agent: rendezvous durations, worker restarts, run results (from OTelMetricHandler)."""
    def s(*m: str) -> str:
        return cfg.sel('job=~"$job"', f'{sc.LABEL_RUN_ID}=~"$run"', *m)

    dur, calls = sc.METRIC_ELASTIC_DURATION, sc.METRIC_ELASTIC_CALLS + "_total"
    events, last = sc.METRIC_ELASTIC_EVENTS + "_total", sc.METRIC_ELASTIC_LAST_VALUE
    dropped = sc.METRIC_ELASTIC_DROPPED + "_total"
    R = RUN_LEGEND
    d = _dashboard(
        cfg, cfg.agent_uid, "dcp-otel / torchelastic agent",
        "torchelastic's own metrics, through dcp-otel's OTelMetricHandler (dcp-otel-run serves the agent's), per run.",
        _variables(cfg, calls, rank=False, step=False),
    )  # fmt: skip
    # PromQL strings: "\\." is a regex's literal dot.
    rendezvous, restart = 'name=~".*_rendezvous"', 'name=~".*_restart_workers"'
    restarts_left = r'name=~"workers\\..*\\.remaining_restarts"'
    run_results = r'name=~"workers\\..*\\.run_.*"'
    states = r'name=~"workers\\..*\\.(healthy|unhealthy|failed|succeeded)"'
    d = (
        d.with_row(Row("Agent"))
        .with_panel(_bars(
            "Rendezvous duration", "s", "Mean duration of the agent's rendezvous (at start and at every restart).",
            _query(f"sum by ({RUN}, name) ({dur}_sum{s(rendezvous)}) / sum by ({RUN}, name) ({dur}_count{s(rendezvous)})",
                   "{{name}} (" + R + ")", instant=True)))
        .with_panel(_stat(
            "Worker restarts left", "short",
            "Per run, remaining_restarts of the worker group: red at 0 (the next failure ends the job), orange at 1.",
            _query(f"min by ({RUN}) ({last}{s(restarts_left)})", R, instant=True),
            thresholds("red", (1, "orange"), (2, "green"))))
        .with_panel(_stat(
            "Worker group restarts", "short",
            "Per run, times the agent restarted its workers (latest count in the time range). Orange from one: "
            "the work since the last checkpoint was lost that many times.",
            _query(f"sum by ({RUN}) (max_over_time({calls}{s(restart)}[{RANGE}]))", R, instant=True),
            thresholds("green", (1, "orange")), no_value="0"))
        .with_panel(_table(
            "Run results", "short", "Per run and role: runs that succeeded or failed, with or without retries.",
            _query(f"sum by ({RUN}, name) ({events}{s(run_results)})", "{{name}}", instant=True, fmt="table")))
        .with_panel(_table(
            "Agent calls", "s", "Every profiled agent function: mean duration.",
            _query(f"sum by ({RUN}, group, name) ({dur}_sum{s()}) / sum by ({RUN}, group, name) ({dur}_count{s()})",
                   "{{name}}", instant=True, fmt="table")))
        .with_panel(_timeseries(
            "Worker group states", "short", "How often the agent's monitor saw each state (healthy, failed, ...).",
            _query(f"sum by ({RUN}, name) (increase({events}{s(states)}[{RATE}]))", "{{name}} (" + R + ")")))
        .with_panel(_timeseries(
            "Calls by status", "ops", "Profiled agent and trainer calls per second, by result.",
            _query(f"sum by ({RUN}, name, status) (rate({calls}{s()}[{RATE}]))", "{{name}} {{status}} (" + R + ")")))
        .with_panel(_stat(
            "Dropped metrics", "short",
            "Metrics OTelMetricHandler refused (bad values, too many names), by run and reason. Orange from one: "
            "some agent metrics are missing.",
            _query(f"sum by ({RUN}, reason) (max_over_time({dropped}{s()}[{RANGE}]))", "{{reason}} (" + R + ")", instant=True),
            thresholds("green", (1, "orange")), w=12, no_value="0"))
    )  # fmt: skip
    return _with_ids(d.build(), marks(cfg))


def dashboards(cfg: MixinConfig) -> dict[str, dict[str, Any]]:
    """``{file name: dashboard JSON}`` of every dashboard."""
    return {
        "dcp-otel-checkpoints.json": checkpoints(cfg),
        "dcp-otel-ranks.json": ranks(cfg),
        "dcp-otel-torchelastic.json": torchelastic(cfg),
    }


def panels(model: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel of a dashboard JSON, rows' panels included (rows themselves excluded)."""
    found = []
    for panel in model.get("panels", []):
        nested = panel.get("panels", [])
        if panel.get("type") != "row":
            found.append(panel)
        found.extend(nested)
    return found


def render_expr(expr: str, variables: dict[str, str], *, rate_interval: str, time_range: str) -> str:
    """``expr`` as Grafana sends it: variables (``$job``, ``${job}``) and the interval macros substituted."""
    out = expr.replace("$__rate_interval", rate_interval).replace("$__range", time_range)
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):  # $rank before $r...
        out = out.replace("${" + name + "}", value).replace("$" + name, value)
    return out
