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

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime, timedelta
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
#: The job's stall threshold: its last async save hangs (on SLOW_RANK) while the test looks.
STALL_AFTER_S = 2
#: The agent's remote-write progress: the newest sample timestamp it has sent, in whole seconds (Prometheus
#: divides its milliseconds by 1000), so a sample sent at 13.2 s says nothing of one scraped at 13.7 s.
_SENT = re.compile(r"^prometheus_remote_storage_queue_highest_sent_timestamp_seconds\{[^}]*\} (\S+)$", re.MULTILINE)
#: What the agent's remote-write took in (samples and histograms appended: no labels; not exemplars, which every
#: scrape counts in again while the agent's log keeps each once, so they never balance) ...
_TAKEN_IN = re.compile(r"^prometheus_remote_storage_(?:samples|histograms)_in_total (\S+)$", re.MULTILINE)
#: ... and what its queue is done with: sent, dropped or given up (per queue, labelled).
_DONE = re.compile(r"^prometheus_remote_storage_(?:samples|histograms)_(?:total|dropped_total|failed_total)"
                   r"\{[^}]*\} (\S+)$", re.MULTILINE)  # fmt: skip


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


def agent_config(shipped: Path, targets: Path, central_url: str, interval: str = "1s") -> dict[str, Any]:
    """Our shipped agent.yml, for a test: fast intervals, this run's file_sd folder, this central Prometheus."""
    config = yaml.safe_load(shipped.read_text())
    config["global"]["scrape_interval"] = interval
    for job in config["scrape_configs"]:
        for sd in job["file_sd_configs"]:
            sd["files"] = [str(targets / Path(f).name) for f in sd["files"]]
    (remote,) = config["remote_write"]
    remote["url"] = f"{central_url}/api/v1/write"
    remote["queue_config"]["batch_send_deadline"] = interval
    return config


def central_config(shipped: Path, interval: str = "1s") -> dict[str, Any]:
    """The central Prometheus behind the agents: our rules, no scrape job of its own."""
    config = yaml.safe_load(shipped.read_text())
    return {"global": {"evaluation_interval": interval},
            "rule_files": [str((shipped.parent / f).resolve()) for f in config["rule_files"]]}  # fmt: skip


class Stack:
    """A real Prometheus (our config and rules) and, in :meth:`run_job`, a real job.

    With ``agent=True``, what scrapes the job is a Prometheus in agent mode with our
    ``agent.yml``, remote-writing to a central Prometheus (the remote-write
    receiver, with our rules) that :attr:`prom` then is: what a many-node job runs.
    """

    def __init__(self, tmp: Path, *, agent: bool = False) -> None:
        self.tmp = tmp
        self.targets = tmp / "targets"
        self.targets.mkdir(parents=True, exist_ok=True)
        shipped = PROMETHEUS_DIR / "prometheus.yml"
        if agent:
            self.prom = PrometheusServer(central_config(shipped), tmp / "central",
                                         flags=("--web.enable-remote-write-receiver",))  # fmt: skip
        else:
            self.prom = PrometheusServer(live_config(shipped, self.targets), tmp)
        self.scraper: PrometheusServer | None = None  # the agent, once the central side is up
        self._agent = agent
        self.t_start = time.time()
        self.t_ranks = self.t_agent = 0.0
        self.job_log = tmp / "job.log"
        self._job: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Stack:
        self.prom.__enter__()
        if self._agent:
            config = agent_config(PROMETHEUS_DIR / "agent.yml", self.targets, self.prom.url)
            self.scraper = PrometheusServer(config, self.tmp / "agent", agent=True)
            try:
                self.scraper.__enter__()
            except BaseException:
                self.prom.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._job is not None and self._job.poll() is None:
            self._job.kill()
            self._job.wait()
        if self.scraper is not None:
            self.scraper.__exit__(*exc)
        self.prom.__exit__(*exc)

    def _agent_metrics(self) -> str:
        assert self.scraper is not None
        with urllib.request.urlopen(f"{self.scraper.url}/metrics", timeout=10) as response:  # noqa: S310 - loopback
            return response.read().decode()

    def _poll(self, done: Callable[[], bool], why: str, timeout_s: float = 60.0) -> None:
        """Until ``done()``; fail with ``why`` and the logs after ``timeout_s``."""
        deadline, wake = time.monotonic() + timeout_s, threading.Event()
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"{why}:\n{self.log_tail()}")
            wake.wait(0.25)  # polling the agent's progress, bounded by the deadline

    def wait_until_sent(self, at: float) -> None:
        """Until the agent has sent the central side a sample scraped after ``at`` (no-op without an agent).

        Scrapes reach the central side through the agent's remote-write queue, a
        batch at a time; the agent's own metrics say how far it has sent. For
        live targets, scraped every second, a sample from a later whole second
        (the resolution of that metric) having gone means those before it went.
        """
        if self.scraper is not None:
            self._poll(lambda: max((float(v) for v in _SENT.findall(self._agent_metrics())), default=0.0) >= at,
                       f"the agent never sent its samples up to {at}")  # fmt: skip

    def wait_until_all_sent(self, ended: float) -> None:
        """After the job ``ended``: until the agent has sent the central side all it scraped (no-op without one).

        The torchelastic agent's last scrape, which holds its run results, is the
        last sample of the run, scraped in the second the job ends: no later
        sample tells it went. So first the agent has done with that target (the
        target is gone, or a scrape began after the job ended: a target's scrapes
        are appended in turn), then every sample it took in is accounted for:
        sent, dropped or failed.
        """
        if self.scraper is None:
            return
        self._poll(lambda: self._agent_target_done(ended), "the agent never finished with the torchelastic agent's target")

        def accounted() -> bool:
            text = self._agent_metrics()
            taken_in = sum(float(v) for v in _TAKEN_IN.findall(text))
            return taken_in > 0 and sum(float(v) for v in _DONE.findall(text)) >= taken_in

        self._poll(accounted, "the agent never sent all it scraped")

    def _agent_target_done(self, ended: float) -> bool:
        assert self.scraper is not None
        targets = self.scraper.api("targets", state="active")["activeTargets"]
        last = [t["lastScrape"] for t in targets if t["labels"].get("job") == AGENT_JOB]
        # RFC 3339 with nanoseconds; fromisoformat takes microseconds at most.
        return all(datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", t)).timestamp() > ended for t in last)

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
            semconv.ENV_STALL_AFTER_S: str(STALL_AFTER_S),
        })  # fmt: skip
        command = [
            sys.executable, "-m", "dcp_otel.elastic.launcher", "--standalone", "--nproc-per-node", str(WORLD),
            "--max-restarts", "1", "--monitor-interval", "0.5", str(WORKERS / "stack_train.py"),
        ]  # fmt: skip
        with self.job_log.open("wb") as log:
            self._job = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp)
        try:
            store.wait([f"scraped/{rank}" for rank in range(WORLD)])
        except Exception as exc:  # the store's timeout: say why, with the job's own words
            raise AssertionError(f"the ranks never finished: {exc}\n{self.log_tail()}") from exc
        self.t_ranks = time.time()
        self.wait_until_sent(self.t_ranks)
        try:
            while_ranks_live()
        finally:
            store.set("exit", "1")
            try:
                code = self._job.wait(timeout=JOB_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
        ended = time.time()
        assert code == 0, f"the job ended with {code}:\n{self.log_tail()}"
        self.wait_until_all_sent(ended)  # the agent's final scrape, too
        self.t_agent = self.last_scrape(AGENT_JOB)

    def last_scrape(self, job: str) -> float:
        """The time of the last stored scrape of ``job`` (its series are stale after it)."""
        (up,) = self.prom.query(f'up{{job="{job}"}}[15m]', at=time.time())
        return max(float(t) for t, value in up["values"] if value == "1")

    def log_tail(self) -> str:
        agent = "".join(self.scraper.log[-20:]) if self.scraper is not None else ""
        job = self.job_log.read_text(errors="replace")[-6000:] if self.job_log.exists() else ""
        return job + "\n--- prometheus ---\n" + "".join(self.prom.log[-20:]) + ("\n--- agent ---\n" + agent if agent else "")


def draw(live: Stack, dashboard: str, at: float, out_dir: Path) -> dict[str, int]:
    """The documentation's picture of ``dashboard``'s main panels, from this run, up to ``at``."""
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
