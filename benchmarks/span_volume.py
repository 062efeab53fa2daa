"""Spans and exported bytes per checkpoint, ``detail="full"`` against ``detail="auto"``, and at scale.

    .venv/bin/python benchmarks/span_volume.py            # 16 real gloo ranks, 3 saves per mode (~3 min)
    .venv/bin/python benchmarks/span_volume.py --ranks 8

Runs the same job (``tests/workers/detail_rank.py``: small saves, one rank
slow) in three ways: ``full``; ``auto`` with the default span budget (2,000,
so at 16 ranks every rank is in the sample: the same spans as ``full``); and
``auto`` with a budget of 16, so that at 16 ranks most ranks send only their
summary, as most ranks of a 1,000-rank job do with the default budget. It
counts each checkpoint's spans and their size as OTLP protobuf (what an
exporter sends), then projects ``full`` and ``auto`` with the default budget to
1,000 and 10,000 ranks from the measured sizes of an operation span (with all
attributes, and summary-only), a step span and the steps per rank, with
K from :func:`dcp_otel.tracing.detail.sample_every` (a balanced job: the
coordinator and the 1-in-K sample send step spans).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.proto.trace.v1.trace_pb2 import Span  # noqa: E402

from dcp_otel import semconv  # noqa: E402
from dcp_otel.otlp_file import from_otlp_json  # noqa: E402
from dcp_otel.tracing.detail import sample_every  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402

BUDGET = 2000
TEMPO_TRACE_LIMIT = 5_000_000  # Tempo's default max_bytes_per_trace
_OPERATION = "dcp.save"
_NOT_STEPS = (_OPERATION, semconv.SPAN_CHECKPOINT)


def _detail(span: Span) -> str:
    return next((a.value.string_value for a in span.attributes if a.key == semconv.ATTR_DETAIL), "")


def measure(ranks: int, detail: str, budget: int, tmp: Path) -> dict[str, float]:
    """Spans and bytes per checkpoint, and the median size of each kind of span, as OTLP protobuf."""
    job = run_ranks("detail_rank", ranks, tmp / f"{detail}-{budget}",
                    env={"DCP_OTEL_DETAIL": detail, "DCP_OTEL_SPAN_BUDGET": str(budget),
                         "DCP_OTEL_RUN_ID": f"{detail}-{budget}"},
                    extra_args=["--slow-rank", "1", "--slow-s", "0.2", "--saves", "3"], timeout_s=600)  # fmt: skip
    traces: dict[bytes, list[Span]] = {}
    for path in sorted(job.out.glob("spans-*.jsonl")):
        for line in path.read_text().splitlines():
            for resource_spans in from_otlp_json(json.loads(line)).resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        traces.setdefault(span.trace_id, []).append(span)
    checkpoints = list(traces.values())
    ops = [s for t in checkpoints for s in t if s.name == _OPERATION]
    steps = [s for t in checkpoints for s in t if s.name not in _NOT_STEPS]
    summary_only = [s.ByteSize() for s in ops if _detail(s) == semconv.DETAIL_SUMMARY]
    return {
        "spans": statistics.median(len(t) for t in checkpoints),
        "step_spans": statistics.median(len([s for s in t if s.name not in _NOT_STEPS]) for t in checkpoints),
        "bytes": statistics.median(sum(s.ByteSize() for s in t) for t in checkpoints),
        "op_bytes": statistics.median(s.ByteSize() for s in ops if _detail(s) != semconv.DETAIL_SUMMARY),
        "summary_op_bytes": statistics.median(summary_only) if summary_only else 0.0,
        "step_bytes": statistics.median(s.ByteSize() for s in steps) if steps else 0.0,
        "steps_per_rank": len(steps) / len(ops) if ops else 0.0,
    }


def project(world: int, full: dict[str, float], summary_op_bytes: float) -> dict[str, float]:
    """One checkpoint on ``world`` ranks in each mode (default budget), from the measured sizes."""
    steps = max(1.0, full["steps_per_rank"])
    every = sample_every(world, round(steps), BUDGET)
    detailed = min(world, 1 + world / every)  # the coordinator and the sample, in a balanced job
    return {
        "full_spans": world * (1 + steps) + 1,
        "full_bytes": world * (full["op_bytes"] + steps * full["step_bytes"]),
        "auto_spans": world + detailed * steps + 1,
        "auto_steps": detailed * steps,
        "auto_bytes": detailed * (full["op_bytes"] + steps * full["step_bytes"])
        + (world - detailed) * summary_op_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "full": measure(args.ranks, "full", BUDGET, Path(tmp)),
            f"auto, budget {BUDGET}": measure(args.ranks, "auto", BUDGET, Path(tmp)),
            "auto, budget 16": measure(args.ranks, "auto", 16, Path(tmp)),
        }
    full, small = runs["full"], runs["auto, budget 16"]
    print(f"\nper checkpoint, {args.ranks} ranks (measured, medians of 3 checkpoints; OTLP protobuf sizes)")
    print(f"{'mode':<20} {'spans':>6} {'step spans':>11} {'KiB':>7} {'op span B':>10} {'summary-only B':>15}")
    for name, m in runs.items():
        print(f"{name:<20} {m['spans']:>6.0f} {m['step_spans']:>11.0f} {m['bytes'] / 1024:>7.1f} "
              f"{m['op_bytes']:>10.0f} {m['summary_op_bytes']:>15.0f}")  # fmt: skip
    print(f"\nprojected per checkpoint, budget {BUDGET} ({full['steps_per_rank']:.1f} step spans per rank, "
          f"{full['step_bytes']:.0f} B each; Tempo's default per-trace limit: {TEMPO_TRACE_LIMIT:,} B = "
          f"{TEMPO_TRACE_LIMIT / 2**20:.2f} MiB)")
    print(f"{'ranks':>7} {'full spans':>11} {'full MiB':>9} {'auto spans':>11} {'auto step spans':>16} {'auto MiB':>9}")
    for world in (args.ranks, 1_000, 10_000):
        p = project(world, full, small["summary_op_bytes"])
        print(f"{world:>7} {p['full_spans']:>11.0f} {p['full_bytes'] / 2**20:>9.2f} {p['auto_spans']:>11.0f} "
              f"{p['auto_steps']:>16.0f} {p['auto_bytes'] / 2**20:>9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
