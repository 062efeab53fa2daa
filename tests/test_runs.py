"""Two runs of one job, side by side on one real Prometheus: the dashboards tell them apart.

A cluster's Prometheus scrapes many jobs and runs at once. Here two real runs
(``workers/metrics_rank.py``: run ``run-a`` with 2 gloo ranks, run ``run-b``
with 1, both named ``llama`` by ``OTEL_SERVICE_NAME``) announce their endpoints
through dcp-otel's discovery files to a Prometheus running our shipped
``prometheus.yml``; every query of the Checkpoints and Ranks dashboards then
runs with its variables as Grafana sends them.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcp_otel import semconv
from mixin.dashboards import panels, render_expr
from tests.prometheus import PrometheusServer
from tests.stack import PROMETHEUS_DIR, live_config
from tests.test_exposition import metrics_job

DASHBOARDS = Path(__file__).parent.parent / "grafana" / "dashboards"
RUNS = {"run-a": 2, "run-b": 1}  # run id -> ranks
JOB = "llama"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Both runs live, scraped by one Prometheus until it has every rank's checkpoints; what the checks need."""
    tmp = tmp_path_factory.mktemp("two-runs")
    targets = tmp / "targets"
    targets.mkdir()  # before Prometheus starts: it watches the folder for the files as they come
    env = {semconv.ENV_FILE_SD_DIR: str(targets), "OTEL_SERVICE_NAME": JOB}
    prometheus = PrometheusServer(live_config(PROMETHEUS_DIR / "prometheus.yml", targets), tmp / "prometheus")
    with prometheus as prom, contextlib.ExitStack() as jobs:
        t_start = time.time()
        for run, world in RUNS.items():  # each rank waits to be scraped, checkpoints, waits to be scraped again
            (tmp / run).mkdir()
            jobs.enter_context(metrics_job(tmp / run, world, {**env, semconv.ENV_RUN_ID: run}, "scraped_rank"))
        files = {p.name: json.loads(p.read_text()) for p in targets.glob("rank-*.json")}
        wait_for_every_rank(prom)
        yield {"prom": prom, "files": files, "start": t_start, "at": time.time()}


def wait_for_every_rank(prom: PrometheusServer, timeout_s: float = 60.0) -> None:
    """Until Prometheus has stored every rank's saves of both runs, three scrapes of each at least (a range
    query's steps, a second apart, then see two: a rate needs two)."""
    expected = sum(RUNS.values())
    deadline, wake = time.monotonic() + timeout_s, threading.Event()
    stored = 'count_over_time(dcp_operations_total{operation="save",status="success"}[1m]) >= 3'
    while len(prom.query(stored)) < expected:
        assert time.monotonic() < deadline, "Prometheus never scraped every rank of both runs"
        wake.wait(0.25)  # polling a real server, bounded by the deadline


def answers(two_runs: dict[str, Any], name: str, run: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """(panel title, result series) of every query of dashboard ``name`` with the Run variable at ``run``."""
    prom, start, at = two_runs["prom"], two_runs["start"], two_runs["at"]
    chosen = {"job": ".+", "run": run, "rank": ".+", "step": ".+"}
    found = []
    for panel in panels(json.loads((DASHBOARDS / name).read_text())):
        for target in panel["targets"]:
            expr = render_expr(target["expr"], chosen, rate_interval="1m", time_range="10m")
            result = prom.query(expr, at=at) if target.get("instant") else prom.query_range(expr, start, at)
            found.append((panel["title"], result))
    return found


def test_each_discovery_file_names_its_run_host_and_job(two_runs: dict[str, Any]) -> None:
    runs = [group["labels"][semconv.LABEL_RUN_ID] for groups in two_runs["files"].values() for group in groups]
    assert sorted(runs) == sorted(run for run, world in RUNS.items() for _ in range(world))
    assert all(g["labels"]["job"] == JOB and g["labels"][semconv.LABEL_HOST]
               for groups in two_runs["files"].values() for g in groups)  # fmt: skip
    # ... and Prometheus puts them on the series: the job is the job's name, not the scrape config's.
    series = two_runs["prom"].query("count by (job, dcp_run_id) (dcp_operations_total)")
    assert sorted((s["metric"]["job"], s["metric"][semconv.LABEL_RUN_ID]) for s in series) == [(JOB, r) for r in RUNS]


def test_the_run_variable_lists_both_runs(two_runs: dict[str, Any]) -> None:
    model = json.loads((DASHBOARDS / "dcp-otel-checkpoints.json").read_text())
    (run_var,) = [v for v in model["templating"]["list"] if v["name"] == "run"]
    match = run_var["query"].removeprefix("label_values(").rsplit(",", 1)[0]
    selector = render_expr(match, {"job": ".+"}, rate_interval="1m", time_range="10m")
    found = {s.get(semconv.LABEL_RUN_ID) for s in two_runs["prom"].series(selector, two_runs["start"], two_runs["at"])}
    assert found == set(RUNS)


@pytest.mark.parametrize("name", ["dcp-otel-checkpoints.json", "dcp-otel-ranks.json"])
@pytest.mark.parametrize("run", list(RUNS))
def test_filtered_by_run_every_panel_answers_for_that_run_only(two_runs: dict[str, Any], name: str, run: str) -> None:
    with_data = 0
    for title, result in answers(two_runs, name, run):
        for series in result:
            assert series["metric"].get(semconv.LABEL_RUN_ID) == run, (title, series["metric"])
        with_data += bool(result)
    # Everything but what needs a failure, a stall or an open checkpoint (none here) answers.
    assert with_data >= {"dcp-otel-checkpoints.json": 15, "dcp-otel-ranks.json": 6}[name], with_data


@pytest.mark.parametrize("name", ["dcp-otel-checkpoints.json", "dcp-otel-ranks.json"])
def test_with_every_run_selected_no_panel_adds_them_up(two_runs: dict[str, Any], name: str) -> None:
    """"All" draws each run as its own series: the same answers as each run alone, side by side."""
    model = json.loads((DASHBOARDS / name).read_text())
    (every_run,) = [v["allValue"] for v in model["templating"]["list"] if v["name"] == "run"]
    everything = answers(two_runs, name, every_run)
    alone = {run: answers(two_runs, name, run) for run in RUNS}
    for i, (title, result) in enumerate(everything):
        runs = [series["metric"].get(semconv.LABEL_RUN_ID) for series in result]
        assert None not in runs, title
        for run in RUNS:
            own = alone[run][i][1]
            assert sorted(json.dumps(s["metric"], sort_keys=True) for s in result if s["metric"][semconv.LABEL_RUN_ID] == run) \
                == sorted(json.dumps(s["metric"], sort_keys=True) for s in own), title
    if name == "dcp-otel-checkpoints.json":  # both runs' saves, each its own series
        (saves,) = [result for title, result in everything if title == "Operations by status"]
        assert {series["metric"][semconv.LABEL_RUN_ID] for series in saves} == set(RUNS)
