"""A checkpoint's life across a restart: a real torchrun job (2 gloo workers, ``--max-restarts 1``) that fails and
restarts (``tests/workers/life_rank.py``).

Generation 1 saves ``step-10`` and ``step-20`` and fails on rank 1 at step 25; generation 2 loads ``step-20`` and
saves ``step-30``. The spans say each checkpoint's training step; each rank's ``dcp.process`` span says how it
ended and the work at risk then; the report names what the restart restored, how old it was, the work lost and
the share of wall time blocked by checkpointing; the blocked-seconds counter counts on both generations.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan, read_spans
from dcp_otel.report import Report, build
from tests.ranks import REPO, WORKERS, rank_env
from tests.workers.life_rank import FAIL_AT, FAILING_RANK, SAVE_EVERY, STEP_S

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "1", "--monitor-interval", "0.5"]  # fmt: skip
RESTORED = FAIL_AT // SAVE_EVERY * SAVE_EVERY  # step-20


@dataclass
class LifeJob:
    out: Path
    code: int
    log: str
    spans: list[FileSpan]

    def processes(self, generation: str) -> dict[int, FileSpan]:
        """Each rank's dcp.process span of generation ``0`` or ``1`` (torchelastic's restart count): sent by the process
        as it exited, or, for a process torchrun killed, by a survivor (the next generation) from its record."""
        pids = {int(p.read_text()) for p in self.out.glob(f"pid-{generation}-*")}
        return {int(s.attributes[semconv.ATTR_RANK]): s for s in self.spans
                if s.name == semconv.SPAN_PROCESS and s.attributes.get("process.pid") in pids}  # fmt: skip


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> LifeJob:
    out = tmp_path_factory.mktemp("life")
    log = out / "torchrun.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([*TORCHRUN, str(WORKERS / "life_rank.py")], env=rank_env(LIFE_OUT=str(out)),
                                stdout=sink, stderr=subprocess.STDOUT, cwd=out, start_new_session=True)  # fmt: skip
    try:
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:  # nothing of the job may outlive the test
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # (read past what a failed job left, so the first test shows its log)
    return LifeJob(out, code, log.read_text(errors="replace"), read_spans([out / "traces"], []))


@pytest.fixture(scope="module")
def report(job: LifeJob) -> Report:
    return build([job.out / "traces"])


def test_the_job_failed_once_and_its_second_generation_finished(job: LifeJob) -> None:
    assert job.code == 0, job.log[-4000:]
    assert f"rank {FAILING_RANK} failed at step {FAIL_AT}" in job.log
    assert sorted(p.name for p in (job.out / "ckpt").iterdir()) == ["step-10", "step-20", "step-30"]


def test_every_saves_span_says_its_training_step(job: LifeJob) -> None:
    saves = [s for s in job.spans if s.name == semconv.span_name("save")]
    by_id = {str(s.attributes[semconv.ATTR_CHECKPOINT_ID]).rpartition("/")[2]: [] for s in saves}
    for s in saves:
        by_id[str(s.attributes[semconv.ATTR_CHECKPOINT_ID]).rpartition("/")[2]].append(s)
    assert sorted(by_id) == ["step-10", "step-20", "step-30"]
    for name, spans in by_id.items():
        assert len(spans) == 2 and {s.attributes[semconv.ATTR_TRAINING_STEP] for s in spans} == {int(name[5:])}


def test_the_first_generations_ends_carry_how_they_ended_and_the_work_at_risk(job: LifeJob) -> None:
    ended = job.processes("0")
    assert sorted(ended) == [0, 1]
    failing = ended[FAILING_RANK]
    assert failing.attributes[semconv.ATTR_ENDED_BY] == semconv.ENDED_BY_EXCEPTION and failing.error
    assert failing.status_message == f"RuntimeError: rank {FAILING_RANK} failed at step {FAIL_AT}"
    # Rank 0 failed in the step's all_reduce when its peer went, or torchrun stopped it first: then the next
    # generation reported it from its record (plain torchrun: no agent of dcp-otel's said how it died).
    assert ended[0].attributes[semconv.ATTR_ENDED_BY] in (semconv.ENDED_BY_EXCEPTION, "SIGTERM", "unknown")
    for span in ended.values():
        assert str(span.attributes[semconv.ATTR_RECOVERY_POINT_ID]).endswith(f"/step-{RESTORED}")
        # At least the steps after the save: their compute alone took STEP_S each.
        assert span.attributes[semconv.ATTR_RECOVERY_POINT_AGE] >= (FAIL_AT - RESTORED - 1) * STEP_S
        assert span.attributes[semconv.ATTR_TRAINING_STEP] == FAIL_AT
    assert all(s.attributes[semconv.ATTR_ENDED_BY] == semconv.ENDED_BY_EXIT and not s.error
               for s in job.processes("1").values()) and len(job.processes("1")) == 2  # fmt: skip


def test_the_blocked_seconds_counter_counted_on_both_generations(job: LifeJob) -> None:
    for generation in ("0", "1"):
        for rank in (0, 1):
            assert json.loads((job.out / f"blocked-{generation}-{rank}.json").read_text()) > 0, (generation, rank)


def test_the_report_says_what_the_restart_restored_how_old_it_was_and_the_work_lost(report: Report) -> None:
    (life,) = report.runs
    first, second = life.generations
    assert first.ranks == second.ranks == [0, 1] and first.key != second.key and first.failed and not second.failed
    restore = second.restore
    assert restore is not None and restore.source is not None
    assert restore.load.checkpoint_id.endswith(f"/step-{RESTORED}") and restore.source.training_step == RESTORED
    assert restore.source in first.checkpoints and restore.source_generation == 1
    assert restore.age_s is not None and restore.age_s > 0
    assert restore.work_lost_s is not None and restore.work_lost_s >= (FAIL_AT - RESTORED - 1) * STEP_S
    assert restore.steps_lost == FAIL_AT - RESTORED
    assert restore.down_s is not None and restore.down_s > 0
    assert life.lost_to_restarts_s == pytest.approx(restore.work_lost_s + restore.down_s)
    for share in (first.blocked_share, second.blocked_share, life.blocked_share):
        assert share is not None and 0 < share < 1


def test_the_report_prints_the_generations_and_the_restore(job: LifeJob, report: Report) -> None:
    shown = subprocess.run([sys.executable, "-m", "dcp_otel", "report", str(job.out / "traces")],
                           capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    (life,) = report.runs
    at = lines.index(next(line for line in lines if line.startswith("generations: 2, ")))
    assert re.fullmatch(r"generations: 2, [\d.]+ s; checkpointing cost [\d.]+% of wall time \(blocked [\d.]+%, interference "
                        r"not measured\); lost to restarts [\d.]+ s "
                        r"\(work redone [\d.]+ s, down [\d.]+ s\)", lines[at]), lines[at]  # fmt: skip
    assert re.fullmatch(rf"  generation 1: ranks 0-1, [\d.]+ s, checkpointing cost [\d.]+% of wall time \(blocked [\d.]+%, "
                        rf"interference not measured\) \([\d.]+ s blocked per rank\); ended: "
                        rf"rank 0 .*rank {FAILING_RANK} exception \(RuntimeError: rank {FAILING_RANK} failed at step "
                        rf"{FAIL_AT}\)", lines[at + 1]), lines[at + 1]  # fmt: skip
    assert re.fullmatch(r"  generation 2: ranks 0-1, [\d.]+ s, checkpointing cost [\d.]+% of wall time \(blocked [\d.]+%, "
                        r"interference not measured\) \([\d.]+ s blocked per rank\); ended: exit",
                        lines[at + 2]), lines[at + 2]  # fmt: skip
    restore = life.generations[1].restore
    assert restore is not None and restore.source is not None
    assert lines[at + 3] == (f"    restored {restore.source.checkpoint_id} (step {RESTORED}), saved by generation 1, "
                             f"{restore.age_s:.2f} s old at restore; work lost {restore.work_lost_s:.2f} s "
                             f"({FAIL_AT - RESTORED} steps), down {restore.down_s:.2f} s")  # fmt: skip
