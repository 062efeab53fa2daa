"""dcp-otel adds no collective: a real 2-rank save and load make the same torch.distributed
calls with and without it (one trace across ranks comes from derived ids, not from messages)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.ranks import run_ranks


def test_instrumented_save_and_load_make_exactly_the_same_distributed_calls(tmp_path: Path) -> None:
    job = run_ranks("collectives", 2, tmp_path, timeout_s=120)
    for rank in range(2):
        counts = json.loads((job.out / f"calls-{rank}.json").read_text())
        assert counts["plain"], "the counting wrappers saw nothing: the test would prove nothing"
        assert counts["traced"] == counts["plain"], (rank, counts)
