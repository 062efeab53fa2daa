"""DCP's own collectives are spans: how long each rank waited in which one, and how many bytes of plans moved.

``tests/workers/collective_rank.py`` runs 3 real gloo ranks: a save whose rank 2 plans for ``PLAN_S``
(ranks 0 and 1 wait for it in the plan's collectives), a load of it, and a save in which rank 2's
process is killed in ``write_data`` (ranks 0 and 1 fail in the write's collectives).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Any

import pytest

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan, read_spans
from dcp_otel.report.model import checkpoints
from tests.ranks import REPO, Job, run_ranks
from tests.workers.collective_rank import GONE, PLAN_S, SLOW

WORLD = 3
# torch's order: the plan's gather and scatter (_DistWrapper.reduce_scatter), the write results' gather and
# the metadata's broadcast (all_reduce); a load's read results (all_gather).
SAVE = [("gather_object", "plan"), ("scatter_object", "plan"), ("gather_object", "write"), ("broadcast_object", "write")]
LOAD = [("gather_object", "plan"), ("scatter_object", "plan"), ("all_gather_object", "read")]
PATTERN = {"plan": "reduce_scatter", "write": "all_reduce", "read": "all_gather"}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return run_ranks("collective_rank", WORLD, tmp_path_factory.mktemp("collectives"), timeout_s=180,
                     exit_codes={GONE: 9})  # fmt: skip


@pytest.fixture(scope="module")
def spans(job: Job) -> list[FileSpan]:
    return read_spans([job.out / "traces"])


def of(spans: list[FileSpan], operation: str, checkpoint: str) -> dict[int, FileSpan]:
    """Each rank's operation span of the checkpoint at ``checkpoint`` (the last part of its path)."""
    return {int(s.attributes[semconv.ATTR_RANK]): s for s in spans if s.name == semconv.span_name(operation)
            and str(s.attributes[semconv.ATTR_CHECKPOINT_ID]).endswith("/" + checkpoint)}  # fmt: skip


def collectives_under(spans: list[FileSpan], parent: FileSpan) -> list[FileSpan]:
    return sorted((s for s in spans if s.parent_id == parent.span_id and semconv.is_collective_span(s.name)),
                  key=lambda s: s.start_ns)  # fmt: skip


def key(span: FileSpan) -> tuple[str, str]:
    return span.name.removeprefix(semconv.SPAN_COLLECTIVE_PREFIX), str(span.attributes[semconv.ATTR_COLLECTIVE_STEP])


def attr(span: FileSpan, name: str) -> Any:
    return span.attributes.get(name, 0)


def test_every_collective_of_a_save_and_a_load_is_a_span_under_the_ranks_operation_in_torchs_order(
    spans: list[FileSpan],
) -> None:
    for operation, checkpoint, expected in (("save", "slow-plan", SAVE), ("load", "slow-plan", LOAD)):
        ops = of(spans, operation, checkpoint)
        assert sorted(ops) == [0, 1, 2]
        for rank, op in ops.items():
            found = collectives_under(spans, op)
            assert [key(s) for s in found] == expected, (operation, rank)
            assert all(s.attributes[semconv.ATTR_COLLECTIVE_PATTERN] == PATTERN[step] for s, (_, step) in zip(found, expected, strict=True))
            assert all(s.trace_id == op.trace_id and not s.error for s in found)


def test_the_ranks_that_waited_for_a_slow_plan_waited_in_the_plans_collectives(spans: list[FileSpan]) -> None:
    saves = of(spans, "save", "slow-plan")
    in_plan = {rank: sum(s.duration_s for s in collectives_under(spans, op) if key(s)[1] == "plan")
               for rank, op in saves.items()}  # fmt: skip
    waiting = [r for r in range(WORLD) if r != SLOW]
    assert all(in_plan[r] >= 0.8 * PLAN_S for r in waiting), in_plan
    assert in_plan[SLOW] < 0.5 * PLAN_S, in_plan  # it was the one planning: the others were there already
    report = checkpoints(spans)
    (ckpt,) = [c for c in report if c.checkpoint_id.endswith("/slow-plan") and c.operation == "save"]
    (gather,) = [c for c in ckpt.collectives if c.name == "gather_object (plan)"]
    assert gather.longest_rank in waiting and gather.by_rank[gather.longest_rank] >= 0.8 * PLAN_S


def test_a_ranks_time_is_its_steps_plus_its_wait_and_the_collectives_are_part_of_the_wait(spans: list[FileSpan]) -> None:
    for operation in ("save", "load"):
        for op in of(spans, operation, "slow-plan").values():
            below = [s for s in spans if s.parent_id == op.span_id]
            steps = sum(s.duration_s for s in below if not semconv.is_collective_span(s.name))
            in_collectives = sum(s.duration_s for s in below if semconv.is_collective_span(s.name))
            wait = op.attributes[semconv.ATTR_WAIT_SECONDS]
            assert steps + wait == pytest.approx(op.duration_s, abs=1e-6)
            assert op.attributes[semconv.ATTR_COLLECTIVE_SECONDS] == pytest.approx(in_collectives, abs=1e-6)
            assert in_collectives <= wait + 1e-6


def test_the_bytes_a_collective_moved_are_what_each_side_pickled_and_unpickled(spans: list[FileSpan]) -> None:
    for operation in ("save", "load"):
        ops = of(spans, operation, "slow-plan")

        def the(method: str, step: str, rank: int, ops: dict[int, FileSpan] = ops) -> FileSpan:
            (found,) = [s for s in collectives_under(spans, ops[rank]) if key(s) == (method, step)]
            return found

        # The coordinator received every rank's local plan (its own included) and sent each its final plan.
        sent = [attr(the("gather_object", "plan", r), semconv.ATTR_COLLECTIVE_SENT_BYTES) for r in range(WORLD)]
        assert all(n > 0 for n in sent)
        assert attr(the("gather_object", "plan", 0), semconv.ATTR_COLLECTIVE_RECEIVED_BYTES) == sum(sent)
        received = [attr(the("scatter_object", "plan", r), semconv.ATTR_COLLECTIVE_RECEIVED_BYTES) for r in range(WORLD)]
        assert all(n > 0 for n in received)
        assert attr(the("scatter_object", "plan", 0), semconv.ATTR_COLLECTIVE_SENT_BYTES) == sum(received)
        assert not any(attr(the("gather_object", "plan", r), semconv.ATTR_COLLECTIVE_RECEIVED_BYTES) for r in (1, 2))


def test_a_summary_only_rank_tells_the_report_the_same_collective_time(spans: list[FileSpan]) -> None:
    """With ``detail="auto"`` most ranks send only their operation span: its summary carries the time."""
    saves = of(spans, "save", "slow-plan")
    detailed = {r.rank: r for c in checkpoints(spans) if c.trace_id == saves[1].trace_id for r in c.ranks}
    below = {s.span_id for s in spans if s.parent_id == saves[1].span_id}
    summary_only = [dataclasses.replace(s, attributes={**s.attributes, semconv.ATTR_DETAIL: semconv.DETAIL_SUMMARY})
                    if s is saves[1] else s for s in spans if s.span_id not in below]  # fmt: skip
    (ckpt,) = [c for c in checkpoints(summary_only) if c.trace_id == saves[1].trace_id]
    (rank1,) = [r for r in ckpt.ranks if r.rank == 1]
    assert rank1.collective_s == pytest.approx(detailed[1].collective_s, abs=1e-6) and rank1.collective_s > 0.5 * PLAN_S
    assert rank1.wait_s == pytest.approx(detailed[1].wait_s, abs=1e-6)


# --- a rank killed in the middle of a save ---------------------------------------------------------------
def test_the_ranks_that_lost_a_peer_failed_in_the_collective_and_did_not_count_the_failure_as_theirs(
    job: Job, spans: list[FileSpan]
) -> None:
    results = {r: json.loads((job.out / f"result-{r}.json").read_text()) for r in range(WORLD) if r != GONE}
    assert {r: res["raised"] for r, res in results.items()} == {0: "RuntimeError", 1: "RuntimeError"}
    assert {r: res["loaded"] for r, res in results.items()} == {0: 0.0, 1: 1.0}  # the load did its job
    saves = of(spans, "save", "gone")
    assert sorted(saves) == [0, 1]
    for rank, save in saves.items():
        assert save.error and save.attributes[semconv.ATTR_FAILED_IN_COLLECTIVE] is True
        failed = [s for s in collectives_under(spans, save) if s.error]
        assert [key(s) for s in failed] == [("gather_object", "write")], rank
        assert semconv.ATTR_FAILED_IN_COLLECTIVE not in failed[0].attributes  # the collective itself raised
        # Its operation failed (the operations counter), but the failure did not start on it (the failures counter).
        assert results[rank]["failed_saves"] == 1 and results[rank]["failures"] == 0


def test_the_report_says_which_collective_they_failed_in_and_which_rank_sent_nothing(job: Job) -> None:
    shown = subprocess.run([sys.executable, "-m", "dcp_otel", "report", str(job.out / "traces")],
                           capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert not shown.stderr
    lines = shown.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("FAILED  save") and "/gone " in line)
    assert lines[at].endswith("on rank 0, 1:")
    assert lines[at + 1] == (f"        rank 0, 1 failed in DCP's gather_object (write), waiting for a peer that went away; "
                             f"rank {GONE} sent no spans: it likely started there (a killed process: see its log)")  # fmt: skip
    # The slow plan's save, in detail: its collectives' table, the plan's gather first and longest on a waiting rank.
    section = next(i for i, line in enumerate(lines) if line.startswith("save ") and "/slow-plan " in line)
    table = next(i for i in range(section, len(lines)) if lines[i].startswith("  DCP collective (step)"))
    assert lines[table].split() == ["DCP", "collective", "(step)", "longest", "on", "rank", "its", "time", "median",
                                    "objects", "moved"]  # fmt: skip
    method, step, longest, its_time, _, moved, unit = lines[table + 1].split()
    assert (method, step) == ("gather_object", "(plan)") and int(longest) != SLOW
    assert float(its_time.removesuffix("s")) >= 0.8 * PLAN_S and float(moved) > 0 and unit in ("B", "KiB")


def test_the_html_page_draws_the_collectives_as_waiting_with_a_legend(job: Job, browser) -> None:  # type: ignore[no-untyped-def]
    from tests.test_report import check_timelines

    page = job.out / "report.html"
    shown = subprocess.run([sys.executable, "-m", "dcp_otel", "report", str(job.out / "traces"), "--html", str(page)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    browser.get(page.as_uri())
    check_timelines(browser)  # every colour drawn is in the legend
    fills = browser.execute_script(
        "return [...document.querySelectorAll('rect.bar.collective')].map(b => getComputedStyle(b).fill)")
    assert fills and set(fills) == {"rgb(183, 188, 196)"}  # grey: waiting, apart from the rank's own steps
    legend = browser.execute_script("return document.querySelector('.timeline-legend').textContent")
    assert "DCP's collectives (waiting)" in legend
