"""The report's generations, from spans written by hand: what it says where the evidence is partial.

The real restart (torchrun, gloo) is ``tests/test_checkpoint_life.py``; these are the cases a real job makes
rarely: a generation killed by SIGKILL (no ``dcp.process`` span), a restore of a checkpoint no save in the files
wrote, a failed save of the same id, two runs in one folder, one run that never restarted.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan
from dcp_otel.report.life import NO_END, lives
from dcp_otel.report.model import checkpoints
from dcp_otel.report.terminal import interference_line, render_lives

S = 1_000_000_000  # ns
_ids = itertools.count(1)


def op(operation: str, ckpt: str, gen: str, start_s: float, end_s: float, *, rank: int = 0, run: str = "run-a",
       error: str = "", step: int | None = None) -> FileSpan:  # fmt: skip
    """One rank's operation span, a trace of its own."""
    attrs: dict[str, Any] = {semconv.ATTR_OPERATION: operation, semconv.ATTR_RANK: rank, semconv.ATTR_GROUP_RANK: rank,
                             semconv.ATTR_WORLD_SIZE: 1, semconv.ATTR_CHECKPOINT_ID: ckpt, semconv.ATTR_RUN_ID: run,
                             semconv.ATTR_GENERATION: gen}  # fmt: skip
    if step is not None:
        attrs[semconv.ATTR_TRAINING_STEP] = step
    n = next(_ids)
    return FileSpan(f"{n:032x}", f"{n:016x}", "", semconv.span_name(operation), int(start_s * S), int(end_s * S),
                    bool(error), error, attrs)  # fmt: skip


def process(gen: str, start_s: float, end_s: float, ended_by: str, *, rank: int = 0, run: str = "run-a",
            step: int | None = None, error: str = "") -> FileSpan:  # fmt: skip
    attrs: dict[str, Any] = {semconv.ATTR_RANK: rank, semconv.ATTR_RUN_ID: run, semconv.ATTR_GENERATION: gen,
                             semconv.ATTR_ENDED_BY: ended_by}  # fmt: skip
    if step is not None:
        attrs[semconv.ATTR_TRAINING_STEP] = step
    n = next(_ids)
    return FileSpan(f"{n:032x}", f"{n:016x}", "", semconv.SPAN_PROCESS, int(start_s * S), int(end_s * S),
                    bool(error), error, attrs)  # fmt: skip


def life_of(spans: list[FileSpan]) -> list[Any]:
    return lives(checkpoints(spans), spans)


def test_a_killed_generation_ends_at_its_last_checkpoint_and_has_blocked_seconds_but_no_share() -> None:
    spans = [op("save", "/c/step-10", "g1", 10, 11, step=10), op("save", "/c/step-20", "g1", 20, 22, step=20),
             op("load", "/c/step-20", "g2", 40, 41), process("g2", 35, 60, "exit")]  # fmt: skip
    (life,) = life_of(spans)
    first, second = life.generations
    assert first.ended_by == {0: NO_END} and first.blocked_share is None and first.blocked_s == {0: 3.0}
    assert first.end_ns == 22 * S  # its last sign of life: the step-20 save's end
    restore = second.restore
    assert restore is not None and restore.source is not None and restore.source.checkpoint_id == "/c/step-20"
    assert (restore.age_s, restore.work_lost_s, restore.down_s, restore.steps_lost) == (18.0, 0.0, 19.0, None)
    assert second.blocked_share == pytest.approx(1 / 25)
    assert life.blocked_share == pytest.approx(1 / 25)  # over the ranks whose wall time is known
    text = render_lives([life])
    assert "  generation 1: ranks 0, 12.0 s, checkpointing cost - (3.00 s blocked per rank); ended: rank 0 no end recorded" in text
    assert ("    restored /c/step-20 (step 20), saved by generation 1, 18.00 s old at restore; work lost 0.00 s, "
            "down 19.00 s") in text  # fmt: skip


def test_the_source_is_the_last_durable_save_of_that_id_before_the_load() -> None:
    spans = [op("save", "/c/latest", "g1", 10, 11, step=10),
             op("save", "/c/latest", "g1", 20, 21, step=20),
             op("save", "/c/latest", "g1", 30, 31, error="OSError: disk full", step=30),  # failed: not durable
             process("g1", 0, 35, semconv.ENDED_BY_EXCEPTION, step=33, error="RuntimeError: boom"),
             op("load", "/c/latest", "g2", 50, 51), op("save", "/c/latest", "g2", 60, 61, step=40),
             process("g2", 45, 70, "exit")]  # fmt: skip
    (life,) = life_of(spans)
    restore = life.generations[1].restore
    assert restore is not None and restore.source is not None and restore.source.training_step == 20
    assert (restore.work_lost_s, restore.steps_lost) == (14.0, 13)
    assert life.generations[0].ended_by == {0: "exception (RuntimeError: boom)"}
    assert life.lost_to_restarts_s == 14.0 + 16.0


def test_a_restore_of_a_checkpoint_no_save_in_the_files_wrote_names_no_source() -> None:
    spans = [op("save", "/c/step-5", "g1", 1, 2), process("g1", 0, 3, "SIGTERM"),
             op("load", "/elsewhere/step-5", "g2", 10, 11), process("g2", 9, 12, "exit")]  # fmt: skip
    (life,) = life_of(spans)
    restore = life.generations[1].restore
    assert restore is not None and restore.source is None and restore.work_lost_s is None
    assert "    restored /elsewhere/step-5: no save of it in these traces" in render_lives([life])


def test_two_runs_in_one_folder_are_two_lives_and_say_which() -> None:
    spans = [op("save", "/a/1", "g1", 1, 2, run="run-a"), process("g1", 0, 4, "exit", run="run-a"),
             op("save", "/b/1", "h1", 5, 6, run="run-b"), process("h1", 4, 8, "exit", run="run-b")]  # fmt: skip
    found = life_of(spans)
    assert [life.run_id for life in found] == ["run-a", "run-b"]
    text = render_lives(found)
    assert ("generations of run run-a: 1, 4.0 s; checkpointing cost 25.0% of wall time (blocked 25.0%, "
            "interference not measured)") in text
    assert ("generations of run run-b: 1, 4.0 s; checkpointing cost 25.0% of wall time (blocked 25.0%, "
            "interference not measured)") in text


def test_a_run_that_never_restarted_and_said_no_life_adds_nothing() -> None:
    assert render_lives(life_of([op("save", "/c/1", "g1", 1, 2), op("save", "/c/2", "g1", 3, 4)])) == ""


def test_what_checkpointing_cost_is_blocked_plus_interference_as_a_share_of_wall_time() -> None:
    """An async save returned in 1 s, then its upload slowed 12 steps by 3 s: of 40 s, 10% was checkpointing."""
    save = op("async_save", "/c/step-1000", "g1", 10, 11, step=1000)
    save.attributes.update({semconv.ATTR_INTERFERENCE_STEPS: 12, semconv.ATTR_USUAL_STEP: 0.43,
                            semconv.ATTR_INTERFERENCE_RATIO: 1.58, semconv.ATTR_INTERFERENCE_LOST: 3.0})  # fmt: skip
    (life,) = life_of([save, process("g1", 0, 40, "exit")])
    assert life.blocked_share == pytest.approx(1 / 40) and life.interference_share == pytest.approx(3 / 40)
    assert ("generations: 1, 40.0 s; checkpointing cost 10.0% of wall time (blocked 2.5%, interference 7.5%)"
            in render_lives([life]))  # fmt: skip
    (ckpt,) = checkpoints([save])
    assert interference_line(ckpt) == ("while step-1000 uploaded, 12 training steps took 1.58x their usual 0.430 s: "
                                       "3.00 s lost")  # fmt: skip


def test_an_upload_within_noise_says_none_lost_and_a_save_not_measured_says_nothing() -> None:
    quiet = op("async_save", "/c/step-5", "g1", 1, 2)
    quiet.attributes.update({semconv.ATTR_INTERFERENCE_STEPS: 3, semconv.ATTR_USUAL_STEP: 0.1,
                             semconv.ATTR_INTERFERENCE_RATIO: 1.01, semconv.ATTR_INTERFERENCE_LOST: 0.0})  # fmt: skip
    (ckpt,) = checkpoints([quiet])
    assert interference_line(ckpt) == "while step-5 uploaded, 3 training steps took 1.01x their usual 0.100 s: none lost beyond noise"
    (plain,) = checkpoints([op("save", "/c/step-6", "g1", 3, 4)])
    assert interference_line(plain) is None and plain.interference_s == 0.0
