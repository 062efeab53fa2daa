"""Detail at scale: each rank decides on its own, after the operation, whether its step spans go out.

8 real gloo ranks save 3 times; rank 3 is slow in every save and rank 5 fails
the second one. With ``DCP_OTEL_DETAIL=auto`` and a small span budget, every
rank exports its operation span with a summary of its steps; step spans come
from the coordinator, the straggler, the failing rank and the 1-in-K sample;
the report reads the same answers from those traces as from ``full`` ones.

A balanced, I/O-bound job (8 ranks, every write 0.4 s) keeps the budget: only
the coordinator and the sample export steps, and a rank 4x slower than the
others is detailed, as a straggler before it has a history, as slow after.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan, read_spans
from dcp_otel.report.model import checkpoints
from dcp_otel.tracing.detail import candidate_cap, in_sample, sample_every
from tests.ranks import run_ranks
from tests.report_invariants import assert_times_add_up

# A budget the 1-in-K sample does not cover (K >= 2) but whose candidate cap does (C >= 8 ranks).
WORLD, SLOW, FAILING, BUDGET = 8, 3, 5, 112
_NOT_STEPS = {semconv.SPAN_CHECKPOINT, semconv.SPAN_ASYNC_UPLOAD, semconv.SPAN_ASYNC_STAGING, "dcp.save"}


def _job(tmp: Path, detail: str) -> list[FileSpan]:
    job = run_ranks(
        "detail_rank", WORLD, tmp / detail,
        env={"DCP_OTEL_DETAIL": detail, "DCP_OTEL_SPAN_BUDGET": str(BUDGET), "DCP_OTEL_RUN_ID": f"detail-{detail}"},
        extra_args=["--slow-rank", str(SLOW), "--slow-s", "1.5", "--fail-rank", str(FAILING), "--saves", "3"],
        timeout_s=240,
    )  # fmt: skip
    return read_spans(sorted(job.out.glob("spans-*.jsonl")))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[FileSpan]]:
    tmp = tmp_path_factory.mktemp("detail")
    return {detail: _job(tmp, detail) for detail in ("auto", "full")}


def _by_trace(spans: list[FileSpan]) -> dict[str, list[FileSpan]]:
    traces: dict[str, list[FileSpan]] = {}
    for span in spans:
        traces.setdefault(span.trace_id, []).append(span)
    return traces


def _ranks_with_steps(spans: list[FileSpan]) -> set[int]:
    return {int(s.attributes[semconv.ATTR_RANK]) for s in spans if s.name not in _NOT_STEPS}


def test_auto_exports_steps_from_the_coordinator_the_straggler_the_failing_rank_and_the_sample(jobs) -> None:
    traces = _by_trace(jobs["auto"])
    assert len(traces) == 3  # one trace per checkpoint, across all 8 ranks
    summary_only = 0
    for spans in traces.values():
        op_spans = {int(s.attributes[semconv.ATTR_RANK]): s for s in spans if s.name == "dcp.save"}
        assert sorted(op_spans) == list(range(WORLD)), "every rank exports its operation span"
        reasons = {rank: span.attributes.get(semconv.ATTR_DETAIL_REASON, "summary") for rank, span in op_spans.items()}
        failed_here = op_spans[FAILING].error and any(s.error and s.name == "dcp.write_data" for s in spans)
        assert reasons[0] == "coordinator"
        assert reasons[SLOW] == "straggler"
        if failed_here:
            assert reasons[FAILING] == "failed"
        for rank, span in op_spans.items():
            if rank in (0, SLOW) or (failed_here and rank == FAILING):
                continue
            assert reasons[rank] == _sample_reason(spans, rank, span), rank
        detailed = {rank for rank, reason in reasons.items() if reason != "summary"}
        assert _ranks_with_steps(spans) == detailed
        for rank, span in op_spans.items():
            attrs = span.attributes
            assert attrs[semconv.ATTR_DETAIL] == ("steps" if rank in detailed else "summary")
            assert "write_data" in attrs[semconv.ATTR_STEP_NAMES]
            assert len(attrs[semconv.ATTR_STEP_SECONDS]) == len(attrs[semconv.ATTR_STEP_NAMES])
            if not (failed_here and rank == FAILING):  # its write raised: no bytes written
                assert attrs[semconv.ATTR_WRITTEN_BYTES] > 0
                # A summary-only span leaves the throughput to its bytes over its write's seconds (46 B a rank).
                assert (attrs.get(semconv.ATTR_THROUGHPUT, 0) > 0) == (rank in detailed)
            # What every rank shares is on the root once, not on each summary-only span.
            assert (semconv.ATTR_CHECKPOINT_ID in attrs) == (rank in detailed)
        summary_only += WORLD - len(detailed)
    assert summary_only > 0
    assert len(jobs["auto"]) < len(jobs["full"])


def _sample_reason(trace: list[FileSpan], rank: int, op_span: FileSpan) -> str:
    """What a rank that is not a candidate says: the sample is drawn from the trace id, so every rank (and this
    test) computes the same one. A rank's spans are its steps and DCP's collectives (as many on every rank:
    counted on the coordinator, which sends them)."""
    collectives = len([s for s in trace if semconv.is_collective_span(s.name) and s.attributes[semconv.ATTR_RANK] == 0])
    spans = len(op_span.attributes[semconv.ATTR_STEP_NAMES]) + collectives
    every = sample_every(WORLD, spans, BUDGET)
    assert every >= 2 and candidate_cap(spans, BUDGET) >= WORLD, "the budget must leave most ranks summary-only"
    return "sampled" if in_sample(int(trace[0].trace_id, 16), rank, every) else "summary"


IO_S, LONE, SAVES = 0.4, 6, 5


@pytest.fixture(scope="module")
def balanced(tmp_path_factory: pytest.TempPathFactory) -> list[list[FileSpan]]:
    """5 saves, every rank writing for 0.4 s; rank 6 takes 4x that (1.6 s) in the first save and the last."""
    job = run_ranks(
        "detail_rank", WORLD, tmp_path_factory.mktemp("balanced"),
        env={"DCP_OTEL_DETAIL": "auto", "DCP_OTEL_SPAN_BUDGET": str(BUDGET), "DCP_OTEL_RUN_ID": "balanced"},
        extra_args=["--io-s", str(IO_S), "--slow-rank", str(LONE), "--slow-s", str(3 * IO_S),
                    "--slow-saves", "0", str(SAVES - 1), "--saves", str(SAVES)],
        timeout_s=240,
    )  # fmt: skip
    traces = _by_trace(read_spans(sorted(job.out.glob("spans-*.jsonl"))))
    assert len(traces) == SAVES
    return sorted(traces.values(), key=lambda spans: min(s.start_ns for s in spans))


def test_a_balanced_io_bound_job_exports_steps_only_from_the_coordinator_and_the_sample(balanced) -> None:
    for spans in balanced[1:-1]:  # rank 6 as fast as the others
        op_spans = {int(s.attributes[semconv.ATTR_RANK]): s for s in spans if s.name == "dcp.save"}
        assert sorted(op_spans) == list(range(WORLD))
        reasons = {rank: span.attributes.get(semconv.ATTR_DETAIL_REASON, "summary") for rank, span in op_spans.items()}
        assert reasons[0] == "coordinator"
        for rank in range(1, WORLD):
            assert reasons[rank] == _sample_reason(spans, rank, op_spans[rank]), (rank, reasons)
        # Every rank waits only a little (its write is most of its operation): the old rule called each a straggler.
        assert all(span.attributes[semconv.ATTR_WAIT_SECONDS] < 0.25 * _seconds(span) for span in op_spans.values())
        detailed = {rank for rank, reason in reasons.items() if reason != "summary"}
        assert _ranks_with_steps(spans) == detailed
        assert len([s for s in spans if s.name not in _NOT_STEPS]) <= BUDGET


def test_a_rank_4x_slower_than_the_others_is_detailed_before_and_after_it_has_a_history(balanced) -> None:
    for spans, reason in ((balanced[0], "straggler"), (balanced[-1], "slow")):
        op_spans = {int(s.attributes[semconv.ATTR_RANK]): s for s in spans if s.name == "dcp.save"}
        assert op_spans[LONE].attributes[semconv.ATTR_DETAIL_REASON] == reason
        assert LONE in _ranks_with_steps(spans)
        others = [r for r in range(1, WORLD) if r != LONE]
        assert all(
            op_spans[r].attributes.get(semconv.ATTR_DETAIL_REASON, "summary") == _sample_reason(spans, r, op_spans[r])
            for r in others
        )
        assert [c.straggler for c in checkpoints(spans)] == [LONE]


def _seconds(span: FileSpan) -> float:
    return (span.end_ns - span.start_ns) / 1e9


def test_full_exports_every_step_of_every_rank(jobs) -> None:
    for spans in _by_trace(jobs["full"]).values():
        assert _ranks_with_steps(spans) == set(range(WORLD))
        assert {s.attributes[semconv.ATTR_DETAIL_REASON] for s in spans if s.name == "dcp.save"} == {"full"}


def test_the_report_names_the_same_straggler_and_failing_rank_from_auto_as_from_full(jobs) -> None:
    answers = {
        detail: [(c.straggler, c.failed_ranks, c.error is not None) for c in checkpoints(spans)]
        for detail, spans in jobs.items()
    }
    assert answers["auto"] == answers["full"]
    for spans in jobs.values():  # the summary-only ranks' times add up too
        assert_times_add_up(checkpoints(spans))
    assert [straggler for straggler, _, _ in answers["full"]] == [SLOW, SLOW, SLOW]
    assert [failed for _, failed, _ in answers["full"]] == [[], [FAILING], []]
