"""A rank that dies inside ``write_data`` is reported by what outlives it: real torchrun, 2 gloo ranks.

Rank 1 of ``tests/workers/death_rank.py`` dies in the ``write_data`` of its second save the ways ranks
die: SIGKILL (the OOM killer), SIGABRT (NCCL's watchdog), a segfault (a storage plugin), SIGTERM (the
scheduler). Each job runs plain and instrumented, with everything else the same, and must end alike:
torchrun's exit status, each worker's (from torchrun's own failure report), what each rank said, the
checkpoint files, and how long after the death it took. Instrumented, a loopback OTLP/HTTP receiver must
get, within 10 s of the death, the dead rank's interrupted save and step (ERROR, saying how it died),
from torchelastic's agent: under ``opentelemetry-instrument torchrun`` (no code in the job) and under
``dcp-otel-run`` (``instrument()`` in the job, exporters from ``OTEL_*``). ``dcp-otel report <spool>`` names
the rank, the checkpoint and the step. A torchrun restart with ``instrument()`` in code and no agent of
ours: the next generation sends the dead one's spans through its own provider.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan, read_spans
from tests.otlp_receiver import OtlpReceiver
from tests.ranks import REPO, WORKERS, rank_env

BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1"]
OPENTELEMETRY_INSTRUMENT = [str(BIN / "opentelemetry-instrument")]
DCP_OTEL_RUN = [str(BIN / "dcp-otel-run"), "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1"]
WORKER = str(WORKERS / "death_rank.py")
DEATHS = ["SIGKILL", "SIGABRT", "SEGV", "SIGTERM"]
#: How each death reads in a span (a segfault is SIGSEGV).
SIGNAL = {"SIGKILL": "SIGKILL", "SIGABRT": "SIGABRT", "SEGV": "SIGSEGV", "SIGTERM": "SIGTERM"}
_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


@dataclass
class Job:
    out: Path
    code: int
    log: str
    exits: dict[int, int]  # each rank's exit status, as torchrun's failure report gives it
    said: dict[int, str]
    files: list[str]
    death_at: float  # when rank 1 was about to die (time.time())
    ended_at: float
    received: list[tuple[float, FileSpan]] = field(default_factory=list)  # (when it arrived, span)

    @property
    def seconds_after_death(self) -> float:
        return self.ended_at - self.death_at

    def same_as(self, other: Job) -> bool:
        return (self.code, self.exits, self.said, self.files) == (other.code, other.exits, other.said, other.files)

    def __str__(self) -> str:
        return f"exit {self.code} {self.exits}\nsaid {self.said}\nfiles {self.files}\n{self.log[-4000:]}"


class TimedReceiver(OtlpReceiver):
    """The test's OTLP/HTTP receiver, noting when each span arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived: list[tuple[float, FileSpan]] = []

    def _add(self, request) -> None:  # type: ignore[no-untyped-def]
        before = len(self.spans)
        super()._add(request)
        now = time.time()
        self.arrived.extend((now, span) for span in self.spans[before:])


def run(tmp: Path, name: str, command: list[str], env: dict[str, str]) -> Job:
    out = tmp / name
    out.mkdir(parents=True)
    log = out / "torchrun.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([*command, WORKER, str(out), *env.pop("_ARGS", "").split()], stdout=sink,
                                stderr=subprocess.STDOUT, cwd=out,
                                env=rank_env(**{semconv.ENV_SPOOL_DIR: str(out / "spool"), **env}))  # fmt: skip
        try:
            proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ended = time.time()
    text = log.read_text(errors="replace")
    exits = {int(rank): int(code) for rank, code in _FAILURE.findall(text)}
    said = {int(p.stem.split("-")[1]): p.read_text() for p in out.glob("rank-*.txt")}
    ckpt = out / "ckpt"
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) if ckpt.exists() else []
    dying = out / "dying-1"
    return Job(out, proc.returncode, text, exits, said, files, dying.stat().st_mtime if dying.exists() else 0.0, ended)


def otel_env(receiver: OtlpReceiver) -> dict[str, str]:
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_SERVICE_NAME": "train"}  # fmt: skip


def interrupted(spans: list[FileSpan], name: str, rank: int) -> FileSpan:
    (span,) = [s for s in spans if s.name == name and s.attributes.get(semconv.ATTR_RANK) == rank and s.error
               and s.attributes.get(semconv.ATTR_INTERRUPTED)]  # fmt: skip
    return span


def report(*paths: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "dcp_otel", "report", *map(str, paths)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module", params=DEATHS)
def jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    """One death, three ways: plain torchrun, ``opentelemetry-instrument torchrun``, ``dcp-otel-run``."""
    death: str = request.param
    tmp = tmp_path_factory.mktemp(f"death-{death}")
    found = {"plain": run(tmp, "plain", TORCHRUN, {"_ARGS": f"--death {death}"})}
    for name, command, args in (("opentelemetry-instrument", [*OPENTELEMETRY_INSTRUMENT, *TORCHRUN], ""),
                                ("dcp-otel-run", DCP_OTEL_RUN, "--instrument --otlp")):  # fmt: skip
        with TimedReceiver() as receiver:
            job = run(tmp, name, command, {"_ARGS": f"--death {death} {args}", **otel_env(receiver)})
            job.received = list(receiver.arrived)
        found[name] = job
    found["death"] = death  # type: ignore[assignment]
    return found


@pytest.mark.parametrize("launcher", ["opentelemetry-instrument", "dcp-otel-run"])
def test_the_job_ends_as_without_dcp_otel(jobs: dict[str, Job], launcher: str) -> None:
    plain, traced = jobs["plain"], jobs[launcher]
    assert plain.code == 1 and plain.exits.get(1) is not None and plain.exits[1] < 0, plain
    assert traced.same_as(plain), f"PLAIN\n{plain}\n\n{launcher.upper()}\n{traced}"
    assert "step-2/.metadata" not in plain.files and "step-1/.metadata" in plain.files
    if launcher == "opentelemetry-instrument":  # the same launcher: from the death to torchrun's end, as soon
        assert traced.seconds_after_death < plain.seconds_after_death + 0.5, (plain.seconds_after_death,
                                                                              traced.seconds_after_death)  # fmt: skip
    # (dcp-otel-run is a launcher of its own: its metrics endpoint's close and its larger interpreter take 0.3 to
    # 0.5 s more to end than torchrun's, with or without the spool; what its survivor adds is its report, sent
    # before it exits, within the receiver test's 10 s.)


@pytest.mark.parametrize("launcher", ["opentelemetry-instrument", "dcp-otel-run"])
def test_the_receiver_gets_the_dead_ranks_interrupted_save_and_step_within_10_s(jobs: dict[str, Job], launcher: str) -> None:
    job, death = jobs[launcher], SIGNAL[str(jobs["death"])]
    spans = [span for _, span in job.received]
    for name in ("dcp.save", "dcp.write_data"):
        span = interrupted(spans, name, 1)
        assert span.status_message == f"terminated by {death} during write_data", span.status_message
        assert span.attributes[semconv.ATTR_INTERRUPTED] == death
        assert span.attributes[semconv.ATTR_CHECKPOINT_ID].endswith("step-2")
    (process,) = [s for s in spans if s.name == semconv.SPAN_PROCESS and s.attributes.get(semconv.ATTR_RANK) == 1]
    assert process.attributes[semconv.ATTR_ENDED_BY] == death and process.status_message == f"terminated by {death}"
    assert process.attributes[semconv.ATTR_RECOVERY_POINT_ID].endswith("step-1")
    assert process.resource.get("process.pid") == int((job.out / "dying-1").read_text())  # the dead rank's own
    arrived = max(when for when, span in job.received if span.attributes.get(semconv.ATTR_RANK) == 1 and span.error)
    assert arrived - job.death_at < 10.0, arrived - job.death_at
    # One trace: the dead rank's save and the coordinator's root share it.
    save = interrupted(spans, "dcp.save", 1)
    assert any(s.name == semconv.SPAN_CHECKPOINT and s.trace_id == save.trace_id for s in spans)


def test_the_report_on_the_spool_names_the_rank_the_checkpoint_and_the_step(jobs: dict[str, Job]) -> None:
    job, death = jobs["opentelemetry-instrument"], SIGNAL[str(jobs["death"])]
    text = report(job.out / "spool")
    assert f"terminated by {death} during write_data" in text, text
    assert "step-2" in text and "rank 1" in text, text


def test_a_restarted_job_sends_the_dead_generations_spans_through_its_own_provider(tmp_path: Path) -> None:
    """torchrun (no agent of ours), ``instrument()`` in code with a file exporter: generation 0's rank 1 is
    killed in write_data; generation 1 (the same run id) takes the records and sends them to its own files."""
    command = [*TORCHRUN, "--max-restarts", "3"]  # (gloo's restart on this machine fails about half the time)
    traced = run(tmp_path, "traced", command, {"_ARGS": "--death SIGKILL --instrument", "DEATH_WAIT_REPORTED": "1"})
    assert traced.code == 0, traced
    spans = read_spans([traced.out / "traces"])
    write = interrupted(spans, "dcp.write_data", 1)
    assert write.status_message.endswith("during write_data"), write.status_message
    assert write.resource.get("rank") == 1  # the dead rank's resource, sent by a rank of the next generation
    assert traced.said[0].endswith("saved step-3\n") and traced.said[1].endswith("saved step-3\n"), traced.said
    reported = [n for n in os.listdir(traced.out / "spool") if n.endswith(".reported")]
    killed = int((traced.out / "dying-1").read_text())
    # The killed rank's record (and rank 0's, when torchrun stopped it before it exited by itself: it races).
    assert any(f".{killed}." in n for n in reported), os.listdir(traced.out / "spool")



_TWICE = """
import sys
from dcp_otel.elastic import launcher
for out in sys.argv[2:]:  # a sweep: one job after another, in one process
    try:
        launcher.main(["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", sys.argv[1], out,
                       "--death", "SIGKILL", "--instrument", "--otlp"])
    except BaseException as exc:  # (the rank's death: ChildFailedError, as torchrun's own main raises)
        print(out, type(exc).__name__, flush=True)
"""


def test_dcp_otel_runs_main_called_again_in_one_process_reports_each_jobs_dead_rank(tmp_path: Path) -> None:
    """A sweep calls ``dcp_otel.elastic.launcher.main`` once a job: the agent's survivor, settled at the end of the
    first run, reports the second's dead rank too; and at the process's exit it leaves no announcement."""
    spool, jobs = tmp_path / "spool", [tmp_path / "a", tmp_path / "b"]
    for out in jobs:
        out.mkdir()
    with TimedReceiver() as receiver:
        done = subprocess.run([sys.executable, "-c", _TWICE, WORKER, *map(str, jobs)], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path, env=rank_env(**{**otel_env(receiver),
                                                                         semconv.ENV_SPOOL_DIR: str(spool)}))  # fmt: skip
        spans = list(receiver.spans)
    assert done.returncode == 0 and done.stdout.count("ChildFailedError") == 2, done.stdout + done.stderr[-3000:]
    for out in jobs:  # (main returns once its settle has sent the deaths: nothing is waited for here)
        write = [s for s in spans if s.name == "dcp.write_data" and s.attributes.get(semconv.ATTR_RANK) == 1
                 and s.attributes.get(semconv.ATTR_INTERRUPTED) and str(out) in str(s.attributes.get(semconv.ATTR_CHECKPOINT_ID))]  # fmt: skip
        assert len(write) == 1, (out, sorted(s.name for s in spans if s.error))
    assert not [n for n in os.listdir(spool) if n.endswith(".survivor")], os.listdir(spool)
