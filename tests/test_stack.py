"""Every query we ship returns data from a real Prometheus scraping a real job.

One run of tests/stack.py (Prometheus with exporters/prometheus/prometheus.yml
and our rules; a 3-rank ``dcp-otel-run`` job found through dcp-otel's file_sd
files) feeds every check here, and a second run where a Prometheus in agent mode
(exporters/prometheus/agent.yml) scrapes the job and remote-writes to a central
Prometheus with our rules, which the checks query: each query of each panel of each dashboard,
with its variables substituted as Grafana would; each variable's own query;
the exemplars of the duration panels; the recording rules; the alerts.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixin.dashboards import panels, render_expr
from tests.stack import AGENT_JOB, FAIL_RANK, RANK_JOB, SLOW_RANK, WORLD, Stack, draw

DASHBOARDS = Path(__file__).parent.parent / "grafana" / "dashboards"
RULES = Path(__file__).parent.parent / "exporters" / "prometheus" / "rules"
#: Grafana's macros, as it would set them for this run (its scrape interval is 1 s).
RATE_INTERVAL, TIME_RANGE = "5m", "15m"
_LABEL_VALUES = re.compile(r"^label_values\((?P<match>.+),\s*(?P<label>\w+)\)$")
_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")


@pytest.fixture(scope="module", params=["prometheus", "agent"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Run the job once per way of collecting it; record what the checks need at both moments
    (ranks live, agent done).

    ``prometheus``: one Prometheus with prometheus.yml scrapes the job. ``agent``: a Prometheus
    in agent mode with agent.yml scrapes it and remote-writes to a central Prometheus, which
    every check then queries, as a many-node job runs.
    """
    results: dict[str, Any] = {}
    with Stack(tmp_path_factory.mktemp(f"stack-{request.param}"), agent=request.param == "agent") as live:
        results["stack"] = live

        def while_ranks_live() -> None:
            for name in ("dcp-otel-checkpoints.json", "dcp-otel-ranks.json"):
                results[name] = evaluate(live, load(name), live.t_ranks)
            # One rank and one step, as a user drills down to the straggler.
            results["one rank"] = {name: evaluate(live, load(name), live.t_ranks, pick)
                                   for name, pick in (("dcp-otel-checkpoints.json", {"rank": str(FAIL_RANK)}),
                                                      ("dcp-otel-ranks.json", {"rank": str(SLOW_RANK),
                                                                               "step": "write_data"}))}  # fmt: skip
            results["rules"] = live.prom.api("rules")
            results["alerts"] = live.prom.api("alerts")["alerts"]
            results["records"] = {
                rule["name"]: live.prom.query(rule["name"], at=live.t_ranks)
                for group in results["rules"]["groups"] for rule in group["rules"] if rule["type"] == "recording"
            }  # fmt: skip
            results["targets_live"] = sorted(p.name for p in live.targets.iterdir())
            for name in ("dcp-otel-checkpoints.json", "dcp-otel-ranks.json"):
                results["drawn"][name] = draw(live, name, live.t_ranks, pictures)

        pictures = live.tmp / "pictures"
        results["drawn"] = {}
        live.run_job(while_ranks_live)
        results["dcp-otel-torchelastic.json"] = evaluate(live, load("dcp-otel-torchelastic.json"), live.t_agent)
        results["drawn"]["dcp-otel-torchelastic.json"] = draw(live, "dcp-otel-torchelastic.json", live.t_agent, pictures)
        results["pictures"] = pictures
        results["targets_after"] = sorted(p.name for p in live.targets.iterdir())
        yield results


def load(name: str) -> dict[str, Any]:
    return json.loads((DASHBOARDS / name).read_text())  # type: ignore[no-any-return]


def finite(values: list[Any]) -> bool:
    return any(math.isfinite(float(v)) for v in values)


def evaluate(live: Stack, model: dict[str, Any], at: float, pick: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the dashboard's variable queries, then every panel query with "All" selected
    (or, for the variables in ``pick``, that one value, which must be among the variable's)."""
    prom, start = live.prom, live.t_start
    variables: dict[str, list[str]] = {}
    chosen = {"datasource": "prometheus"}
    for var in model["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = _LABEL_VALUES.match(var["query"])
        assert match, var["query"]
        selector = render_expr(match["match"], chosen, rate_interval=RATE_INTERVAL, time_range=TIME_RANGE)
        values = sorted({s.get(match["label"], "") for s in prom.series(selector, start, at)} - {""})
        variables[var["name"]] = values
        chosen[var["name"]] = var["allValue"]  # "All", as Grafana sends it
        if pick and var["name"] in pick:
            assert pick[var["name"]] in values, (var["name"], values)
            chosen[var["name"]] = pick[var["name"]]
    queries = []
    for panel in panels(model):
        for target in panel["targets"]:
            expr = render_expr(target["expr"], chosen, rate_interval=RATE_INTERVAL, time_range=TIME_RANGE)
            if target.get("instant"):
                result = prom.query(expr, at=at)
                ok = bool(result) and finite([r["value"][1] for r in result])
            else:
                result = prom.query_range(expr, start, at)
                ok = bool(result) and finite([v for r in result for _, v in r["values"]])
            exemplars = prom.exemplars(expr, start, at) if target.get("exemplar") else None
            queries.append({"panel": panel["title"], "expr": expr, "ok": ok, "result": result, "exemplars": exemplars})
    return {"variables": variables, "queries": queries}


@pytest.mark.parametrize("name", ["dcp-otel-checkpoints.json", "dcp-otel-ranks.json", "dcp-otel-torchelastic.json"])
def test_every_query_of_every_panel_returns_data(stack: dict[str, Any], name: str) -> None:
    queries = stack[name]["queries"]
    assert len(queries) >= 6
    empty = [f"{q['panel']}: {q['expr']}" for q in queries if not q["ok"]]
    assert not empty, "queries without data:\n" + "\n".join(empty)


@pytest.mark.parametrize("name", ["dcp-otel-checkpoints.json", "dcp-otel-ranks.json"])
def test_every_query_returns_data_for_one_chosen_rank_too(stack: dict[str, Any], name: str) -> None:
    queries = stack["one rank"][name]["queries"]
    empty = [f"{q['panel']}: {q['expr']}" for q in queries if not q["ok"]]
    assert not empty, "queries without data:\n" + "\n".join(empty)
    rank = FAIL_RANK if name == "dcp-otel-checkpoints.json" else SLOW_RANK
    assert all(f'rank=~"{rank}"' in q["expr"] and 'rank=~".+"' not in q["expr"] for q in queries)


def test_the_variables_list_the_jobs_ranks_and_steps_of_the_run(stack: dict[str, Any]) -> None:
    checkpoints, ranks = stack["dcp-otel-checkpoints.json"]["variables"], stack["dcp-otel-ranks.json"]["variables"]
    assert checkpoints["job"] == [RANK_JOB]
    assert checkpoints["rank"] == [str(r) for r in range(WORLD)]
    assert {"write_data", "read_data", "local_step", "global_step"} <= set(ranks["step"])
    assert stack["dcp-otel-torchelastic.json"]["variables"]["job"] == sorted([AGENT_JOB, RANK_JOB])


def test_duration_panels_show_exemplars_that_name_a_trace(stack: dict[str, Any]) -> None:
    with_exemplars = [q for name in ("dcp-otel-checkpoints.json", "dcp-otel-ranks.json")
                      for q in stack[name]["queries"] if q["exemplars"] is not None]  # fmt: skip
    assert len(with_exemplars) >= 5
    for query in with_exemplars:
        found = [e for series in query["exemplars"] for e in series["exemplars"]]
        assert found, f"no exemplars: {query['panel']}: {query['expr']}"
        assert all(_TRACE_ID.match(e["labels"]["trace_id"]) for e in found)


def test_the_panels_point_at_the_slow_and_the_failing_rank(stack: dict[str, Any]) -> None:
    by_panel = {q["panel"]: q for q in stack["dcp-otel-ranks.json"]["queries"]}
    top = by_panel["Top 5 slowest ranks in write_data / read_data"]["result"]
    slowest = max(top, key=lambda r: float(r["value"][1]))
    assert slowest["metric"]["rank"] == str(SLOW_RANK)
    checkpoints = {q["panel"]: q for q in stack["dcp-otel-checkpoints.json"]["queries"]}
    failed = checkpoints["Failed checkpoints"]["result"]
    assert float(failed[0]["value"][1]) > 0  # the failing save, one checkpoint however many ranks it failed on


def test_recording_rules_evaluate_and_record_data(stack: dict[str, Any]) -> None:
    rules = [r for g in stack["rules"]["groups"] for r in g["rules"]]
    shipped = sum(len(g["rules"]) for path in RULES.glob("*.yml") for g in yaml.safe_load(path.read_text())["groups"])
    assert len(rules) == shipped and all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"]
    empty = [name for name, result in stack["records"].items() if not result]
    assert not empty, f"recording rules without data: {empty}"


def test_the_failed_save_the_dropped_metric_and_the_hung_save_fire_their_alerts_and_nothing_else_fires(
    stack: dict[str, Any],
) -> None:
    firing = {a["labels"]["alertname"]: a for a in stack["alerts"] if a["state"] == "firing"}
    assert sorted(firing) == ["DCPCheckpointOperationFailed", "DCPCheckpointStalled", "DCPTelemetryProblems"]
    # The last async save hangs in the slow rank's write: that rank is stuck in write_data, and every other
    # rank's background save waits for it (in DCP's collectives, between its own steps): one alert, naming it.
    (stalled,) = [a for a in stack["alerts"] if a["labels"]["alertname"] == "DCPCheckpointStalled"]
    labels = stalled["labels"]
    assert (labels["rank"], labels["step"], labels["operation"]) == (str(SLOW_RANK), "write_data", "async_save")
    assert labels["severity"] == "critical" and labels["dcp_run_id"] and labels["host_name"]
    assert f"rank {SLOW_RANK} (write_data, {labels['host_name']})" in stalled["annotations"]["description"]
    assert f"waiting between steps: {WORLD - 1} ranks" in stalled["annotations"]["description"]
    # The save one rank's full disk failed: one alert, on the rank whose own exception it was, with its type.
    (failed,) = [a for a in stack["alerts"] if a["labels"]["alertname"] == "DCPCheckpointOperationFailed"]
    assert failed["labels"]["operation"] == "save" and failed["labels"]["rank"] == str(FAIL_RANK)
    assert failed["labels"]["error_type"] and failed["labels"]["dcp_run_id"] == labels["dcp_run_id"]
    assert failed["labels"]["severity"] == "warning"
    # One rank's full disk fails the save on every rank: one failed checkpoint (increase() extrapolates a little).
    assert 1 <= float(failed["value"]) < 1.5
    # Every rank's NaN loss is a metric dcp-otel drops: counted, and told, as telemetry lost.
    problems = firing["DCPTelemetryProblems"]
    assert problems["labels"]["reason"] == "torchelastic_bad_value" and problems["labels"]["severity"] == "warning"
    assert problems["labels"]["job"] == RANK_JOB and float(problems["value"]) == WORLD


def test_the_agent_and_the_ranks_are_labelled_with_the_same_run(stack: dict[str, Any]) -> None:
    """torchrun --standalone draws the rendezvous id after dcp-otel-run started serving: the agent's discovery
    file is relabelled with the run id its workers resolve, so the torchelastic dashboard's Run is the ranks'."""
    runs = stack["dcp-otel-checkpoints.json"]["variables"]["run"]
    assert len(runs) == 1 and stack["dcp-otel-torchelastic.json"]["variables"]["run"] == runs


def test_where_each_rank_is_now_gives_each_row_its_age_and_its_start_for_the_trace_link(stack: dict[str, Any]) -> None:
    """The table merges its two queries on their labels: they must answer for the same open operations."""
    age, since = [q for q in stack["dcp-otel-ranks.json"]["queries"] if q["panel"] == "Where each rank is now"]
    rows = [sorted(json.dumps({k: v for k, v in r["metric"].items() if k != "__name__"}, sort_keys=True)
                   for r in q["result"]) for q in (age, since)]  # fmt: skip
    assert rows[0] == rows[1] and len(rows[0]) == WORLD, rows
    for a, b in zip(sorted(age["result"], key=lambda r: r["metric"]["rank"]),
                    sorted(since["result"], key=lambda r: r["metric"]["rank"]), strict=True):  # fmt: skip
        # since (ms) + age (s) = the query's time
        assert float(b["value"][1]) / 1000 + float(a["value"][1]) == pytest.approx(float(a["value"][0]), abs=1)


def test_targets_come_from_the_files_dcp_otel_writes_and_leave_with_the_job(stack: dict[str, Any]) -> None:
    assert len(stack["targets_live"]) == WORLD + 1  # 3 ranks and the agent
    assert sum(name.startswith("agent-") for name in stack["targets_live"]) == 1
    assert stack["targets_after"] == []


def test_the_agent_dashboard_tells_the_restart_and_the_run_result(stack: dict[str, Any]) -> None:
    by_panel = {q["panel"]: q for q in stack["dcp-otel-torchelastic.json"]["queries"]}
    (restarts,) = by_panel["Worker group restarts"]["result"]
    assert float(restarts["value"][1]) == 1  # the first attempt failed, once
    results = {r["metric"]["name"]: float(r["value"][1]) for r in by_panel["Run results"]["result"]}
    assert results["workers.default.run_success_with_retries"] == 1
    assert results["workers.default.run_failed_no_retries"] == 0
    (left,) = by_panel["Worker restarts left"]["result"]
    assert float(left["value"][1]) == 0
    assert all(float(r["value"][1]) > 0 for r in by_panel["Rendezvous duration"]["result"])
    dropped = {r["metric"]["reason"]: float(r["value"][1]) for r in by_panel["Dropped metrics"]["result"]}
    assert dropped == {"bad_value": WORLD}  # each rank's NaN loss, refused and counted


def test_the_readme_pictures_are_drawn_from_the_runs_query_results(stack: dict[str, Any]) -> None:
    for name, drawn in stack["drawn"].items():
        assert drawn and all(count > 0 for count in drawn.values()), (name, drawn)
        png = stack["pictures"] / name.replace(".json", ".png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
