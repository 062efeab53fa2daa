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
from dcp_otel.report.terminal import render_lives

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
    assert "  generation 1: ranks 0, 12.0 s, blocked - (3.00 s per rank); ended: rank 0 no end recorded" in text
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
    assert "generations of run run-a: 1, 4.0 s; blocked by checkpointing 25.0%" in text
    assert "generations of run run-b: 1, 4.0 s; blocked by checkpointing 25.0%" in text


def test_a_run_that_never_restarted_and_said_no_life_adds_nothing() -> None:
    assert render_lives(life_of([op("save", "/c/1", "g1", 1, 2), op("save", "/c/2", "g1", 3, 4)])) == ""
