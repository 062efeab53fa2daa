"""dcp-otel-run: a real torchelastic agent whose own metrics are served."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dcp_otel import semconv
from tests.ports import free_port_range
from tests.ranks import WORKERS, rank_env


def test_the_agents_prof_metrics_are_served_while_its_workers_run(tmp_path: Path) -> None:
    port = free_port_range(1)
    url = f"http://127.0.0.1:{port}/metrics"
    scrape = tmp_path / "agent-metrics.txt"
    env = rank_env(**{semconv.ENV_AGENT_METRICS_PORT: str(port), semconv.ENV_METRICS_ADDR: "127.0.0.1",
                      "AGENT_METRICS_URL": url, "SCRAPE_OUT": str(scrape)})  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "dcp_otel.elastic.launcher", "--standalone", "--nproc-per-node", "2",
         str(WORKERS / "elastic_worker.py")],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )  # fmt: skip

    assert run.returncode == 0, run.stderr[-4000:]
    assert f"dcp-otel-run: torchelastic agent metrics at {url}" in run.stderr
    text = scrape.read_text()  # what rank 0 scraped from its agent, over HTTP
    rendezvous = 'group="torchelastic",name="SimpleElasticAgent._rendezvous"'
    assert f"torchelastic_calls_total{{{rendezvous},status=\"success\"}} 1.0" in text
    assert f"torchelastic_duration_seconds_count{{{rendezvous}}} 1.0" in text


def test_the_console_script_is_torchrun_and_its_help_starts_nothing() -> None:
    script = Path(sys.executable).with_name("dcp-otel-run")
    env = {**os.environ, semconv.ENV_AGENT_METRICS_PORT: "0", semconv.ENV_METRICS_ADDR: "127.0.0.1"}
    shown = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert shown.returncode == 0 and "--nproc-per-node" in shown.stdout  # torchrun's own arguments
    assert "metrics at" not in shown.stderr, shown.stderr  # no agent endpoint was started for it


def test_every_round_of_workers_gets_its_own_generation_shared_by_its_ranks(tmp_path: Path) -> None:
    env = rank_env(**{semconv.ENV_AGENT_METRICS_PORT: "0", semconv.ENV_METRICS_ADDR: "127.0.0.1",
                      "OUT_DIR": str(tmp_path)})  # fmt: skip
    env.pop(semconv.ENV_GENERATION, None)
    run = subprocess.run(
        [sys.executable, "-m", "dcp_otel.elastic.launcher", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--monitor-interval", "0.1", str(WORKERS / "generation_worker.py")],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    rounds = {r: {(tmp_path / f"gen-{r}-{rank}.txt").read_text() for rank in (0, 1)} for r in (0, 1)}
    assert all(len(values) == 1 and "" not in values for values in rounds.values()), rounds  # shared by the round
    assert rounds[0] != rounds[1]  # and new in the next one


def stopped_by_sigterm_in_the_metric_sink(tmp_path: Path, plain: bool) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run the job of ``tests/workers/agent_sigterm.py``: SIGTERM reaches the agent inside its metric sink."""
    out = tmp_path / ("plain" if plain else "traced")
    out.mkdir()
    env = rank_env(**{semconv.ENV_AGENT_METRICS_PORT: "0", semconv.ENV_METRICS_ADDR: "127.0.0.1", "OUT_DIR": str(out),
                      "WORKERS": "2"})  # fmt: skip
    script = str(WORKERS / "agent_sigterm.py")
    run = subprocess.run(
        [sys.executable, script, "launch", *(["--plain"] if plain else []), "--standalone", "--nproc-per-node", "2",
         "--monitor-interval", "0.1", script, "worker"],
        capture_output=True, text=True, timeout=240, env=env, cwd=out,
    )  # fmt: skip
    return run, {p.name for p in out.iterdir()}


def test_sigterm_reaching_the_agent_inside_its_metric_handler_stops_the_job_as_without_dcp_otel(tmp_path: Path) -> None:
    """torchelastic turns SIGTERM into an exception raised wherever the agent's main thread is; there, in
    ``OTelMetricHandler``, it once was swallowed and the job ran on (the workers finished their 60 s)."""
    traced, traced_files = stopped_by_sigterm_in_the_metric_sink(tmp_path, plain=False)
    plain, plain_files = stopped_by_sigterm_in_the_metric_sink(tmp_path, plain=True)
    for run in (plain, traced):
        assert "Received 15 death signal, shutting down workers" in run.stderr, run.stderr[-4000:]
        assert "SignalException" in run.stderr
    assert traced.returncode == plain.returncode != 0
    assert traced_files == plain_files == {"started-0", "started-1"}  # no worker finished: each was stopped
