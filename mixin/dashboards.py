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
    Dashboard,
    DashboardLink,
    DatasourceVariable,
    QueryVariable,
    Row,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    DataTransformerConfig,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from dcp_otel import semconv as sc
from mixin.config import MixinConfig
from mixin.rules import IO_STEPS, OPERATIONS_TOTAL, READ_TOTAL, SAVES, WRITTEN_TOTAL

#: The Grafana version the SDK targets (its package version; see pyproject's pin).
GRAFANA_TARGET = "11.6"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
TAG = "dcp-otel"
RATE = "$__rate_interval"
RANGE = "$__range"

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


def _stat(title: str, unit: str, description: str, query: Dataquery, w: int = 6, h: int = 4) -> Panel:
    panel = stat.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE).span(w).height(h)
    return _ref_ids(panel, [query])


def _table(title: str, unit: str, description: str, *queries: Dataquery, w: int = 12, h: int = 8) -> Panel:
    panel = table.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE).span(w).height(h)
    # An instant query's table: one row per series; its time column says nothing.
    panel = panel.with_transformation(DataTransformerConfig(id_val="organize", options={"excludeByName": {"Time": True}}))
    return _ref_ids(panel, list(queries))


def _bars(title: str, unit: str, description: str, query: Dataquery, w: int = 12, h: int = 8) -> Panel:
    panel = bargauge.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE).span(w).height(h)
    return _ref_ids(panel, [query])


def _variables(cfg: MixinConfig, job_metric: str, *, rank: bool, step: bool) -> list[Any]:
    job = 'job=~"$job"'
    variables: list[Any] = [
        DatasourceVariable("datasource").label("Data source").type("prometheus"),
        _label_variable("job", "Job", f"label_values({job_metric}{cfg.sel()}, job)"),
    ]
    if rank:
        variables.append(_label_variable("rank", "Rank", f"label_values({OPERATIONS_TOTAL}{cfg.sel(job)}, rank)"))
    if step:
        variables.append(
            _label_variable("step", "Step", f"label_values({sc.METRIC_STEP_DURATION}_count{cfg.sel(job)}, step)")
        )
    return variables


def _label_variable(name: str, label: str, query: str) -> QueryVariable:
    return (
        QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.NATURAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".+")
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


def traces_link(cfg: MixinConfig) -> DashboardLink:
    """"Checkpoint traces": Explore on the trace datasource, over the dashboard's time range. With Tempo it
    opens on a TraceQL query for the checkpoints (one trace each, all ranks in it)."""
    query: dict[str, Any] = {"refId": "A", "datasource": {"type": cfg.traces_datasource_type,
                                                          "uid": cfg.traces_datasource_uid}}  # fmt: skip
    if cfg.traces_datasource_type == "tempo":
        query |= {"queryType": "traceql", "query": TRACEQL_CHECKPOINTS}
    pane = {"datasource": cfg.traces_datasource_uid, "queries": [query], "range": {"from": "now-6h", "to": "now"}}
    panes = urllib.parse.quote(json.dumps({"traces": pane}, separators=(",", ":")))
    return (
        DashboardLink("Checkpoint traces")
        .type(DashboardLinkType.LINK)
        .url(f"/explore?schemaVersion=1&panes={panes}")
        .icon("external link")
        .tooltip(f"The checkpoints' traces in {cfg.traces_datasource_type.capitalize()}")
        .keep_time(True)
        .target_blank(True)
    )


#: TraceQL: every checkpoint's root span (docs/receiving-stack.md has more).
TRACEQL_CHECKPOINTS = f'{{ name = "{sc.SPAN_CHECKPOINT}" }}'


def _with_ids(built: Any) -> dict[str, Any]:
    """The dashboard as JSON, with every panel (rows and their panels too) numbered from 1."""
    model: dict[str, Any] = json.loads(json.dumps(built, cls=JSONEncoder))
    next_id = 1
    for panel in model["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            p["id"] = next_id
            next_id += 1
    return model


def checkpoints(cfg: MixinConfig) -> dict[str, Any]:
    """Is checkpointing healthy: rates, failures, durations, bytes, async saves, age of the last success."""
    def s(*m: str) -> str:
        return cfg.sel('job=~"$job"', 'rank=~"$rank"', *m)

    op_dur, step_dur = sc.METRIC_OPERATION_DURATION, sc.METRIC_STEP_DURATION
    failed = f'{sc.LABEL_STATUS}="{sc.STATUS_FAILURE}"'
    write, read = f'{sc.LABEL_STEP}="write_data"', f'{sc.LABEL_STEP}="read_data"'

    def quantile(q: str, metric: str, by: str, extra: str = "") -> str:
        return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{s(extra) if extra else s()}[{RATE}])))"

    d = _dashboard(
        cfg, cfg.checkpoints_uid, "dcp-otel / Checkpoints",
        "PyTorch Distributed Checkpoint: is checkpointing healthy? Click an exemplar for the checkpoint's trace.",
        _variables(cfg, OPERATIONS_TOTAL, rank=True, step=False),
    )  # fmt: skip
    d = (
        d.with_row(Row("Now"))
        .with_panel(_stat(
            "Since the last successful save", "s",
            "Time since the last save or durable async save succeeded on any selected rank.",
            _query(f"time() - max({sc.METRIC_LAST_SUCCESS}{s(SAVES)})", instant=True)))
        .with_panel(_stat(
            "Failed checkpoints", "short",
            "Checkpoint operations that failed in the time range (each counted once, however many ranks it failed on).",
            _query(f"sum(max by (operation) (increase({OPERATIONS_TOTAL}{s(failed)}[{RANGE}])))", instant=True)))
        .with_panel(_stat(
            "Async saves in flight", "short", "Async saves handed off and not yet durable.",
            _query(f"sum({sc.METRIC_ASYNC_IN_FLIGHT}{s()})", instant=True)))
        .with_panel(_stat(
            "Bytes written", "bytes", "Bytes all selected ranks wrote to checkpoint storage in the time range.",
            _query(f"sum(increase({WRITTEN_TOTAL}{s()}[{RANGE}]))", instant=True)))
        .with_row(Row("Failures"))
        .with_panel(_table(
            "Where failures started", "short",
            "Failed checkpoint operations, counted on the rank whose own exception it was (not on the ranks that only "
            "re-raised torch's CheckpointException), by operation, rank and error type; since each rank started.",
            _query(f"sort_desc(sum by (operation, rank, error_type) "
                   f"(max_over_time({sc.METRIC_FAILURES}_total{s()}[{RANGE}])))", instant=True, fmt="table"), w=24))
        .with_row(Row("Operations"))
        .with_panel(_timeseries(
            "Operations by status", "ops",
            "Checkpoint operations finished per second on the selected ranks, by operation and status.",
            _query(f"sum by (operation, status) (rate({OPERATIONS_TOTAL}{s()}[{RATE}]))", "{{operation}} {{status}}")))
        .with_panel(_timeseries(
            "Operation duration", "s",
            "p50 and p95 from the histogram; max: the slowest rank's mean. Exemplars link to traces.",
            _query(quantile("0.5", op_dur, "operation"), "p50 {{operation}}", exemplar=True),
            _query(quantile("0.95", op_dur, "operation"), "p95 {{operation}}", exemplar=True),
            _query(f"max by (operation) (rate({op_dur}_sum{s()}[{RATE}]) / rate({op_dur}_count{s()}[{RATE}]) > 0)",
                   "max {{operation}}")))
        .with_panel(_timeseries(
            "Step duration p95", "s", "p95 of each step of each operation (write_data, read_data, planning...).",
            _query(quantile("0.95", step_dur, "operation, step"), "{{operation}} {{step}}", exemplar=True), w=8))
        .with_panel(_timeseries(
            "Step duration p50", "s", "p50 of each step of each operation.",
            _query(quantile("0.5", step_dur, "operation, step"), "{{operation}} {{step}}", exemplar=True), w=8))
        .with_panel(_timeseries(
            "Step duration max", "s", "Each step's slowest rank (its mean per call): the Ranks dashboard says which.",
            _query(f"max by (operation, step) (rate({step_dur}_sum{s()}[{RATE}]) / rate({step_dur}_count{s()}[{RATE}]) > 0)",
                   "{{operation}} {{step}}"), w=8))
        .with_row(Row("Bytes"))
        .with_panel(_timeseries(
            "Bytes per second", "Bps", "Checkpoint bytes written and read per second, all selected ranks.",
            _query(f"sum(rate({WRITTEN_TOTAL}{s()}[{RATE}]))", "written"),
            _query(f"sum(rate({READ_TOTAL}{s()}[{RATE}]))", "read")))
        .with_panel(_timeseries(
            "Storage throughput while writing / reading", "Bps",
            "Bytes per second of time spent in write_data / read_data: what the storage delivers.",
            _query(f"sum(rate({WRITTEN_TOTAL}{s()}[{RATE}])) / (sum(rate({step_dur}_sum{s(write)}[{RATE}])) > 0)",
                   "write"),
            _query(f"sum(rate({READ_TOTAL}{s()}[{RATE}])) / (sum(rate({step_dur}_sum{s(read)}[{RATE}])) > 0)",
                   "read")))
        .with_row(Row("Async saves"))
        .with_panel(_timeseries(
            "Async save phases p95", "s", "Staging (blocks training) and upload (until durable).",
            _query(quantile("0.95", sc.METRIC_ASYNC_PHASE_DURATION, "phase"), "{{phase}}", exemplar=True)))
        .with_panel(_timeseries(
            "Bytes staged per second", "Bps",
            "What async saves copied out of the state dict (the copy that blocks training), by the device it came from.",
            _query(f"sum by (device) (rate({sc.METRIC_STAGED_BYTES}_total{s()}[{RATE}]))", "{{device}}")))
        .with_panel(_timeseries(
            "Async saves in flight", "short", "Per rank; one that stays up means an upload that does not finish.",
            _query(f"sum by (rank) ({sc.METRIC_ASYNC_IN_FLIGHT}{s()})", "rank {{rank}}")))
        .with_panel(_timeseries(
            "Age of the last successful checkpoint", "s", "Per operation: how much progress a crash would lose.",
            _query(f"time() - max by (operation) ({sc.METRIC_LAST_SUCCESS}{s()})", "{{operation}}")))
        .with_row(Row("dcp-otel itself"))
        .with_panel(_stat(
            "Telemetry problems", "short",
            "What dcp-otel dropped or failed to record on the selected ranks since they started, by reason "
            "(span_queue_full: the span exporter is slow, down or hung). Checkpoints are unaffected.",
            _query(f"sum by (reason) (max_over_time({sc.METRIC_TELEMETRY_PROBLEMS}_total{s()}[{RANGE}]))",
                   "{{reason}}", instant=True), w=24))
    )  # fmt: skip
    return _with_ids(d.build())


def ranks(cfg: MixinConfig) -> dict[str, Any]:
    """Which rank is slow: per-rank step durations, the top-k slowest, collective wait per rank."""
    def s(*m: str) -> str:
        return cfg.sel('job=~"$job"', 'rank=~"$rank"', *m)

    step_dur, wait = sc.METRIC_STEP_DURATION, sc.METRIC_COLLECTIVE_WAIT
    steps = 'step=~"$step"'

    def mean(metric: str, by: str, window: str, *m: str) -> str:
        return (f"sum by ({by}) (increase({metric}_sum{s(*m)}[{window}])) / "
                f"(sum by ({by}) (increase({metric}_count{s(*m)}[{window}])) > 0)")  # fmt: skip

    io_mean = mean(step_dur, "rank", RANGE, IO_STEPS)
    d = _dashboard(
        cfg, cfg.ranks_uid, "dcp-otel / Ranks",
        "Which rank makes the checkpoint slow? Every rank waits for the slowest one in each collective step.",
        _variables(cfg, OPERATIONS_TOTAL, rank=True, step=True),
    )  # fmt: skip
    in_progress = f"({sc.METRIC_IN_PROGRESS}{s()} > 0)"  # (0 in multiprocess files: ended)
    where_now = (
        table.Panel().title("Where each rank is now").unit("s").datasource(DATASOURCE).span(16).height(8)
        .description("Every open checkpoint operation: its rank, operation and innermost open step (\"-\": "
                     "between steps, in DCP's collectives) and how long since it last made progress, the "
                     "oldest first. A rank stuck in a step while the others sit at \"-\" is the one they wait for.")
        .with_transformation(DataTransformerConfig(id_val="organize", options={
            "excludeByName": {"Time": True}, "renameByName": {"Value": "seconds without progress"}}))
        .with_target(_query(f"sort_desc(time() - {in_progress})", instant=True, fmt="table").ref_id("A"))
    )  # fmt: skip
    d = (
        d.with_row(Row("Now"))
        .with_panel(where_now)
        .with_panel(_stat(
            "Ranks stalled now", "short",
            "Open operations with no progress for longer than their stall threshold (DCPCheckpointStalled).",
            _query(f"count((time() - {in_progress}) > ignoring (step) group_left "
                   f"{sc.METRIC_STALL_THRESHOLD}{s()}) or vector(0)", instant=True), w=8))
        .with_panel(_timeseries(
            "Stall reports", "short",
            "DCP calls reported stalled (the watchdog counts each stall once), by rank and step.",
            _query(f"sum by (rank, operation, step) (increase({sc.METRIC_STALLS}_total{s()}[{RATE}]))",
                   "rank {{rank}} {{operation}} {{step}}"), w=8, h=4))
        .with_row(Row("Stragglers"))
        .with_panel(_bars(
            "Top 5 slowest ranks in write_data / read_data", "s",
            "Mean time per call in the steps that move the bytes, over the time range.",
            _query(f"topk(5, {io_mean})", "rank {{rank}}", instant=True)))
        .with_panel(_bars(
            "Skew: slowest rank / median rank", "none",
            "Per step, over the time range: 1 is perfectly even; the straggler alert fires above its factor.",
            _query(f"max by (operation, step) ({mean(step_dur, 'operation, step, rank', RANGE, steps)}) / "
                   f"quantile by (operation, step) (0.5, {mean(step_dur, 'operation, step, rank', RANGE, steps)})",
                   "{{operation}} {{step}}", instant=True)))
        .with_panel(_table(
            "Mean step duration per rank", "s", "Over the time range; sort by Value to find the slow rank.",
            _query(mean(step_dur, "operation, step, rank", RANGE, steps), instant=True, fmt="table"), w=24))
        .with_row(Row("Over time"))
        .with_panel(_timeseries(
            "Step duration per rank", "s", "Mean per call of the selected steps, per rank.",
            _query(mean(step_dur, "rank, step", RATE, steps), "rank {{rank}} {{step}}")))
        .with_panel(_timeseries(
            "Collective wait per rank", "s",
            "Operation time not covered by the rank's own steps: waiting for the others. "
            "The straggler is the rank that waits least.",
            _query(mean(wait, "rank", RATE), "rank {{rank}}")))
        .with_panel(heatmap.Panel()
            .title("Step duration distribution").unit("s").datasource(DATASOURCE).span(24).height(8)
            .description("How often the selected steps took how long, all selected ranks (histogram buckets). "
                         "Exemplars link to the traces of the checkpoints in each bucket.")
            .calculate(False)
            .with_target(_query(f"sum by (le) (increase({step_dur}_bucket{s(steps)}[{RATE}]))", "{{le}}",
                                exemplar=True, fmt="heatmap").ref_id("A")))
    )  # fmt: skip
    return _with_ids(d.build())


def torchelastic(cfg: MixinConfig) -> dict[str, Any]:
    """The torchelastic agent: rendezvous durations, worker restarts, run results (from OTelMetricHandler)."""
    def s(*m: str) -> str:
        return cfg.sel('job=~"$job"', *m)

    dur, calls = sc.METRIC_ELASTIC_DURATION, sc.METRIC_ELASTIC_CALLS + "_total"
    events, last = sc.METRIC_ELASTIC_EVENTS + "_total", sc.METRIC_ELASTIC_LAST_VALUE
    dropped = sc.METRIC_ELASTIC_DROPPED + "_total"
    d = _dashboard(
        cfg, cfg.agent_uid, "dcp-otel / torchelastic agent",
        "torchelastic's own metrics, through dcp-otel's OTelMetricHandler (dcp-otel-run serves the agent's).",
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
            _query(f"sum by (job, name) ({dur}_sum{s(rendezvous)}) / sum by (job, name) ({dur}_count{s(rendezvous)})",
                   "{{job}}", instant=True)))
        .with_panel(_stat(
            "Worker restarts left", "short",
            "remaining_restarts of the worker group: 0 means the next failure ends the job.",
            _query(f"min({last}{s(restarts_left)})", instant=True)))
        .with_panel(_stat(
            "Worker group restarts", "short", "Times the agent restarted its workers (latest count in the time range).",
            _query(f"sum(max_over_time({calls}{s(restart)}[{RANGE}]))", instant=True)))
        .with_panel(_table(
            "Run results", "short", "Per role: runs that succeeded or failed, with or without retries.",
            _query(f"sum by (job, name) ({events}{s(run_results)})", "{{name}}", instant=True, fmt="table")))
        .with_panel(_table(
            "Agent calls", "s", "Every profiled agent function: mean duration.",
            _query(f"sum by (group, name) ({dur}_sum{s()}) / sum by (group, name) ({dur}_count{s()})",
                   "{{name}}", instant=True, fmt="table")))
        .with_panel(_timeseries(
            "Worker group states", "short", "How often the agent's monitor saw each state (healthy, failed, ...).",
            _query(f"sum by (name) (increase({events}{s(states)}[{RATE}]))", "{{name}}")))
        .with_panel(_timeseries(
            "Calls by status", "ops", "Profiled agent and trainer calls per second, by result.",
            _query(f"sum by (name, status) (rate({calls}{s()}[{RATE}]))", "{{name}} {{status}}")))
        .with_panel(_stat(
            "Dropped metrics", "short", "Metrics OTelMetricHandler refused (bad values, too many names), by reason.",
            _query(f"sum by (reason) (max_over_time({dropped}{s()}[{RANGE}]))", "{{reason}}", instant=True), w=12))
    )  # fmt: skip
    return _with_ids(d.build())


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
