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
from mixin.dashboards import GRAFANA_TARGET, panels
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
        if family(name) not in exported_families()
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
        assert "job" in variables, name
        if name != "dcp-otel-torchelastic.json":
            assert "rank" in variables and variables["rank"]["includeAll"], name
        for panel in panels(model):
            assert panel["datasource"]["uid"] == "${datasource}"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
                assert 'job=~"$job"' in target["expr"], (name, panel["title"])
        assert {"type": "dashboards", "tags": ["dcp-otel"]}.items() <= model["links"][0].items()


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
                assert (pane["queries"][0].get("query") == '{ name = "dcp.checkpoint" }') == (kind == "tempo")
    assert {n for n in default if default[n] != tempo[n]} == {n for n in default if n.suffix == ".json"} | {DATASOURCES}
    with pytest.raises(ValueError, match="traces_datasource_type"):
        MixinConfig(traces_datasource_type="zipkin")
    # The command docs/receiving-stack.md prints writes exactly that.
    assert mixin_main(["--traces-datasource-type", "tempo", "--traces-datasource-uid", "my-tempo", "--out", str(tmp_path)]) == 0
    assert (tmp_path / DATASOURCES).read_text() == tempo[DATASOURCES]


#: Components of otelcol-contrib 0.104 we may name (type before any "/name").
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


def test_compose_mounts_files_that_exist_and_agrees_on_ports() -> None:
    compose = load_yaml(COLLECTOR / "compose.yaml")
    services = compose["services"]
    assert set(services) == {"otel-collector", "jaeger", "prometheus", "grafana"}
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
