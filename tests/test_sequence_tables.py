"""Ranks of one checkpoint derive the same trace id however many ids some of them use alone.

Each process counts the operations of every (operation, checkpoint id) pair in a bounded table, and the
count is part of the trace id. A table evicts its least recently used key, so it must change only with
operations every rank of the checkpoint makes, in the same order: one table per process group, and
``no_dist`` calls apart, each then a one-rank trace of its own.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint.logger as dcp_logger_module

from dcp_otel.attach.call_arguments import CallArguments
from dcp_otel.tracing.trace_ids import CheckpointKey, SequenceCounter, SequenceTables
from tests.ranks import run_ranks
from tests.spans_io import load_spans, named

BEST = CheckpointKey("run", "0", "save", "/ckpt/best")


def _own(n: int) -> CheckpointKey:
    return BEST._replace(checkpoint_id=f"/ckpt/rank0-only-{n}")


def test_one_table_for_all_operations_would_split_the_ranks() -> None:
    """Why the tables are apart: rank 0's own ids push the shared one out of its table, not out of rank 1's."""
    rank0, rank1 = SequenceCounter(max_keys=4), SequenceCounter(max_keys=4)
    assert rank0.next(BEST) == rank1.next(BEST) == 0
    for n in range(6):
        rank0.next(_own(n))
    assert (rank0.next(BEST), rank1.next(BEST)) == (0, 1)  # two trace ids for one checkpoint


def test_private_and_subgroup_operations_leave_the_default_groups_table_alone() -> None:
    rank0, rank1 = SequenceTables(max_keys=4), SequenceTables(max_keys=4)
    subgroup = type("Group", (), {})()  # any object a weak reference can hold, as torch's ProcessGroup
    assert rank0.counter().next(BEST) == rank1.counter().next(BEST) == 0
    for n in range(6):
        assert rank0.counter(private=True).next(_own(n)) == 0
        assert rank0.counter(subgroup).next(_own(n)) == 0
    assert rank0.counter().next(BEST) == rank1.counter().next(BEST) == 1
    assert rank0.counter(subgroup) is rank0.counter(subgroup) is not rank0.counter()
    assert rank0.counter(None, private=True) is rank0.counter(subgroup, private=True)  # no_dist: the group is moot
    del subgroup  # the group's table goes with it
    assert len(rank0._groups) == 0


def test_the_reader_finds_the_arguments_of_the_dcp_call_being_logged() -> None:
    read = CallArguments.of(dcp_logger_module)
    assert read is not None
    seen: list[object] = []

    @dcp_logger_module._dcp_method_logger()
    def save(state: dict[str, int], *, checkpoint_id: str, no_dist: bool = False) -> None:
        seen.append(read())

    save({}, checkpoint_id="/ckpt/a", no_dist=True)
    assert seen == [{"checkpoint_id": "/ckpt/a", "no_dist": True}]
    assert read() is None  # outside a DCP call: nothing


def test_a_shared_checkpoint_is_one_trace_after_rank_0_used_more_ids_alone_than_a_table_holds(tmp_path: Path) -> None:
    job = run_ranks("asymmetric_rank", 2, tmp_path, timeout_s=120)
    spans = load_spans(sorted(job.out.glob("spans-*.jsonl")))
    best = str(job.ckpt / "best")
    shared = [s for s in spans if s.name in ("dcp.save", "dcp.load") and s.attributes["dcp.checkpoint_id"] == best]
    by_call: dict[tuple[str, int], set[str]] = {}
    for span in shared:
        by_call.setdefault((span.name, span.attributes["dcp.operation.seq"]), set()).add(span.trace_id)
    counts = {call: sorted(s.rank for s in shared if (s.name, s.attributes["dcp.operation.seq"]) == call) for call in by_call}
    assert counts == {("dcp.save", 0): [0, 1], ("dcp.save", 1): [0, 1], ("dcp.load", 0): [0, 1]}, counts
    assert all(len(trace_ids) == 1 for trace_ids in by_call.values()), by_call  # each call: one trace, both ranks
    assert len({next(iter(t)) for t in by_call.values()}) == 3
    roots = {s.trace_id for s in named(spans, "dcp.checkpoint")}
    assert all(next(iter(t)) in roots for t in by_call.values())
    # rank 0's no_dist saves: each its own one-rank trace, with its own root
    alone = [s for s in named(spans, "dcp.save") if "rank0-only" in s.attributes["dcp.checkpoint_id"]]
    assert len(alone) == 6 and {s.rank for s in alone} == {0}
    assert all(s.attributes["dcp.world_size"] == 1 and s.attributes["dcp.coordinator"] for s in alone)
    assert {s.trace_id for s in alone} <= roots and len({s.trace_id for s in alone}) == 6
