"""examples/quickstart.py, as docs/setup.md shows it, works: a real 2-rank torchrun job, traced to files or OTLP."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from dcp_otel import semconv
from tests.otlp_receiver import OtlpReceiver
from tests.ranks import REPO, rank_env

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def run_quickstart(out: Path, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = rank_env(**(extra_env or {}))
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        if extra_env is None or name not in extra_env:
            env.pop(name, None)
    done = subprocess.run(
        [*TORCHRUN, str(REPO / "examples" / "quickstart.py"), "--out", str(out)],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_quickstart_writes_one_trace_per_checkpoint_that_the_report_reads(tmp_path: Path) -> None:
    run = run_quickstart(tmp_path)
    assert "rank 0: resumed from step 4" in run.stdout

    summary = subprocess.run(
        [sys.executable, "-m", "dcp_otel", "report", str(tmp_path / "traces")],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert summary.returncode == 0, summary.stderr
    assert summary.stdout.startswith("3 checkpoint operations (1 save, 1 async_save, 1 load) on 2 ranks: none failed\n")
    for operation in ("save", "async_save", "load"):
        assert f"\n{operation} {tmp_path}/checkpoints/step-" in summary.stdout
    assert "async_save" in summary.stdout and "completed" in summary.stdout


def test_quickstart_sends_spans_over_otlp_http_with_the_standard_variables(tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        run_quickstart(tmp_path, {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                                  "OTEL_SERVICE_NAME": "otlp-quickstart-test"})  # fmt: skip
    assert not (tmp_path / "traces").exists()  # nothing went to files
    traces: dict[str, list] = defaultdict(list)
    for span in receiver.spans:
        traces[span.trace_id].append(span)
    checkpoint_traces = {t: s for t, s in traces.items() if any(x.name == semconv.SPAN_CHECKPOINT for x in s)}
    assert len(checkpoint_traces) == 3
    for spans in checkpoint_traces.values():
        (root,) = [s for s in spans if s.name == semconv.SPAN_CHECKPOINT]
        operations = [s for s in spans if s.parent_id == root.span_id]
        assert sorted(s.attributes[semconv.ATTR_RANK] for s in operations) == [0, 1]
        run_ids = {s.attributes[semconv.ATTR_RUN_ID] for s in [root, *operations]}
        assert len(run_ids) == 1 and run_ids != {"none"}  # torchrun --standalone's rendezvous id
    assert {s.resource["service.name"] for s in receiver.spans} == {"otlp-quickstart-test"}
    # The resource says which host, rank and run each process is.
    for span in receiver.spans:
        assert span.resource["host.name"] and span.resource[semconv.ATTR_WORLD_SIZE] == 2
        if span.name.startswith(semconv.SPAN_PREFIX):  # (the script's own train_step spans have no rank)
            assert span.resource[semconv.ATTR_RANK] == span.attributes[semconv.ATTR_RANK]
    assert {s.resource[semconv.ATTR_RUN_ID] for s in receiver.spans} == run_ids  # the run id of the trace ids
