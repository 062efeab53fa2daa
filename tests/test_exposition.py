"""Each rank serves its metrics; a taken port never breaks training."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.openmetrics.parser import text_string_to_metric_families

import dcp_otel
from dcp_otel import _selftelemetry, semconv
from dcp_otel.metrics.exposition import metrics_port
from tests.ports import free_port_range
from tests.ranks import rank_command, rank_env


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("probe", "a metric to find in the exposition", registry=registry).inc()
    return registry


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def scrape(url: str, headers: dict[str, str] | None = None) -> str:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback URL we built
        return response.read().decode()


def test_each_local_rank_serves_on_base_port_plus_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert metrics_port(9000) == 9003
    assert metrics_port(9000, per_rank=False) == 9000
    monkeypatch.setenv(semconv.ENV_METRICS_PORT, "9100")
    assert metrics_port() == 9103
    monkeypatch.delenv(semconv.ENV_METRICS_PORT)
    assert metrics_port() == semconv.DEFAULT_METRICS_PORT + 3
    with pytest.raises(ValueError, match="from 0 to 65535"):
        metrics_port(70000)


@pytest.mark.parametrize("bad", ["not-a-port", "70000", "-1"])
def test_a_bad_port_variable_warns_and_uses_the_default(monkeypatch: pytest.MonkeyPatch, caplog, bad: str) -> None:
    from dcp_otel.elastic.launcher import agent_metrics_port

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(semconv.ENV_METRICS_PORT, bad)
    monkeypatch.setenv(semconv.ENV_AGENT_METRICS_PORT, bad)
    assert metrics_port() == semconv.DEFAULT_METRICS_PORT + 1
    assert agent_metrics_port() == semconv.DEFAULT_AGENT_METRICS_PORT
    assert f"ignoring {semconv.ENV_METRICS_PORT}={bad!r}" in caplog.text
    assert f"ignoring {semconv.ENV_AGENT_METRICS_PORT}={bad!r}" in caplog.text


def test_the_endpoint_serves_the_registry(registry: CollectorRegistry) -> None:
    endpoint = dcp_otel.start_metrics_server(0, "127.0.0.1", registry=registry)
    try:
        assert endpoint.addr == "127.0.0.1" and endpoint.port > 0
        assert "probe_total 1.0" in scrape(endpoint.url)
    finally:
        endpoint.close()


def test_a_port_in_use_falls_back_with_a_counted_warning(registry: CollectorRegistry, taken_port: int, caplog) -> None:
    _selftelemetry.reset()  # its warnings are rate-limited per reason
    before = dcp_otel.diagnostics().get("metrics_port_in_use", 0)
    endpoint = dcp_otel.start_metrics_server(taken_port, "127.0.0.1", registry=registry, per_rank=False)
    try:
        assert endpoint.fell_back and endpoint.requested_port == taken_port and endpoint.port != taken_port
        assert dcp_otel.diagnostics()["metrics_port_in_use"] == before + 1
        assert f"cannot serve metrics on 127.0.0.1:{taken_port}" in caplog.text
        assert endpoint.url in caplog.text  # the warning says where the metrics went
        assert "probe_total 1.0" in scrape(endpoint.url)
    finally:
        endpoint.close()


def test_the_metrics_port_variable_serves_with_no_code(monkeypatch: pytest.MonkeyPatch, registry) -> None:
    monkeypatch.setenv(semconv.ENV_METRICS_PORT, "0")  # 0: the OS picks, so the test never collides
    monkeypatch.setenv(semconv.ENV_METRICS_ADDR, "127.0.0.1")
    dcp_otel.instrument(registry=registry)
    try:
        endpoint = dcp_otel.DCPInstrumentor().metrics_endpoint
        assert endpoint is not None and endpoint.addr == "127.0.0.1"
        assert "# TYPE dcp_operations_total counter" in scrape(endpoint.url)
        url = endpoint.url
    finally:
        dcp_otel.uninstrument()
    with pytest.raises(OSError):  # uninstrument stopped it
        scrape(url)


def test_a_bad_bind_address_fails_at_configuration_time_leaving_nothing(
    monkeypatch: pytest.MonkeyPatch, registry: CollectorRegistry
) -> None:
    import torch.distributed.checkpoint.logger as dcp_logger_module
    from prometheus_client import generate_latest

    from dcp_otel.attach.logger_tap import DCPLoggerTap

    # Not an address of this machine: bind() fails locally (no packet is sent).
    monkeypatch.setenv(semconv.ENV_METRICS_ADDR, "192.0.2.1")
    with pytest.raises(OSError):
        dcp_otel.instrument(registry=registry, metrics_port=0)
    assert dcp_otel.DCPInstrumentor().recorder is None
    assert not isinstance(dcp_logger_module._dcp_logger, DCPLoggerTap)
    assert b"dcp_operations" not in generate_latest(registry)


@contextlib.contextmanager
def metrics_job(tmp_path: Path, world: int, extra_env: dict[str, str],
                worker: str = "metrics_rank") -> Iterator[tuple[int, list[list[str]]]]:  # fmt: skip
    """Run ``world`` ranks of workers/<worker>.py; yield (base port, their READY lines) while they wait."""
    base = free_port_range(world)
    procs = []
    for rank in range(world):
        env = rank_env(LOCAL_RANK=str(rank), **{semconv.ENV_METRICS_PORT: str(base), semconv.ENV_METRICS_ADDR: "127.0.0.1",
                                                semconv.ENV_RUN_ID: "scrape-test", **extra_env})  # fmt: skip
        cmd = rank_command(worker, rank, world, tmp_path, tmp_path, tmp_path / "ckpt")
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    try:
        ready = [proc.stdout.readline().split() for proc in procs]  # type: ignore[union-attr]
        assert all(line and line[0] == "READY" for line in ready), ready
        yield base, ready
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.stdin.write("\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert [proc.returncode for proc in procs] == [0] * world


def test_every_rank_of_a_real_job_serves_its_own_metrics(tmp_path: Path) -> None:
    with metrics_job(tmp_path, 2, {}) as (base, ready):
        for rank, (_, url, written) in enumerate(ready):
            assert url == f"http://127.0.0.1:{base + rank}/metrics"  # base port + LOCAL_RANK
            text = scrape(url)
            ops = f'dcp_operations_total{{operation="save",rank="{rank}",status="success"}} 1.0'
            assert ops in text
            assert f'dcp_read_bytes_total{{rank="{rank}"}}' in text
            # Each rank counts its own bytes: two saves of its data (save, async_save).
            families = {f.name: f for f in text_string_to_metric_families(scrape_openmetrics(url))}
            (written_sample,) = [s for s in families["dcp_written_bytes"].samples if s.name.endswith("_total")]
            assert written_sample.labels == {"rank": str(rank)}
            assert written_sample.value >= 2 * int(written)
            exemplars = [s.exemplar for s in families["dcp_operation_duration_seconds"].samples if s.exemplar]
            assert exemplars and all(e.labels["rank"] == str(rank) for e in exemplars)


def test_multiprocess_mode_serves_the_whole_node_from_local_rank_zero(tmp_path: Path) -> None:
    shared = tmp_path / "prometheus-multiproc"
    shared.mkdir()
    with metrics_job(tmp_path, 2, {"PROMETHEUS_MULTIPROC_DIR": str(shared)}) as (base, ready):
        assert [line[1] for line in ready] == [f"http://127.0.0.1:{base}/metrics", "none"]
        text = scrape(ready[0][1])
        for rank in (0, 1):  # both ranks' metrics, from one endpoint
            assert f'dcp_operations_total{{operation="save",rank="{rank}",status="success"}} 1.0' in text
        assert "# {" not in scrape_openmetrics(ready[0][1])  # prometheus_client keeps no exemplars here
        assert len(list(shared.glob("gauge_livesum_*.db"))) == 2  # the in-flight gauge, one file per rank
    assert not list(shared.glob("gauge_livesum_*.db"))  # each rank marked itself dead at exit


STUCK_UPLOAD = r"""
import sys, threading, torch, torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
import dcp_otel

class StuckWriter(dcp.FileSystemWriter):  # an upload that never finishes
    def write_data(self, plan, planner):
        threading.Event().wait()

dcp_otel.instrument(tracer_provider=TracerProvider(), registry=CollectorRegistry())
dcp.async_save({"w": torch.ones(4)}, storage_writer=StuckWriter(sys.argv[1]))
print("UPLOADING", flush=True)
sys.stdin.readline()
"""


def test_a_rank_killed_mid_upload_does_not_leave_the_in_flight_gauge_stuck(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "prometheus-multiproc"
    shared.mkdir()
    env = rank_env(PROMETHEUS_MULTIPROC_DIR=str(shared), LOCAL_RANK="1")
    rank = subprocess.Popen([sys.executable, "-c", STUCK_UPLOAD, str(tmp_path / "ckpt")], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "UPLOADING"
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(shared))  # this process serves the node, as local rank 0
        monkeypatch.setenv("LOCAL_RANK", "0")
        endpoint = dcp_otel.start_metrics_server(0, "127.0.0.1")
        assert endpoint is not None
        try:
            assert 'dcp_async_saves_in_flight{rank="0"} 1.0' in scrape(endpoint.url)  # the upload is in flight
            rank.kill()  # SIGKILL: no exit handler runs
            rank.wait(timeout=30)
            text = scrape(endpoint.url)
            # Before: 1 forever (and DCPAsyncSaveStuck firing forever). A dead process's live gauge is gone.
            assert 'dcp_async_saves_in_flight{rank="0"}' not in text, text
            assert not list(shared.glob(f"gauge_livesum_{rank.pid}.db"))
        finally:
            endpoint.close()
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait(timeout=30)


def scrape_openmetrics(url: str) -> str:
    """Scrape as Prometheus does: asking for OpenMetrics, the format that carries exemplars."""
    return scrape(url, {"Accept": "application/openmetrics-text; version=1.0.0"})


def test_an_endpoint_announces_itself_to_prometheus_file_discovery_until_it_closes(
    registry: CollectorRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    targets = tmp_path / "targets"  # created on demand
    monkeypatch.setenv(semconv.ENV_FILE_SD_DIR, str(targets))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-7")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llama-pretrain")
    endpoint = dcp_otel.start_metrics_server(0, "127.0.0.1", registry=registry)
    agent = dcp_otel.start_metrics_server(0, "127.0.0.1", registry=registry, per_rank=False, role="agent")
    assert endpoint is not None and agent is not None
    try:
        rank_file = targets / f"rank-127.0.0.1-{endpoint.port}.json"
        # Exactly the format of Prometheus's file_sd_configs; nothing else (no partial file) in the folder.
        # Labelled with the run (as the ranks resolve its id), the node and the job's name (OTEL_SERVICE_NAME).
        labels = {"dcp_run_id": "rdzv-7", "host_name": socket.gethostname(), "job": "llama-pretrain"}
        assert json.loads(rank_file.read_text()) == [{"targets": [f"127.0.0.1:{endpoint.port}"], "labels": labels}]
        assert sorted(p.name for p in targets.iterdir()) == sorted([rank_file.name, f"agent-127.0.0.1-{agent.port}.json"])
        (target,) = json.loads(rank_file.read_text())[0]["targets"]
        assert "probe_total 1.0" in scrape(f"http://{target}/metrics")  # the announced address serves the metrics
    finally:
        endpoint.close()
        agent.close()
    assert list(targets.iterdir()) == []


def test_the_run_id_option_and_a_launcher_relabel_name_the_run_and_no_service_name_leaves_job_alone(
    registry: CollectorRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    endpoint = dcp_otel.start_metrics_server(0, "127.0.0.1", registry=registry, file_sd_dir=tmp_path, run_id="opt-1")
    assert endpoint is not None and endpoint.target_file is not None
    try:
        read = lambda: json.loads(endpoint.target_file.path.read_text())[0]["labels"]  # noqa: E731
        assert read() == {"dcp_run_id": "opt-1", "host_name": socket.gethostname()}  # the scrape config's job stays
        endpoint.relabel("rdzv-after")
        assert read()["dcp_run_id"] == "rdzv-after"
        assert [p.name for p in tmp_path.iterdir()] == [endpoint.target_file.path.name]  # rewritten whole, in place
    finally:
        endpoint.close()


def test_the_job_label_is_the_service_name_as_the_sdk_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from dcp_otel.metrics.file_sd import job_name

    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod,service.name=bert-ft")
    assert job_name() == "bert-ft"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llama")  # over OTEL_RESOURCE_ATTRIBUTES, as in the SDK
    assert job_name() == "llama"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod")
    assert job_name() is None  # none set: the scrape config's job_name stays


def test_the_agent_labels_its_target_with_the_run_id_its_workers_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    from dcp_otel.elastic.launcher import workers_run_id

    for name in (semconv.ENV_RUN_ID, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    assert workers_run_id("rdzv-9", "10.0.0.1", 29500) == "rdzv-9"
    assert workers_run_id("none", "10.0.0.1", 29500) == "10.0.0.1:29500"  # static rendezvous: the ranks' fallback
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert workers_run_id("none", "10.0.0.1", 29500) == "slurm-77"
    monkeypatch.setenv(semconv.ENV_RUN_ID, "mine")
    assert workers_run_id("rdzv-9", "10.0.0.1", 29500) == "mine"


def test_every_interface_is_announced_by_host_name() -> None:
    from dcp_otel.metrics.file_sd import target_host

    assert target_host("0.0.0.0") == socket.getfqdn()
    assert target_host("10.1.2.3") == "10.1.2.3"
    assert target_host("::1") == "[::1]"


def test_an_unwritable_discovery_folder_is_counted_and_never_breaks_serving(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    _selftelemetry.reset()
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    endpoint = dcp_otel.start_metrics_server(0, "127.0.0.1", registry=registry, file_sd_dir=not_a_folder)
    assert endpoint is not None
    try:
        assert endpoint.target_file is None
        assert "probe_total 1.0" in scrape(endpoint.url)
        assert dcp_otel.diagnostics()["file_sd_error"] == 1
    finally:
        endpoint.close()


@pytest.mark.parametrize("series", [0, 100_000], ids=["small", "slow-to-write"])
def test_at_exit_a_process_waits_for_one_last_scrape_so_its_last_values_are_not_lost(tmp_path: Path, series: int) -> None:
    """The process waits until the last scrape is answered, not just collected: with 100,000 more
    series it takes a while to write, and exiting as soon as it was collected cut it short."""
    env = {**os.environ, semconv.ENV_FINAL_SCRAPE_TIMEOUT_S: "120", semconv.ENV_FILE_SD_DIR: str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.workers.final_scrape", str(series)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    try:
        url = proc.stdout.readline().strip()  # type: ignore[union-attr]
        for line in proc.stderr:  # type: ignore[union-attr]
            if "waiting up to 120s for a last scrape of " + url in line:
                break
        else:
            pytest.fail("the process never waited for a last scrape")
        text = scrape(url)
        assert "last_checkpoint_total 1.0" in text  # the value recorded after the last regular scrape
        assert text.count("many_series{") == series
        assert proc.wait(timeout=60) == 0  # and then it exits at once, not after 120 s
        assert list(tmp_path.iterdir()) == []  # its discovery file withdrawn
    finally:
        proc.kill()
        proc.wait()


def scrape_with_deadline(url: str, timeout_s: str) -> str:
    """Scrape as Prometheus does, saying how long it waits for the response."""
    return scrape(url, {"X-Prometheus-Scrape-Timeout-Seconds": timeout_s})


class _Said(logging.Handler):
    """Sets ``event`` when dcp-otel logs a message containing ``words``."""

    def __init__(self, words: str, event: threading.Event) -> None:
        super().__init__(logging.INFO)
        self.words, self.event = words, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.event.set()


def test_a_last_scrape_answered_after_its_scrapers_deadline_does_not_end_the_wait(registry: CollectorRegistry) -> None:
    """Prometheus says with each scrape how long it waits, and stores nothing of a response that comes later:
    the agent's run results in it would be lost. So the process waits on for the next scrape, and counts the
    late one."""
    _selftelemetry.reset()
    endpoint = dcp_otel.start_metrics_server(0, "127.0.0.1", registry=registry)
    assert endpoint is not None
    endpoint.final_scrape_timeout_s = 60
    waiting, logger = threading.Event(), logging.getLogger("dcp_otel")
    said, level = _Said("waiting up to 60s for a last scrape", waiting), logger.level
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    try:
        with ThreadPoolExecutor(1) as pool:
            finished = pool.submit(endpoint.finish)
            assert waiting.wait(30)
            assert "probe_total 1.0" in scrape_with_deadline(endpoint.url, "1e-9")  # written after its deadline
            with pytest.raises(FutureTimeout):
                finished.result(timeout=1)  # still waiting: that scrape was not taken
            scrape_with_deadline(endpoint.url, "10")
            finished.result(timeout=30)  # this one was: the process may exit
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    assert dcp_otel.diagnostics().get("late_scrape") == 1
    assert "final_scrape_timeout" not in dcp_otel.diagnostics()


def test_without_a_final_scrape_the_wait_ends_at_its_timeout_and_is_counted(registry: CollectorRegistry) -> None:
    _selftelemetry.reset()
    endpoint = dcp_otel.start_metrics_server(0, "127.0.0.1", registry=registry)
    assert endpoint is not None
    endpoint.final_scrape_timeout_s = 0.05
    endpoint.finish()
    assert dcp_otel.diagnostics()["final_scrape_timeout"] == 1
    assert not endpoint.wait_for_scrape(0)  # closed
