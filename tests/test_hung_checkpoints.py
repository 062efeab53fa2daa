"""A checkpoint that never finishes still answers: real torchrun, 2 gloo ranks, rank 1's write blocked for good.

Each job (``tests/workers/hang_rank.py``) checkpoints once, then again, and rank 1's
second write waits on an Event nobody sets: in ``dcp.save`` itself, in torch's async
save process (``AsyncCheckpointerType.PROCESS``), or in the ``_experimental``
checkpointer's checkpoint process. Rank 0 finishes its own write and waits for rank 1.
While it hangs, the test reads what a user would: Prometheus (or the node's endpoint in
multiprocess mode) and the OTLP metrics pushed, and the span files, which must already
hold the ``dcp.stall`` reports. Then it stops torchrun with SIGTERM, as schedulers do:
every rank's file must hold the interrupted operation, the workers must end as they do
without dcp-otel (the same job run plain), and ``dcp-otel report`` must name the rank and
the step.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan, SpanFileError, read_spans
from tests.ports import free_port_range
from tests.prometheus import PrometheusServer
from tests.ranks import REPO, WORKERS, rank_env
from tests.survive import survive

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
DCP_OTEL_RUN = [sys.executable, "-m", "dcp_otel.elastic.launcher", "--standalone", "--nproc-per-node", "2"]
STALL_AFTER_S = "1"
HUNG, WAITING = 1, 0  # the rank whose write blocks, and the one left waiting for it
TIMEOUT_S = 150.0


@dataclass
class HungJob:
    """One run of the job: what was seen while it hung, and how it ended."""

    out: Path
    code: int  # torchrun's exit status
    log: str
    exits: dict[int, int]  # each worker's return code (-15: killed by SIGTERM)
    seen: Any = None  # what ``while_hung`` returned
    spans: list[FileSpan] = field(default_factory=list)  # the span files', and what the survivor sent
    evidence: list[FileSpan] = field(default_factory=list)  # what the survivor sent from the records

    def file_spans(self, name: str) -> list[FileSpan]:
        return read_spans([self.out / "traces" / name])


Until = Callable[[Callable[[], Any], str], Any]


def until(condition: Callable[[], Any], what: str, proc: subprocess.Popen[bytes], log: Path,
          timeout_s: float = TIMEOUT_S) -> Any:  # fmt: skip
    """Poll ``condition`` (a state only the job's output shows: files, scrapes) until it is truthy, and return
    it; fail if torchrun exits or the time runs out first."""
    deadline, pause = time.monotonic() + timeout_s, threading.Event()
    while True:
        found = condition()
        if found:
            return found
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"never saw {what} (torchrun: {proc.poll()}):\n{log.read_text()[-6000:]}")
        pause.wait(0.2)


def spans_in(path: Path) -> list[FileSpan]:
    """The spans a file holds now (a line being written is not there yet)."""
    try:
        return read_spans([path]) if path.exists() and path.stat().st_size else []
    except SpanFileError:
        return []


def stall(path: Path, step: str) -> FileSpan | None:
    return next((s for s in spans_in(path) if s.name == semconv.SPAN_STALL and s.attributes.get(semconv.ATTR_STEP) == step),
                None)  # fmt: skip


def run_hung(tmp: Path, mode: str, *, plain: bool, ready: Callable[[Path], Any], launcher: list[str] = TORCHRUN,
             env: dict[str, str] | None = None, while_hung: Callable[[Until], Any] | None = None,
             extra: list[str] | None = None) -> HungJob:  # fmt: skip
    """Run the job until ``ready``, call ``while_hung`` (which may wait for what it reads with the ``until`` it
    is given), stop torchrun with SIGTERM, and collect how it ended."""
    out = tmp / ("plain" if plain else "traced")
    out.mkdir(parents=True)
    child_env = rank_env(HANG_OUT=str(out), **{semconv.ENV_STALL_AFTER_S: STALL_AFTER_S,
                                               semconv.ENV_SPOOL_DIR: str(out / "spool")}, **(env or {}))  # fmt: skip
    command = [*launcher, str(WORKERS / "exit_status.py"), str(WORKERS / "hang_rank.py"), "--mode", mode,
               *(["--plain"] if plain else []), *(extra or [])]  # fmt: skip
    log = out / "torchrun.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, env=child_env, stdout=sink, stderr=subprocess.STDOUT, cwd=out)
    try:
        until(lambda: (out / f"blocked-{HUNG}").exists() and ready(out), "the job hang", proc, log)
        seen = while_hung(lambda condition, what: until(condition, what, proc, log)) if while_hung else None
        proc.send_signal(signal.SIGTERM)  # as a scheduler stops a job: torchrun passes it to its workers
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # A checkpoint process outlives its rank by its own ending (it got the SIGTERM too, and writes its
        # evidence before it dies): wait for the job's process groups to empty, bounded, before reading.
        groups = [int(p.read_text()) for p in out.glob("pgid-*") if p.read_text().strip().isdigit()]
        deadline, pause = time.monotonic() + 30, threading.Event()
        while any(_alive(g) for g in groups) and time.monotonic() < deadline:
            pause.wait(0.1)
        for pgid in out.glob("pgid-*"):  # nothing of the job may outlive the test
            try:
                os.killpg(int(pgid.read_text()), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError):
                pass
    exits = {int(p.name.split("-")[1]): int(p.read_text()) for p in out.glob("exit-*")}
    spans = read_spans([out / "traces"]) if (out / "traces").exists() else []
    # The job was stopped as a whole by SIGTERM: the test, as the agent that saw its processes end, has what they
    # had open reported from their records (plain torchrun, between the agent and each worker exit_status.py: no
    # agent of dcp-otel's knew their pids).
    evidence = survive(out / "spool", {}, default=-signal.SIGTERM) if not plain else []
    return HungJob(out, code, log.read_text(errors="replace"), exits, seen, spans + evidence, evidence)


def _alive(pgid: int) -> bool:
    """Whether a process of the group is still there (a zombie of ours counts as gone)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def interrupted(spans: list[FileSpan], name: str, rank: int) -> FileSpan:
    (span,) = [s for s in spans if s.name == name and s.attributes.get(semconv.ATTR_RANK) == rank
               and s.attributes.get(semconv.ATTR_INTERRUPTED)]  # fmt: skip
    return span


def report(traces: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "dcp_otel", "report", str(traces), *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def assert_ends_as_without_dcp_otel(traced: HungJob, plain: HungJob) -> None:
    """The same exit for torchrun, the same for each worker: killed by SIGTERM, its error report unchanged."""
    assert plain.exits == {0: -signal.SIGTERM, 1: -signal.SIGTERM}, plain.log[-3000:]
    assert traced.exits == plain.exits, traced.log[-3000:]
    assert traced.code == plain.code == 1
    for job in (plain, traced):
        assert f"got signal: {int(signal.SIGTERM)}" in job.log  # torchrun's own SignalException


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """One scrape of a metrics endpoint: {(sample name, labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def sample(scraped: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float | None:
    return next((v for (n, ls), v in scraped.items() if n == name and set(labels.items()) <= ls), None)


# --- 1. dcp.save: the hung rank blocks in write_data ----------------------------------------------
@pytest.fixture(scope="module")
def save_jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[HungJob, HungJob]:
    """The hung save, with a real Prometheus scraping both ranks and an OTLP receiver the ranks push to."""
    from tests.otlp_receiver import OtlpReceiver, attributes_of

    tmp = tmp_path_factory.mktemp("hung-save")
    base = free_port_range(2)
    targets = tmp / "targets"  # the ranks announce themselves here (before Prometheus starts: it watches it)
    targets.mkdir()
    config = {"global": {"scrape_interval": "1s"},
              "scrape_configs": [{"job_name": "train", "file_sd_configs": [{"files": [str(targets / "rank-*.json")]}]}]}

    def ready(out: Path) -> bool:
        traces = out / "traces"
        return bool(stall(traces / f"rank-{HUNG}.jsonl", "write_data")
                    and stall(traces / f"rank-{WAITING}.jsonl", semconv.STEP_NONE))  # fmt: skip

    with PrometheusServer(config, tmp / "prometheus") as prom, OtlpReceiver() as receiver:

        def while_hung(wait_for: Until) -> dict[str, Any]:
            """What Prometheus stored and the OTLP receiver got, once both show both ranks' stalled save."""
            seen: dict[str, Any] = {}

            def prometheus_has_it() -> bool:
                seen["in_progress"] = prom.query(semconv.METRIC_IN_PROGRESS)
                seen["stalls"] = prom.query(f"{semconv.METRIC_STALLS}_total")
                seen["threshold"] = prom.query(semconv.METRIC_STALL_THRESHOLD)
                return len(seen["in_progress"]) == 2 and len(seen["stalls"]) >= 2

            def otlp_has_it() -> bool:
                seen["pushed"] = sorted(
                    (attributes_of(point.attributes)["rank"], attributes_of(point.attributes)["step"])
                    for item in receiver.metrics if item.metric.name == semconv.IN_PROGRESS.otel
                    for point in item.metric.gauge.data_points)  # fmt: skip
                return (str(HUNG), "write_data") in seen["pushed"] and (str(WAITING), semconv.STEP_NONE) in seen["pushed"]

            wait_for(prometheus_has_it, "both ranks' in-progress save and stalls in Prometheus")
            wait_for(otlp_has_it, "the in-progress gauge pushed over OTLP")
            # The operator's first look, as printed in the docs: from the ranks' endpoints, and from Prometheus.
            seen["status"] = {source: status(*args) for source, args in (
                ("endpoints", ("--targets", str(targets))), ("prometheus", ("--prometheus", prom.url)))}
            return seen

        env = {semconv.ENV_METRICS_PORT: str(base), semconv.ENV_METRICS_ADDR: "127.0.0.1",
               semconv.ENV_FILE_SD_DIR: str(targets)}
        traced = run_hung(tmp, "save", plain=False, ready=ready, env=env, while_hung=while_hung,
                          extra=["--otlp", receiver.endpoint])  # fmt: skip
    plain = run_hung(tmp, "save", plain=True, ready=lambda out: True)
    return traced, plain


def test_while_a_save_hangs_prometheus_and_otlp_show_every_ranks_step_and_its_stall(
    save_jobs: tuple[HungJob, HungJob],
) -> None:
    seen = save_jobs[0].seen
    where = {r["metric"]["rank"]: (r["metric"]["operation"], r["metric"]["step"]) for r in seen["in_progress"]}
    assert where == {str(HUNG): ("save", "write_data"), str(WAITING): ("save", semconv.STEP_NONE)}
    # The value is the Unix time the rank last made progress: when rank 1 entered its write_data, when rank 0
    # ended its own (the collective it waits in since is not progress).
    since = {r["metric"]["rank"]: float(r["value"][1]) for r in seen["in_progress"]}
    hung_write = interrupted(save_jobs[0].spans, "dcp.write_data", HUNG)
    (waiting_write,) = [s for s in save_jobs[0].spans if s.name == "dcp.write_data" and s.trace_id == hung_write.trace_id
                        and s.attributes[semconv.ATTR_RANK] == WAITING]  # fmt: skip
    assert since[str(HUNG)] == pytest.approx(hung_write.start_ns / 1e9, abs=1e-3)
    assert since[str(WAITING)] == pytest.approx(waiting_write.end_ns / 1e9, abs=1e-3)
    counted = {(r["metric"]["rank"], r["metric"]["step"]) for r in seen["stalls"] if float(r["value"][1]) >= 1}
    assert {(str(HUNG), "write_data"), (str(WAITING), semconv.STEP_NONE)} <= counted
    assert {float(r["value"][1]) for r in seen["threshold"]} == {float(STALL_AFTER_S)}
    assert (str(HUNG), "write_data") in seen["pushed"]  # the observable gauge, over OTLP


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dcp_otel", "status", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)  # fmt: skip


@pytest.mark.parametrize("source", ["endpoints", "prometheus"])
def test_dcp_otel_status_names_the_stuck_rank_first_with_its_host_and_stack_and_the_rank_waiting(
    save_jobs: tuple[HungJob, HungJob], source: str
) -> None:
    done = save_jobs[0].seen["status"][source]
    assert done.returncode == 1, done.stdout + done.stderr  # 1: a checkpoint is stalled
    lines = done.stdout.splitlines()
    assert lines[0].startswith("run ") and "save: 2 rank(s) open, 1 waiting between steps" in lines[0], done.stdout
    assert "STALLED: 1 rank(s) stuck in a step" in lines[0]
    header = lines[1].split()
    assert header[:3] == ["RANK", "HOST", "STEP"]
    stuck, waiting = lines[2].split(), lines[3].split()
    host = socket.gethostname()
    assert stuck[:3] == [str(HUNG), host, "write_data"] and stuck[-1] == "STALLED", done.stdout  # the stuck rank first
    assert waiting[:3] == [str(WAITING), host, semconv.STEP_NONE], done.stdout
    # Where its thread is: the last stall report's stack, innermost frames last, from the rank's endpoint.
    at = lines.index(next(line for line in lines if line.startswith(f"  last stall report of rank {HUNG} on {host}")))
    assert "(write_data," in lines[at]
    stack = "\n".join(lines[at + 1:])
    assert "in block_here" in stack and "NEVER.wait()" in stack, done.stdout


def test_the_stall_spans_name_the_blocked_frame_and_the_collective_the_other_rank_waits_in(
    save_jobs: tuple[HungJob, HungJob],
) -> None:
    spans = save_jobs[0].spans
    hung = [s for s in spans if s.name == semconv.SPAN_STALL and s.attributes[semconv.ATTR_RANK] == HUNG]
    waiting = [s for s in spans if s.name == semconv.SPAN_STALL and s.attributes[semconv.ATTR_RANK] == WAITING]
    assert hung and waiting
    first = min(hung, key=lambda s: s.start_ns)
    assert first.attributes[semconv.ATTR_STEP] == "write_data" and first.attributes[semconv.ATTR_STALL_REPORT] == 1
    assert "in block_here" in first.attributes[semconv.ATTR_CODE_STACKTRACE]
    assert "NEVER.wait()" in first.attributes[semconv.ATTR_CODE_STACKTRACE]
    assert first.attributes[semconv.ATTR_STALL_SECONDS] >= float(STALL_AFTER_S)
    assert semconv.ATTR_STALL_COLLECTIVE not in first.attributes  # its own work, not waiting for anyone
    # Reported again at growing intervals: 1, 2, 4 ... times the threshold.
    reports = sorted(s.attributes[semconv.ATTR_STALL_REPORT] for s in hung)
    assert reports == list(range(1, len(reports) + 1))
    seconds = [s.attributes[semconv.ATTR_STALL_SECONDS] for s in sorted(hung, key=lambda s: s.start_ns)]
    assert all(b >= 2 * a * 0.9 for a, b in zip(seconds, seconds[1:], strict=False))
    # Rank 0 says which collective it waits in, for rank 1.
    other = min(waiting, key=lambda s: s.start_ns)
    assert other.attributes[semconv.ATTR_STEP] == semconv.STEP_NONE
    assert other.attributes[semconv.ATTR_STALL_COLLECTIVE] == "gather_object"
    assert other.attributes[semconv.ATTR_STALL_COLLECTIVE_CALLER] == "_DistWrapper.all_reduce"
    # Under the open call, in the checkpoint's trace: rank 1's write_data, rank 0's save.
    by_id = {s.span_id: s for s in spans}
    assert by_id[first.parent_id].name == "dcp.write_data" and by_id[first.parent_id].trace_id == first.trace_id
    assert by_id[other.parent_id].name == "dcp.save" and other.trace_id == first.trace_id


def test_after_sigterm_every_ranks_record_holds_the_interrupted_save_and_the_blocked_write(
    save_jobs: tuple[HungJob, HungJob],
) -> None:
    traced = save_jobs[0]
    for rank in (HUNG, WAITING):
        save = interrupted(traced.evidence, "dcp.save", rank)
        assert save.error and save.attributes[semconv.ATTR_INTERRUPTED] == "SIGTERM"
        assert save.status_message.startswith("terminated by SIGTERM")
        # The first, finished save is there too (its spans went out as it ended).
        saves = [s for s in traced.spans if s.name == "dcp.save" and s.attributes.get(semconv.ATTR_RANK) == rank]
        assert len(saves) == 2
        # The work at risk when it was terminated: since that first save ended.
        (first,) = [s for s in saves if s.span_id != save.span_id]
        assert save.attributes[semconv.ATTR_RECOVERY_POINT_AGE] == pytest.approx((save.end_ns - first.end_ns) / 1e9,
                                                                                 abs=2e-3)  # fmt: skip
    write = interrupted(traced.spans, "dcp.write_data", HUNG)
    assert write.status_message == "terminated by SIGTERM during write_data"
    assert "NEVER.wait()" in (write.stacktrace or "")  # where its thread was (the watchdog's last stall report)
    waiting = interrupted(traced.spans, "dcp.save", WAITING)
    assert waiting.status_message == "terminated by SIGTERM while waiting in gather_object (_DistWrapper.all_reduce)"
    # The collective it was in is a span of its own, ended as the process ended: the write's gather.
    collective = interrupted(traced.spans, semconv.SPAN_COLLECTIVE_PREFIX + "gather_object", WAITING)
    assert collective.parent_id == waiting.span_id and collective.error
    assert collective.attributes[semconv.ATTR_COLLECTIVE_STEP] == "write"
    (root,) = [s for s in traced.spans if s.name == semconv.SPAN_CHECKPOINT and s.trace_id == write.trace_id]
    assert root.error  # the checkpoint's trace says it never finished


def test_the_workers_end_as_they_do_without_dcp_otel(save_jobs: tuple[HungJob, HungJob]) -> None:
    assert_ends_as_without_dcp_otel(*save_jobs)


def test_the_report_puts_the_unfinished_checkpoint_first_naming_the_rank_and_the_step(
    save_jobs: tuple[HungJob, HungJob],
) -> None:
    page = save_jobs[0].out / "report.html"
    text = report(save_jobs[0].out / "traces", save_jobs[0].out / "spool", "--html", str(page))
    lines = text.splitlines()
    assert lines[0] == "2 checkpoint operations (2 save) on 2 ranks: 1 unfinished, none failed"
    assert re.fullmatch(r"UNFINISHED  save \S+/second \(operation 2 of 2\): rank 1 never finished write_data "
                        r"\(\d+\.\d s, terminated by SIGTERM\); rank 0 waited for it in gather_object "
                        r"\(_DistWrapper\.all_reduce\)", lines[1]), lines[1]  # fmt: skip
    assert lines[2] == "        rank 1, where it was (innermost last):"
    assert "NEVER.wait()" in "\n".join(lines[3:12])
    html = page.read_text()  # the page's summary says it too, before any checkpoint's section
    assert html.index("never finished: rank 1 never finished write_data") < html.index('<section class="checkpoint"')
    assert "NEVER.wait()" in html.split('<section class="checkpoint"')[0]


# --- 2. the async save process ---------------------------------------------------------------------
def test_a_hung_async_save_process_is_seen_through_its_rank_in_multiprocess_mode_and_ends_as_without_dcp_otel(
    tmp_path: Path,
) -> None:
    """``dcp-otel-run`` with ``PROMETHEUS_MULTIPROC_DIR``: local rank 0 serves the node; rank 1's write hangs in
    its async save process, which relays where it is to its rank; SIGTERM reaches the processes too."""
    base = free_port_range(1)
    multiproc = tmp_path / "multiproc"
    multiproc.mkdir()
    env = {semconv.ENV_METRICS_PORT: str(base), semconv.ENV_METRICS_ADDR: "127.0.0.1",
           semconv.ENV_AGENT_METRICS_PORT: "0", "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
           semconv.ENV_PROCESS_SETUP: "tests.workers.hang_rank:process_provider"}  # fmt: skip

    def ready(out: Path) -> bool:
        traces = out / "traces"
        return bool(stall(traces / f"process-{HUNG}.jsonl", "write_data") and stall(traces / f"process-{WAITING}.jsonl", "save"))

    def while_hung(wait_for: Until) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        def relayed() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
            scraped = scrape(base)
            counted = sample(scraped, f"{semconv.METRIC_STALLS}_total", rank=str(HUNG), step="write_data")
            return scraped if counted else None

        return wait_for(relayed, "the stall the process relayed, on the node's endpoint")  # type: ignore[no-any-return]

    traced = run_hung(tmp_path, "process", plain=False, ready=ready, launcher=DCP_OTEL_RUN, env=env,
                      while_hung=while_hung)  # fmt: skip
    plain = run_hung(tmp_path, "process", plain=True, ready=lambda out: True)
    scraped = traced.seen
    # The node's endpoint shows both ranks' async save where its process is (and nothing that ended).
    in_progress = {dict(ls)["rank"]: dict(ls) for (name, ls), v in scraped.items() if name == semconv.METRIC_IN_PROGRESS}
    assert {r: (x["operation"], x["step"]) for r, x in in_progress.items()} == {
        str(HUNG): ("async_save", "write_data"), str(WAITING): ("async_save", "save")}  # fmt: skip
    # Each checkpoint process reported its stall (its rank counted it), with its stack and collective.
    hung = stall(traced.out / "traces" / f"process-{HUNG}.jsonl", "write_data")
    assert hung is not None and "NEVER.wait()" in hung.attributes[semconv.ATTR_CODE_STACKTRACE]
    assert hung.attributes[semconv.ATTR_STALL_WHERE] == "async save process"
    waiting = stall(traced.out / "traces" / f"process-{WAITING}.jsonl", "save")
    assert waiting is not None and waiting.attributes[semconv.ATTR_STALL_COLLECTIVE] == "gather_object"
    # After SIGTERM: the rank's upload, and the process's own save and write, each ended as interrupted, from the
    # records of the rank and of its async save process.
    upload = interrupted(traced.evidence, semconv.SPAN_ASYNC_UPLOAD, HUNG)
    assert upload.status_message == "terminated by SIGTERM during its async upload"
    where = "in the async save process"
    write = interrupted(traced.evidence, "dcp.write_data", HUNG)
    assert write.status_message == f"terminated by SIGTERM during write_data {where}"
    assert write.trace_id == upload.trace_id and "NEVER.wait()" in (write.stacktrace or "")
    assert [s.status_message for s in traced.evidence if s.name == "dcp.save" and s.error
            and s.attributes.get(semconv.ATTR_RANK) == WAITING] == [
        f"terminated by SIGTERM during save {where}, waiting in gather_object (_DistWrapper.all_reduce)"]  # fmt: skip
    assert_ends_as_without_dcp_otel(traced, plain)
    text = report(traced.out / "traces", traced.out / "spool")
    assert "rank 1 never finished write_data in the async save process" in text.splitlines()[1]


# --- 3. the _experimental checkpointer's checkpoint process -----------------------------------------
def test_a_hung_experimental_checkpoint_process_is_reported_and_ends_as_without_dcp_otel(tmp_path: Path) -> None:
    base = free_port_range(2)
    env = {semconv.ENV_METRICS_PORT: str(base), semconv.ENV_METRICS_ADDR: "127.0.0.1"}

    def ready(out: Path) -> bool:
        traces = out / "traces"
        return bool(stall(traces / f"process-{HUNG}.jsonl", semconv.CHECKPOINTER_WRITE)
                    and stall(traces / f"process-{WAITING}.jsonl", semconv.CHECKPOINTER_BARRIER))  # fmt: skip

    def while_hung(wait_for: Until) -> dict[int, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
        def relayed() -> dict[int, dict[tuple[str, frozenset[tuple[str, str]]], float]] | None:
            scraped = {rank: scrape(base + rank) for rank in (0, 1)}
            counted = sample(scraped[HUNG], f"{semconv.METRIC_STALLS}_total", step=semconv.CHECKPOINTER_WRITE)
            return scraped if counted else None

        return wait_for(relayed, "the stall the checkpoint process relayed to its rank")  # type: ignore[no-any-return]

    traced = run_hung(tmp_path, "checkpointer", plain=False, ready=ready, env=env, while_hung=while_hung)
    plain = run_hung(tmp_path, "checkpointer", plain=True, ready=lambda out: True)
    operation = semconv.CHECKPOINTER_ASYNC_SAVE
    hung_rank, waiting_rank = traced.seen[HUNG], traced.seen[WAITING]
    assert sample(hung_rank, semconv.METRIC_IN_PROGRESS, operation=operation, step=semconv.CHECKPOINTER_WRITE)
    assert sample(waiting_rank, semconv.METRIC_IN_PROGRESS, operation=operation, step=semconv.CHECKPOINTER_BARRIER)
    assert sample(hung_rank, f"{semconv.METRIC_STALLS}_total", step=semconv.CHECKPOINTER_WRITE) == 1
    barrier = stall(traced.out / "traces" / f"process-{WAITING}.jsonl", semconv.CHECKPOINTER_BARRIER)
    assert barrier is not None and barrier.attributes[semconv.ATTR_STALL_COLLECTIVE] == "barrier"
    assert barrier.attributes[semconv.ATTR_STALL_WHERE] == "checkpoint process"
    write = interrupted(traced.evidence, f"dcp.{semconv.CHECKPOINTER_WRITE}", HUNG)
    assert write.status_message == f"terminated by SIGTERM during {semconv.CHECKPOINTER_WRITE} in the checkpoint process"
    assert "NEVER.wait()" in (write.stacktrace or "")
    upload = interrupted(traced.evidence, semconv.SPAN_ASYNC_UPLOAD, HUNG)
    assert upload.status_message.startswith("terminated by SIGTERM during") and upload.trace_id == write.trace_id
    assert_ends_as_without_dcp_otel(traced, plain)
    lines = report(traced.out / "traces", traced.out / "spool").splitlines()
    assert lines[1].startswith(f"UNFINISHED  {operation} ")
    assert f"rank 1 never finished {semconv.CHECKPOINTER_WRITE} in the checkpoint process" in lines[1]
    assert "rank 0 waited for it in barrier" in lines[1]


# --- 4. torch_checkpointing's writer process ------------------------------------------------------------
def test_a_hung_torch_checkpointing_write_is_a_stall_with_its_stack_in_prometheus_and_the_report(tmp_path: Path) -> None:
    """Rank 1's writer process blocks writing an item's file (its storage hangs); rank 0's waits at the barrier.
    A real Prometheus scrapes both ranks' endpoints (the writer processes' metrics relayed there)."""
    operation, items = semconv.CHECKPOINTING_ASYNC_SAVE, "write_items"
    base = free_port_range(2)
    targets = tmp_path / "targets"
    targets.mkdir()
    config = {"global": {"scrape_interval": "1s"},
              "scrape_configs": [{"job_name": "train", "file_sd_configs": [{"files": [str(targets / "rank-*.json")]}]}]}

    def ready(out: Path) -> bool:
        traces = out / "traces"
        return bool(stall(traces / f"process-{HUNG}.jsonl", items)
                    and stall(traces / f"process-{WAITING}.jsonl", semconv.CHECKPOINTER_BARRIER))  # fmt: skip

    with PrometheusServer(config, tmp_path / "prometheus") as prom:

        def while_hung(wait_for: Until) -> dict[str, Any]:
            seen: dict[str, Any] = {}

            def prometheus_has_it() -> bool:
                seen["in_progress"] = prom.query(f'{semconv.METRIC_IN_PROGRESS}{{operation="{operation}"}}')
                seen["stalls"] = prom.query(f'{semconv.METRIC_STALLS}_total{{operation="{operation}"}}')
                seen["saved"] = prom.query(f'{semconv.METRIC_OPERATIONS}_total{{operation="{operation}",status="success"}}')
                seen["written"] = prom.query(f"{semconv.METRIC_WRITTEN_BYTES}_total")
                counted = {(r["metric"]["rank"], r["metric"]["step"]) for r in seen["stalls"]}
                return (len(seen["in_progress"]) == 2 and len(seen["written"]) == 2
                        and {(str(HUNG), items), (str(WAITING), semconv.CHECKPOINTER_BARRIER)} <= counted)  # fmt: skip

            wait_for(prometheus_has_it, "both ranks' open save, its stalls and the first save's bytes in Prometheus")
            seen["status"] = status("--targets", str(targets))
            return seen

        env = {semconv.ENV_METRICS_PORT: str(base), semconv.ENV_METRICS_ADDR: "127.0.0.1",
               semconv.ENV_FILE_SD_DIR: str(targets)}  # fmt: skip
        traced = run_hung(tmp_path, "checkpointing", plain=False, ready=ready, env=env, while_hung=while_hung)
    plain = run_hung(tmp_path, "checkpointing", plain=True, ready=lambda out: True)
    seen = traced.seen
    where = {r["metric"]["rank"]: r["metric"]["step"] for r in seen["in_progress"]}
    assert where == {str(HUNG): items, str(WAITING): semconv.CHECKPOINTER_BARRIER}
    counted = {(r["metric"]["rank"], r["metric"]["step"]) for r in seen["stalls"] if float(r["value"][1]) >= 1}
    assert {(str(HUNG), items), (str(WAITING), semconv.CHECKPOINTER_BARRIER)} <= counted
    # The first checkpoint finished before: counted, with its bytes (relayed from the writer processes).
    assert {r["metric"]["rank"] for r in seen["saved"] if float(r["value"][1]) == 1} == {"0", "1"}
    assert all(float(r["value"][1]) > 0 for r in seen["written"])
    # The stall report names the blocked frame: the storage's wait.
    hung = stall(traced.out / "traces" / f"process-{HUNG}.jsonl", items)
    assert hung is not None and hung.attributes[semconv.ATTR_STALL_WHERE] == "checkpoint process"
    assert "NEVER.wait()" in hung.attributes[semconv.ATTR_CODE_STACKTRACE]
    assert "in stream_write" in hung.attributes[semconv.ATTR_CODE_STACKTRACE]
    write = interrupted(traced.evidence, f"dcp.{items}", HUNG)
    assert write.status_message == f"terminated by SIGTERM during {items} in the checkpoint process"
    upload = interrupted(traced.evidence, semconv.SPAN_ASYNC_UPLOAD, HUNG)
    assert upload.trace_id == write.trace_id
    assert_ends_as_without_dcp_otel(traced, plain)
    lines = report(traced.out / "traces", traced.out / "spool").splitlines()
    assert lines[1].startswith(f"UNFINISHED  {operation} ")
    assert f"rank 1 never finished {items} in the checkpoint process" in lines[1]
    assert "rank 0 waited for it in barrier" in lines[1]
    # dcp-otel status, from the ranks' endpoints: the stuck rank first, its writer thread's stack.
    done = seen["status"]
    assert done.returncode == 1, done.stdout + done.stderr  # 1: a checkpoint is stalled
    lines = done.stdout.splitlines()
    assert f"{operation}: 2 rank(s) open, 1 waiting for the others - STALLED: 1 rank(s) stuck in a step" in lines[0]
    stuck, waiting = lines[2].split(), lines[3].split()
    assert stuck[0] == str(HUNG) and stuck[2] == items and stuck[-1] == "STALLED", done.stdout
    assert waiting[0] == str(WAITING) and waiting[2] == semconv.CHECKPOINTER_BARRIER, done.stdout
    # The writer process's stall report, relayed to its rank's endpoint: the ckpt-write thread that hangs.
    at = lines.index(next(line for line in lines if line.startswith(f"  last stall report of rank {HUNG} on ")))
    stack = "\n".join(lines[at + 1:])
    assert "in _write_key" in stack and "NEVER.wait()" in stack, done.stdout
