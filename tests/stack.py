"""The receiving stack, live: our Prometheus config and rules in a real Prometheus,
scraping a real torchrun job (``dcp-otel-run``, 3 ranks, gloo on CPU) that finds
its targets through the file_sd files dcp-otel writes.

Two moments are worth querying, and :class:`Stack` stops at both:

- ``while_ranks_live`` runs once every rank has done all its checkpoints and
  Prometheus has stored them, while the ranks still serve (their series are
  live at ``stack.t_ranks``);
- when the job has ended, ``stack.t_agent`` is the time of the agent's final
  scrape (``DCP_OTEL_FINAL_SCRAPE_TIMEOUT_S``), which holds its run results.

Usage::

    with Stack(tmp_path) as stack:
        stack.run_job(while_ranks_live=lambda: check(stack.prom, stack.t_ranks))
        check_agent(stack.prom, stack.t_agent)
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from dcp_otel import semconv
from tests.ports import free_port_range
from tests.prometheus import PrometheusServer
from tests.ranks import REPO, WORKERS, rank_env

PROMETHEUS_DIR = REPO / "exporters" / "prometheus"
WORLD = 3
SLOW_RANK, FAIL_RANK = 2, 1
RANK_JOB, AGENT_JOB = "dcp-otel", "torchelastic-agent"
JOB_TIMEOUT_S = 420


def live_config(shipped: Path, targets: Path, interval: str = "1s") -> dict[str, Any]:
    """Our shipped prometheus.yml, for a test: fast intervals, this run's file_sd folder,
    no static example targets, rules from the repository (absolute paths)."""
    config = yaml.safe_load(shipped.read_text())
    config["global"] = {"scrape_interval": interval, "evaluation_interval": interval}
    config["rule_files"] = [str((shipped.parent / f).resolve()) for f in config["rule_files"]]
    jobs = []
    for job in config["scrape_configs"]:
        if not job.get("file_sd_configs"):
            continue  # the Collector's job: no Collector here
        job.pop("static_configs", None)
        for sd in job["file_sd_configs"]:
            sd["files"] = [str(targets / Path(f).name) for f in sd["files"]]
        jobs.append(job)
    config["scrape_configs"] = jobs
    return config


class Stack:
    """A real Prometheus (our config and rules) and, in :meth:`run_job`, a real job."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.targets = tmp / "targets"
        self.targets.mkdir(parents=True, exist_ok=True)
        self.prom = PrometheusServer(live_config(PROMETHEUS_DIR / "prometheus.yml", self.targets), tmp)
        self.t_start = time.time()
        self.t_ranks = self.t_agent = 0.0
        self.job_log = tmp / "job.log"
        self._job: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Stack:
        self.prom.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._job is not None and self._job.poll() is None:
            self._job.kill()
            self._job.wait()
        self.prom.__exit__(*exc)

    def run_job(self, while_ranks_live: Callable[[], None] = lambda: None) -> None:
        """Run the job to its end; raise with its log if it fails or overruns."""
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=JOB_TIMEOUT_S))  # fmt: skip
        base, agent = free_port_range(WORLD), free_port_range(1)
        env = rank_env(**{
            "STACK_METRICS_PORT": str(base), semconv.ENV_AGENT_METRICS_PORT: str(agent),
            semconv.ENV_METRICS_ADDR: "127.0.0.1", semconv.ENV_FILE_SD_DIR: str(self.targets),
            semconv.ENV_FINAL_SCRAPE_TIMEOUT_S: "120", "STACK_STORE_PORT": str(store.port),
            "STACK_SLOW_RANK": str(SLOW_RANK), "STACK_FAIL_RANK": str(FAIL_RANK),
            "STACK_CKPT": str(self.tmp / "ckpt"), "OTEL_TRACES_EXPORTER": "none",
        })  # fmt: skip
        command = [
            sys.executable, "-m", "dcp_otel.launcher", "--standalone", "--nproc-per-node", str(WORLD),
            "--max-restarts", "1", "--monitor-interval", "0.5", str(WORKERS / "stack_train.py"),
        ]  # fmt: skip
        with self.job_log.open("wb") as log:
            self._job = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp)
        try:
            store.wait([f"scraped/{rank}" for rank in range(WORLD)])
        except Exception as exc:  # the store's timeout: say why, with the job's own words
            raise AssertionError(f"the ranks never finished: {exc}\n{self.log_tail()}") from exc
        self.t_ranks = time.time()
        try:
            while_ranks_live()
        finally:
            store.set("exit", "1")
            try:
                code = self._job.wait(timeout=JOB_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
        assert code == 0, f"the job ended with {code}:\n{self.log_tail()}"
        self.t_agent = self.last_scrape(AGENT_JOB)

    def last_scrape(self, job: str) -> float:
        """The time of the last stored scrape of ``job`` (its series are stale after it)."""
        (up,) = self.prom.query(f'up{{job="{job}"}}[15m]', at=time.time())
        return max(float(t) for t, value in up["values"] if value == "1")

    def log_tail(self) -> str:
        return self.job_log.read_text(errors="replace")[-6000:] + "\n--- prometheus ---\n" + "".join(self.prom.log[-20:])


def draw(live: Stack, dashboard: str, at: float, out_dir: Path) -> dict[str, int]:
    """The documentation's picture of ``dashboard``'s main panels, from this run, up to ``at``."""
    import json

    from mixin.pictures import MAIN_PANELS, render

    model = json.loads((REPO / "grafana" / "dashboards" / dashboard).read_text())
    out = out_dir / dashboard.replace(".json", ".png")
    return render(live.prom, model, MAIN_PANELS[dashboard], live.t_start, at, out)


def pictures(out_dir: Path, tmp: Path) -> None:
    """Run the stack once and draw every dashboard's picture into ``out_dir``."""
    with Stack(tmp) as live:
        live.run_job(lambda: [draw(live, name, live.t_ranks, out_dir)
                              for name in ("dcp-otel-checkpoints.json", "dcp-otel-ranks.json")])  # fmt: skip
        draw(live, "dcp-otel-torchelastic.json", live.t_agent, out_dir)


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="Draw the dashboards' pictures from a live run of the stack.")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dcp-otel-pictures-") as scratch:
        pictures(args.out_dir, Path(scratch))
    print(f"pictures in {args.out_dir}")
