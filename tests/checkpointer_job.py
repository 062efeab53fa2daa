"""A checkpointer job's spans and results, read back (the ``_experimental`` checkpointer's, torch_checkpointing's).

Each rank writes ``traces/rank-R.jsonl`` and its checkpoint (writer) process ``traces/process-R.jsonl``;
``result-R.json`` holds what each call returned or raised and the rank's metrics.
"""

from __future__ import annotations

import json

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan, read_spans
from dcp_otel.report.model import Checkpoint, checkpoints
from tests.ranks import Job


class CheckpointerRun:
    """The job's spans (ranks and checkpoint processes) and results."""

    def __init__(self, job: Job, world: int) -> None:
        self.job = job
        traces = job.out / "traces"
        self.rank_spans = read_spans(sorted(traces.glob("rank-*.jsonl")))
        self.process_spans = read_spans(sorted(traces.glob("process-*.jsonl")))
        self.spans = self.rank_spans + self.process_spans
        self.by_id = {s.span_id: s for s in self.spans}
        self.results = [json.loads((job.out / f"result-{r}.json").read_text()) for r in range(world)]

    def trace_of(self, folder: str, operation: str) -> list[FileSpan]:
        """The spans of the one trace of ``operation`` on ``folder`` (asserting there is exactly one)."""
        path = str(self.job.ckpt / folder)
        ids = {s.trace_id for s in self.spans
               if s.attributes.get(semconv.ATTR_CHECKPOINT_ID) == path and s.attributes.get(semconv.ATTR_OPERATION) == operation}  # fmt: skip
        assert len(ids) == 1, f"{operation} {folder}: {len(ids)} traces"
        return [s for s in self.spans if s.trace_id in ids]

    def parent(self, span: FileSpan) -> FileSpan:
        return self.by_id[span.parent_id]

    def sample(self, rank: int, name: str, **labels: str) -> float | None:
        for sample_name, sample_labels, value in self.results[rank]["samples"]:
            if sample_name == name and sample_labels == {**labels, "rank": str(rank)}:
                return float(value)
        return None

    def report(self, folder: str, operation: str) -> Checkpoint:
        path = str(self.job.ckpt / folder)
        return next(c for c in checkpoints(self.spans) if c.checkpoint_id == path and c.operation == operation)


def per_rank(spans: list[FileSpan], name: str) -> dict[int, FileSpan]:
    """The spans named ``name``, by rank (asserting one per rank)."""
    found = [s for s in spans if s.name == name]
    by_rank = {int(s.attributes[semconv.ATTR_RANK]): s for s in found}
    assert len(by_rank) == len(found), f"{name}: two on one rank"
    return by_rank


def assert_the_second_save_waited_for_the_first_write(run: CheckpointerRun, operation: str, world: int) -> None:
    """Saves ``async-a`` then ``async-b`` back to back: where the first write was still running, the second save's
    ``dcp.wait_previous_checkpoint`` ends when that write does, before the second one stages anything."""
    first, second = (run.trace_of(f, operation) for f in ("async-a", "async-b"))
    first_uploads = per_rank(first, semconv.SPAN_ASYNC_UPLOAD)
    ops, waits = per_rank(second, semconv.span_name(operation)), per_rank(second, "dcp.wait_previous_checkpoint")
    exercised = 0
    for rank in range(world):
        assert run.results[rank]["back_to_back"] == [{"returned": "NoneType"}] * 2
        if first_uploads[rank].end_ns <= ops[rank].start_ns:  # the first write was done already: no wait
            assert rank not in waits
            continue
        exercised += 1
        assert run.parent(waits[rank]) is ops[rank]
        stage = per_rank(second, "dcp.stage_checkpoint")[rank]
        assert waits[rank].end_ns <= stage.start_ns and waits[rank].duration_s > 0
        assert ops[rank].attributes[semconv.ATTR_WAIT_SECONDS] >= waits[rank].duration_s
    assert exercised  # a write takes milliseconds; the second save starts microseconds after the first returns
