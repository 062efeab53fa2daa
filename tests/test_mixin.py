"""What we ship for Prometheus, Grafana and the Collector is valid, current and consistent.

Checked with the real tools we have (promtool) and, for what cannot run here
(Grafana, the Collector, Docker), structurally: the files load, every path
they mount exists, ports agree with the library's defaults, component names
are real, and every metric a rule or dashboard uses is one we export (and
every metric we export is shown somewhere).
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from prometheus_client import CollectorRegistry
from torch.distributed.elastic.metrics.api import MetricData

import dcp_otel
from dcp_otel import OTelMetricHandler, semconv
from mixin.__main__ import main as mixin_main
from mixin.config import MixinConfig
from mixin.dashboards import GRAFANA_TARGET, dashboards, panels
from mixin.rules import alerting_rules
from tests.prometheus import binary

REPO = Path(__file__).parent.parent
PROMETHEUS = REPO / "exporters" / "prometheus"
COLLECTOR = REPO / "exporters" / "otel-collector"
GRAFANA = REPO / "grafana"
DASHBOARDS = {p.name: json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*.json"))}
RULE_FILES = sorted((PROMETHEUS / "rules").glob("*.yml"))
_METRIC = re.compile(r"\b((?:dcp|torchelastic)_[a-z_]+)")
_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def family(name: str) -> str:
    """``dcp_operations_total`` -> ``dcp_operations``: the metric family a series belongs to."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def exported_families() -> set[str]:
    """Every family semconv's catalogue defines for Prometheus."""
    return {spec.prometheus for spec in semconv.CHECKPOINT_METRICS + semconv.PROGRESS_METRICS + semconv.ELASTIC_METRICS}


def expressions() -> dict[str, list[str]]:
    """Every PromQL expression we ship, by where it is."""
    found: dict[str, list[str]] = {}
    for name, model in DASHBOARDS.items():
        exprs = [t["expr"] for p in panels(model) for t in p["targets"]]
        exprs += [v["query"] for v in model["templating"]["list"] if v["type"] == "query"]
        found[name] = exprs
    for path in RULE_FILES:
        groups = yaml.safe_load(path.read_text())["groups"]
        found[path.name] = [rule["expr"] for g in groups for rule in g["rules"]]
    return found


# --- generated files and promtool -------------------------------------------
def test_the_committed_rules_and_dashboards_are_what_the_mixin_generates() -> None:
    assert mixin_main(["--check"]) == 0, "run `python -m mixin` and commit the result"


def test_a_threshold_is_one_flag_and_a_bad_one_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert mixin_main(["--out", str(tmp_path), "--no-save-window", "2h"]) == 0
    alerts = (tmp_path / "exporters/prometheus/rules/dcp-otel.alerts.yml").read_text()
    assert "> 7200" in alerts and "for over 2h" in alerts
    assert mixin_main(["--out", str(tmp_path), "--no-save-window", "2 hours"]) == 2
    assert "no_save_window must be a Prometheus duration" in capsys.readouterr().err
    for bad in ({"slow_factor": 1.0}, {"selector": '{job="x"}'}, {"ranks_uid": "has space"},
                {"recent_window": "2d"}):  # fmt: skip
        with pytest.raises(ValueError):
            MixinConfig(**bad)  # type: ignore[arg-type]


def test_promtool_accepts_the_scrape_config_and_the_rules() -> None:
    checked = promtool("check", "config", str(PROMETHEUS / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 2 rule files found" in checked.stdout
    rules = promtool("check", "rules", *map(str, RULE_FILES))
    assert rules.returncode == 0, rules.stdout + rules.stderr


def test_the_agent_config_is_valid_runs_no_rules_and_scrapes_exactly_as_prometheus_yml() -> None:
    agent = PROMETHEUS / "agent.yml"
    checked = promtool("check", "config", str(agent))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = load_yaml(agent)
    assert "rule_files" not in config and "alerting" not in config  # agent mode refuses both
    (remote,) = config["remote_write"]
    assert remote["send_exemplars"] is True
    # The same jobs, discovery and relabelling as prometheus.yml (its static example targets aside).
    server = {job["job_name"]: {k: v for k, v in job.items() if k != "static_configs"}
              for job in load_yaml(PROMETHEUS / "prometheus.yml")["scrape_configs"] if job.get("file_sd_configs")}  # fmt: skip
    assert {job["job_name"]: job for job in config["scrape_configs"]} == server


def test_the_large_jobs_config_is_valid_and_drops_only_real_per_rank_buckets() -> None:
    large = PROMETHEUS / "large-jobs.yml"
    checked = promtool("check", "config", str(large))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (ranks,) = [job for job in load_yaml(large)["scrape_configs"] if job["job_name"] == "dcp-otel"]
    dropped = [r["regex"] for r in ranks["metric_relabel_configs"] if "bucket" in r["regex"]]
    names = [f"{family}_bucket" for family in exported_families()]
    hits = {name for name in names for regex in dropped if re.fullmatch(regex, name)}
    assert hits == {f"{semconv.METRIC_STEP_DURATION}_bucket", f"{semconv.METRIC_COLLECTIVE_WAIT}_bucket",
                    f"{semconv.METRIC_ASYNC_PHASE_DURATION}_bucket"}  # fmt: skip
    # What the alerts read survives (the recorded step quantiles, like their panels, go empty).
    alerts = "\n".join(expressions()["dcp-otel.alerts.yml"])
    assert not [name for name in hits if name in alerts]


def test_promtool_unit_tests_show_each_alert_firing_and_not_firing() -> None:
    tests = PROMETHEUS / "tests" / "dcp-otel.test.yml"
    ran = promtool("test", "rules", str(tests))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    spec = yaml.safe_load(tests.read_text())
    alerts = {rule["alert"] for rule in alerting_rules(MixinConfig())["groups"][0]["rules"]}
    cases = [c for t in spec["tests"] for c in t["alert_rule_test"]]
    firing = {c["alertname"] for c in cases if c["exp_alerts"]}
    silent = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert firing == alerts and silent == alerts


def test_every_alert_has_severity_for_summary_and_description() -> None:
    for rule in alerting_rules(MixinConfig())["groups"][0]["rules"]:
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert re.fullmatch(r"\d+[smh]", rule["for"])
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_recording_rules_are_named_level_metric_operations() -> None:
    groups = yaml.safe_load((PROMETHEUS / "rules" / "dcp-otel.rules.yml").read_text())["groups"]
    for rule in groups[0]["rules"]:
        level, metric, operations = rule["record"].split(":")
        assert level and operations and family(metric) in exported_families(), rule["record"]


# --- consistency with semconv -------------------------------------------------
def test_every_metric_a_rule_or_dashboard_uses_is_one_we_export() -> None:
    unknown = {
        (where, name)
        for where, exprs in expressions().items()
        for expr in exprs
        for name in _METRIC.findall(re.sub(r"\w+:\w+:\w+", "", expr))  # recorded names are checked above
        if family(name) not in exported_families() and name != semconv.LABEL_RUN_ID  # the run: a label
    }
    assert not unknown


def test_every_metric_we_export_is_shown_on_a_dashboard() -> None:
    shown = {family(n) for name in DASHBOARDS for expr in expressions()[name] for n in _METRIC.findall(expr)}
    assert exported_families() - shown == set()


def test_semconv_names_are_what_a_real_run_exports(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    dcp_otel.instrument(registry=registry)
    try:
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "c"))
        dcp.async_save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "a")).result()
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=str(tmp_path / "c"))
        assert dcp_otel.flush(timeout_s=30)
        handler = OTelMetricHandler(registry=registry)
        for name, value in (("agent.duration.ms", 5), ("agent.success", 1), ("restarts", 1), ("bad", float("nan"))):
            handler.emit(MetricData(0.0, "torchelastic", name, value))  # type: ignore[arg-type]
        exported = {metric.name for metric in registry.collect()}
    finally:
        dcp_otel.uninstrument()
    # prometheus_client names counters without their _total suffix, like semconv.
    assert exported == exported_families()


# --- dashboards -----------------------------------------------------------------
def test_dashboards_have_unique_ids_and_uids_and_a_current_schema() -> None:
    cfg = MixinConfig()
    uids = [model["uid"] for model in DASHBOARDS.values()]
    assert sorted(uids) == sorted([cfg.checkpoints_uid, cfg.ranks_uid, cfg.agent_uid])
    for name, model in DASHBOARDS.items():
        assert model["schemaVersion"] >= 41, name  # what Grafana 11.6 writes
        ids = [p["id"] for p in model["panels"]] + [c["id"] for p in model["panels"] for c in p.get("panels", [])]
        assert len(ids) == len(set(ids)), name
        for panel in panels(model):
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, (name, panel["title"])
            assert panel["description"], (name, panel["title"])
    assert GRAFANA_TARGET.startswith("11.")


def test_dashboards_select_datasource_job_and_rank_through_variables() -> None:
    for name, model in DASHBOARDS.items():
        variables = {v["name"]: v for v in model["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert "job" in variables and "run" in variables and variables["run"]["includeAll"], name
        if name != "dcp-otel-torchelastic.json":
            assert "rank" in variables and variables["rank"]["includeAll"], name
        for panel in panels(model):
            assert panel["datasource"]["uid"] == "${datasource}"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
                assert 'job=~"$job"' in target["expr"] and 'dcp_run_id=~"$run"' in target["expr"], (name, panel["title"])
        assert {"type": "dashboards", "tags": ["dcp-otel"]}.items() <= model["links"][0].items()


#: An aggregation in PromQL and its grouping, if any: ``sum by (job, rank) (``.
_AGGREGATION = re.compile(r"\b(sum|min|max|avg|count|topk|bottomk|quantile|stddev|group)\s*(?:by\s*\(([^)]*)\))?\s*\(")


def shipped_promql() -> list[tuple[str, str]]:
    """(where, expression) of every query we ship: panels, annotations, recording rules and alert expressions."""
    found = [(f"{name}: {p['title']}", t["expr"]) for name, m in DASHBOARDS.items() for p in panels(m) for t in p["targets"]]
    found += [(f"{name}: mark {a['name']}", a["expr"]) for name, m in DASHBOARDS.items()
              for a in m["annotations"]["list"] if "expr" in a]  # fmt: skip
    for path in RULE_FILES:
        found += [(f"{path.name}: {r.get('record') or r['alert']}", r["expr"]) for r in load_yaml(path)["groups"][0]["rules"]]
    return found


def test_no_panel_rule_or_alert_adds_up_runs() -> None:
    """A Prometheus holds many runs side by side: every aggregation keeps the job and the run."""
    shipped = shipped_promql()
    assert len(shipped) > 60
    for where, expr in shipped:
        for op, by in _AGGREGATION.findall(expr):
            kept = {label.strip() for label in by.split(",")}
            assert {"job", semconv.LABEL_RUN_ID} <= kept, (where, op, by, expr)


def test_every_stat_panel_has_thresholds_that_mean_something() -> None:
    grafana_default = [{"value": None, "color": "green"}, {"value": 80, "color": "red"}]
    stats = [(name, p) for name, m in DASHBOARDS.items() for p in panels(m) if p["type"] == "stat"]
    assert len(stats) == 9
    for name, panel in stats:
        limits = panel["fieldConfig"]["defaults"]["thresholds"]
        assert limits["mode"] == "absolute" and limits["steps"] != grafana_default, (name, panel["title"])
        if len(limits["steps"]) == 1:  # one colour: a figure that is neither good nor bad, and not coloured
            assert panel["options"]["colorMode"] == "none", (name, panel["title"])
        else:  # the description says what the colours mean
            assert re.search(r"\b(red|orange) (from|at)\b", panel["description"], re.I), (name, panel["title"])
    since = next(p for _, p in stats if p["title"] == "Since the last successful save")
    assert [s["value"] for s in since["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [None, 1800, 3600]


def test_every_per_rank_panel_is_bounded() -> None:
    """A panel that draws a series (or a row) per rank shows the worst few per run, never all 1,024."""
    per_rank = []
    for name, model in DASHBOARDS.items():
        for panel in panels(model):
            for target in panel["targets"]:
                expr = target["expr"]
                if "dcp_failures_total" in expr:  # a row per failure's origin, not per rank
                    continue
                groupings = [[label.strip() for label in by.split(",")] for _, by in _AGGREGATION.findall(expr)]
                if not ("{{rank}}" in target.get("legendFormat", "") or any("rank" in g for g in groupings)
                        or (panel["type"] == "table" and semconv.METRIC_IN_PROGRESS in expr)):
                    continue
                outer = _AGGREGATION.match(expr.removeprefix("sort_desc("))
                assert outer is not None, (name, panel["title"], expr)
                op, by = outer.group(1), [label.strip() for label in (outer.group(2) or "").split(",")]
                assert op in ("topk", "bottomk") or "rank" not in by, (name, panel["title"], expr)
                per_rank.append((panel["title"], op))
    bounded = {title for title, op in per_rank if op in ("topk", "bottomk")}
    assert bounded >= {"Async saves in flight", "Where each rank is now", "Stall reports", "Mean step duration per rank",
                       "Step duration per rank", "Collective wait per rank", "Top 5 slowest ranks in write_data / read_data"}


def test_failure_and_stall_tables_link_to_the_trace_and_every_dashboard_marks_failures_stalls_and_restarts() -> None:
    links = {p["title"]: p["fieldConfig"]["defaults"].get("links", []) for m in DASHBOARDS.values() for p in panels(m)}
    for title, words in (("Where failures started", ("status = error", ".dcp.rank = ${__data.fields.rank}")),
                         ("Where each rank is now", ('name = "dcp.stall"', ".dcp.rank = ${__data.fields.rank}"))):
        (link,) = links[title]
        pane = json.loads(urllib.parse.unquote(link["url"].split("panes=", 1)[1]))["traces"]
        (query,) = pane["queries"]
        # The default trace datasource is Jaeger: a search of the row's job (service), with its rank as a tag.
        assert query["queryType"] == "search" and query["service"] == "${__data.fields.job}", title
        assert "dcp.rank=${__data.fields.rank}" in query["tags"], title
        # From the failures in the dashboard's range; from when the stalled rank last made progress.
        assert pane["range"]["from"] == ("${__data.fields.since_ms}" if "rank is" in title else "${__from}"), title
        assert link["targetBlank"], title
        tempo = json.loads(urllib.parse.unquote(
            next(p for p in panels(dashboards(MixinConfig(traces_datasource_type="tempo"))["dcp-otel-ranks.json" if "rank is"
                 in title else "dcp-otel-checkpoints.json"]) if p["title"] == title)["fieldConfig"]["defaults"]["links"][0]["url"]
            .split("panes=", 1)[1]))["traces"]["queries"][0]["query"]
        assert all(w in tempo for w in words) and '.dcp.run_id = "${__data.fields.dcp_run_id}"' in tempo, tempo
    for name, model in DASHBOARDS.items():
        marks = {a["name"]: a for a in model["annotations"]["list"] if "expr" in a}
        assert set(marks) == {"Checkpoint failures", "Stall reports", "Worker restarts"}, name
        assert "error_type" in marks["Checkpoint failures"]["tagKeys"] and marks["Checkpoint failures"]["enable"]


def test_the_trend_panel_shows_every_checkpoint_of_a_job_saving_every_30_minutes(tmp_path: Path) -> None:
    """promtool evaluates the panel's query as Grafana sends it between and at checkpoints 30 minutes apart: it
    answers the last checkpoint's exact duration all along, where a rate over the histogram is empty."""
    from mixin.dashboards import render_expr

    model = DASHBOARDS["dcp-otel-checkpoints.json"]
    chosen = {"job": ".+", "run": ".+", "rank": ".+"}

    def rendered(title: str, ref: str = "A") -> str:
        panel = next(p for p in panels(model) if p["title"] == title)
        expr = next(t["expr"] for t in panel["targets"] if t["refId"] == ref)
        return render_expr(expr, chosen, rate_interval="1m", time_range="6h")

    run = 'job="train",dcp_run_id="r1",operation="save",status="success"'
    # Two ranks save at minutes 10, 40 and 70 (each held until the next): 80 s, 95 s, 0.8 s on the slower rank.
    spec = {"evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [
            {"series": f'dcp_last_duration_seconds{{{run},rank="0"}}', "values": "_x40 80x119 95x119 0.8x80"},
            {"series": f'dcp_last_duration_seconds{{{run},rank="1"}}', "values": "_x40 70x119 90x119 0.5x80"},
            {"series": f'dcp_operation_duration_seconds_bucket{{{run},rank="0",le="1"}}', "values": "0x159 0x120 1x80"},
            {"series": f'dcp_operation_duration_seconds_bucket{{{run},rank="0",le="+Inf"}}', "values": "0x40 1x119 2x120 3x80"},
        ],
        "promql_expr_test": [
            *({"expr": rendered("Duration of each checkpoint"), "eval_time": at,
               "exp_samples": [{"labels": '{job="train",dcp_run_id="r1",operation="save"}', "value": value}]}
              for at, value in (("11m", 80), ("25m", 80), ("39m", 80), ("41m", 95), ("69m", 95), ("72m", 0.8))),
            # The histogram's p50 (Grafana's usual trend) has nothing to say 15 minutes after a checkpoint.
            # (NaN, which Grafana draws as a gap: ">= 0" keeps only numbers.)
            {"expr": f'({rendered("Operation duration")}) >= 0', "eval_time": "25m", "exp_samples": []},
        ],
    }]}
    test_file = tmp_path / "trend.test.yml"
    test_file.write_text(yaml.safe_dump(spec))
    ran = promtool("test", "rules", str(test_file))
    assert ran.returncode == 0, ran.stdout + ran.stderr


def test_duration_quantiles_show_exemplars() -> None:
    targets = [t for m in DASHBOARDS.values() for p in panels(m) for t in p["targets"]]
    quantiles = [t for t in targets if "histogram_quantile" in t["expr"]]
    assert quantiles and all(t["exemplar"] for t in quantiles)


# --- Grafana provisioning, the Collector and compose ----------------------------------
def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_grafana_links_exemplars_to_the_provisioned_trace_datasource() -> None:
    sources = load_yaml(GRAFANA / "provisioning" / "datasources" / "dcp-otel.yaml")["datasources"]
    by_uid = {s["uid"]: s for s in sources}
    prometheus = next(s for s in sources if s["type"] == "prometheus")
    (link,) = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert link["name"] == semconv.EXEMPLAR_TRACE_ID
    assert link["datasourceUid"] == MixinConfig().traces_datasource_uid
    assert by_uid[link["datasourceUid"]]["type"] in {"jaeger", "tempo"}


def test_the_trace_datasource_options_change_the_provisioning_and_the_dashboards_links(tmp_path: Path) -> None:
    """`python -m mixin --traces-datasource-type tempo --traces-datasource-uid my-tempo`: exemplars and the
    dashboards' "Checkpoint traces" link open Tempo, with a TraceQL query; Jaeger stays provisioned beside it."""
    from mixin.__main__ import DATASOURCES, generated

    default, tempo = generated(MixinConfig()), generated(MixinConfig(traces_datasource_type="tempo",
                                                                      traces_datasource_uid="my-tempo"))  # fmt: skip
    assert default[DATASOURCES] == (GRAFANA / "provisioning" / "datasources" / "dcp-otel.yaml").read_text()
    for files, uid, kind in ((default, MixinConfig().traces_datasource_uid, "jaeger"), (tempo, "my-tempo", "tempo")):
        sources = {s["uid"]: s for s in yaml.safe_load(files[DATASOURCES])["datasources"]}
        assert len(sources) == 3 and {s["type"] for s in sources.values()} == {"prometheus", "jaeger", "tempo"}
        (link,) = next(s for s in sources.values() if s["type"] == "prometheus")["jsonData"]["exemplarTraceIdDestinations"]
        assert link["datasourceUid"] == uid and sources[uid]["type"] == kind
        for name, content in files.items():
            if name.suffix == ".json":
                (traces,) = [link for link in json.loads(content)["links"] if link["title"] == "Checkpoint traces"]
                pane = json.loads(urllib.parse.unquote(traces["url"].split("panes=", 1)[1]))["traces"]
                assert pane["datasource"] == uid and pane["queries"][0]["datasource"] == {"type": kind, "uid": uid}
                # The selected runs' checkpoints, over the dashboard's time range (not a fixed "now-6h").
                query = pane["queries"][0]
                assert pane["range"] == {"from": "${__from}", "to": "${__to}"}
                if kind == "tempo":
                    assert query["query"] == '{ name = "dcp.checkpoint" && .dcp.run_id =~ "${run:regex}" }'
                else:  # Jaeger searches one service (the job) at a time
                    assert (query["service"], query["operation"]) == ("${job}", "dcp.checkpoint")
    assert {n for n in default if default[n] != tempo[n]} == {n for n in default if n.suffix == ".json"} | {DATASOURCES}
    with pytest.raises(ValueError, match="traces_datasource_type"):
        MixinConfig(traces_datasource_type="zipkin")
    # The command docs/receiving-stack.md prints writes exactly that.
    assert mixin_main(["--traces-datasource-type", "tempo", "--traces-datasource-uid", "my-tempo", "--out", str(tmp_path)]) == 0
    assert (tmp_path / DATASOURCES).read_text() == tempo[DATASOURCES]


#: Components of otelcol-contrib 0.139 we may name (type before any "/name").
REAL_COMPONENTS = {
    "receivers": {"otlp", "prometheus", "hostmetrics", "jaeger", "zipkin"},
    "processors": {"batch", "memory_limiter", "resource", "attributes", "filter", "tail_sampling"},
    "exporters": {"otlp", "otlphttp", "prometheus", "prometheusremotewrite", "debug", "file"},
    "extensions": {"health_check", "pprof", "zpages"},
}


def test_the_collector_config_names_real_components_and_wires_every_one() -> None:
    config = load_yaml(COLLECTOR / "config.yaml")
    for kind, real in REAL_COMPONENTS.items():
        assert {name.split("/")[0] for name in config[kind]} <= real, kind
    service = config["service"]
    assert set(service["extensions"]) == set(config["extensions"])
    used = {kind: set() for kind in ("receivers", "processors", "exporters")}  # type: dict[str, set[str]]
    for pipeline, parts in service["pipelines"].items():
        assert pipeline.split("/")[0] in {"traces", "metrics", "logs"}
        assert parts["processors"][0] == "memory_limiter"  # first, as the Collector recommends
        for kind in used:
            used[kind] |= set(parts[kind])
    assert all(used[kind] == set(config[kind]) for kind in used)  # nothing defined and unused, nothing undefined
    # OTLP/HTTP on 4318: the OpenTelemetry SDK's default endpoint reaches it.
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")


def test_the_collector_writes_the_spans_it_receives_to_rotated_files_the_report_reads() -> None:
    config = load_yaml(COLLECTOR / "config.yaml")
    files = [name for name in config["service"]["pipelines"]["traces"]["exporters"] if name.split("/")[0] == "file"]
    assert len(files) == 1
    exporter = config["exporters"][files[0]]
    assert exporter["format"] == "json"  # OTLP JSON, one request per line: what dcp_otel.otlp_file reads
    assert exporter["rotation"]["max_megabytes"] > 0 and exporter["rotation"]["max_backups"] > 0
    # On the host, in a folder the compose file mounts there: `dcp-otel report exporters/otel-collector/traces`.
    mounts = dict(v.split(":")[:2] for v in load_yaml(COLLECTOR / "compose.yaml")["services"]["otel-collector"]["volumes"])
    folder = next(source for source, target in mounts.items() if exporter["path"].startswith(target + "/"))
    assert (COLLECTOR / folder).is_dir()


#: The oldest image of each service the compose file may pin: releases of 2025's last quarter (Jaeger v2: the
#: all-in-one of v1 is no longer released).
OLDEST_IMAGES = {"otel/opentelemetry-collector-contrib": (0, 139, 0), "jaegertracing/jaeger": (2, 11, 0),
                 "grafana/tempo": (2, 9, 0), "prom/prometheus": (3, 5, 0), "grafana/grafana": (11, 6, 0)}


def test_compose_runs_current_pinned_images_and_every_provisioned_trace_datasource_has_its_service() -> None:
    services = load_yaml(COLLECTOR / "compose.yaml")["services"]
    images = dict(service["image"].rsplit(":", 1) for service in services.values())
    assert set(images) == set(OLDEST_IMAGES)
    for image, tag in images.items():
        version = tuple(int(part) for part in tag.removeprefix("v").split("."))
        assert len(version) == 3 and version >= OLDEST_IMAGES[image], (image, tag)  # pinned, never "latest"
    # Grafana's trace datasources point at services the stack runs, and the Collector sends every span to each.
    exporters = load_yaml(COLLECTOR / "config.yaml")["exporters"]
    sent_to = {e["endpoint"].split(":")[0]: e["endpoint"].rsplit(":", 1)[1] for name, e in exporters.items()
               if name.startswith("otlp/")}  # fmt: skip
    for source in load_yaml(GRAFANA / "provisioning" / "datasources" / "dcp-otel.yaml")["datasources"]:
        if source["type"] in ("jaeger", "tempo"):
            host = urllib.parse.urlsplit(source["url"]).hostname
            assert host in services and host in sent_to, source
    tempo = load_yaml(COLLECTOR / "tempo.yaml")
    assert tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":" + sent_to["tempo"])
    assert f"{tempo['server']['http_listen_port']}:{tempo['server']['http_listen_port']}" in services["tempo"]["ports"]
    # Prometheus keeps the job and run the Collector's exporter gives series pushed over OTLP.
    scrape = {job["job_name"]: job for job in load_yaml(PROMETHEUS / "prometheus.yml")["scrape_configs"]}
    assert scrape["otel-collector"]["honor_labels"] is True


def test_compose_mounts_files_that_exist_and_agrees_on_ports() -> None:
    compose = load_yaml(COLLECTOR / "compose.yaml")
    services = compose["services"]
    assert set(services) == {"otel-collector", "jaeger", "tempo", "prometheus", "grafana"}
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            assert (COLLECTOR / source).resolve().exists(), (name, source)
            assert target.startswith("/")
    collector = services["otel-collector"]
    assert "contrib" in collector["image"]  # the prometheus exporter is in contrib only
    mounted = {v.split(":")[1] for v in collector["volumes"]}
    assert collector["command"][0].removeprefix("--config=") in mounted
    config = load_yaml(COLLECTOR / "config.yaml")
    exporter_port = config["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    published = {p.split(":")[0] for p in collector["ports"]}
    assert {"4317", "4318", exporter_port} <= published
    assert services["grafana"]["image"].endswith(":" + GRAFANA_TARGET + ".0")
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    provider = load_yaml(GRAFANA / "provisioning" / "dashboards" / "dcp-otel.yaml")["providers"][0]
    grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert grafana_mounts["../../grafana/dashboards"] == provider["options"]["path"]
    # Prometheus scrapes what the library serves by default, and the Collector's exporter.
    scrape = {job["job_name"]: job for job in load_yaml(PROMETHEUS / "prometheus.yml")["scrape_configs"]}
    ports = {name: {int(t.rsplit(":", 1)[1]) for c in job.get("static_configs", []) for t in c["targets"]}
             for name, job in scrape.items()}  # fmt: skip
    assert ports["dcp-otel"] == {semconv.DEFAULT_METRICS_PORT, semconv.DEFAULT_METRICS_PORT + 1}
    assert ports["torchelastic-agent"] == {semconv.DEFAULT_AGENT_METRICS_PORT}
    assert ports["otel-collector"] == {int(exporter_port)}
