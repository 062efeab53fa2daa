"""16 ranks on this 2-core machine (tiny state dicts): still one trace per checkpoint, and a report."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from dcp_otel import semconv
from dcp_otel.otlp_file import read_spans
from dcp_otel.report import build
from tests.ranks import REPO, rank_env

RANKS = 16


def test_sixteen_ranks_give_one_trace_per_checkpoint_and_a_report(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    run = subprocess.run([sys.executable, "-m", "dcp_otel", "demo", "--ranks", str(RANKS), "--steps", "4",
                          "--every", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=400, cwd=REPO,
                         env=rank_env(**{semconv.ENV_METRICS_PORT: "0"}))  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    spans = [s for s in read_spans([out / "traces"]) if s.name.startswith(semconv.SPAN_PREFIX) and s.name != semconv.SPAN_PROCESS]
    traces: dict[str, list] = defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    operations = {t: {s.attributes[semconv.ATTR_OPERATION] for s in group} for t, group in traces.items()}
    assert sorted(op for ops in operations.values() for op in ops) == ["async_save", "load", "save"]
    for group in traces.values():  # one trace per checkpoint: every rank, under one root
        assert {s.attributes[semconv.ATTR_RANK] for s in group} == set(range(RANKS))
        roots = [s for s in group if s.name == semconv.SPAN_CHECKPOINT]
        assert len(roots) == 1 and not roots[0].parent_id
        ids = {s.span_id for s in group}
        assert all(s.parent_id in ids for s in group if s is not roots[0])
    report = build([out / "traces"])
    assert [len(c.ranks) for c in report.checkpoints] == [RANKS] * 3
    assert f"3 checkpoint operations (1 save, 1 async_save, 1 load) on {RANKS} ranks: " in run.stdout
