"""Spans and exported bytes per checkpoint, ``detail="full"`` against ``detail="auto"``, and at scale.

    .venv/bin/python benchmarks/span_volume.py            # 16 real gloo ranks, 3 saves per mode (~3 min)
    .venv/bin/python benchmarks/span_volume.py --ranks 8

Runs the same job (``tests/workers/detail_rank.py``: small saves, one rank
slow) in three ways: ``full``; ``auto`` with the default span budget (2,000,
so at 16 ranks every rank is in the sample: the same spans as ``full``); and
``auto`` with a budget of 16, so that at 16 ranks most ranks send only their
summary, as most ranks of a 1,000-rank job do with the default budget. A
fourth run is a balanced, I/O-bound job (every rank writes for 1.2 s, above
the rule's floor, 4 saves, budget 16): in its first saves every rank looks
like a straggler and the candidate cap holds them; once the ranks have a
history only the coordinator and the sample send steps. It counts each
checkpoint's spans and their size as OTLP protobuf (what an exporter sends),
then projects ``full`` and ``auto`` with the default budget to 1,000 and
10,000 ranks from the measured sizes of an operation span (with all
attributes, and summary-only), a step span and the steps per rank: ``auto``
for a balanced job (the coordinator and the 1-in-K sample, K from
:func:`dcp_otel.tracing.detail.sample_every`) and at its worst (every rank a
candidate: the first saves of a job whose writes take over a second, or a
slowdown of the whole job; plus C ranks, from
:func:`dcp_otel.tracing.detail.candidate_cap`).
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
from dcp_otel.tracing.detail import candidate_cap, sample_every  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402

BUDGET = 2000
TEMPO_TRACE_LIMIT = 5_000_000  # Tempo's default max_bytes_per_trace
_OPERATION = "dcp.save"
_NOT_STEPS = (_OPERATION, semconv.SPAN_CHECKPOINT)


def _detail(span: Span) -> str:
    return next((a.value.string_value for a in span.attributes if a.key == semconv.ATTR_DETAIL), "")


def _rank(span: Span) -> int:
    return next((int(a.value.int_value) for a in span.attributes if a.key == semconv.ATTR_RANK), -1)


_UNEVEN = ["--slow-rank", "1", "--slow-s", "0.2", "--saves", "3"]
_IO_BOUND = ["--io-s", "1.2", "--saves", "4"]


def measure(ranks: int, detail: str, budget: int, tmp: Path, job_args: list[str] = _UNEVEN) -> dict[str, float]:
    """Spans and bytes per checkpoint, and the median size of each kind of span, as OTLP protobuf."""
    name = f"{detail}-{budget}-{len(job_args)}"
    job = run_ranks("detail_rank", ranks, tmp / name,
                    env={"DCP_OTEL_DETAIL": detail, "DCP_OTEL_SPAN_BUDGET": str(budget), "DCP_OTEL_RUN_ID": name},
                    extra_args=job_args, timeout_s=600)  # fmt: skip
    traces: dict[bytes, list[Span]] = {}
    for path in sorted(job.out.glob("spans-*.jsonl")):
        for line in path.read_text().splitlines():
            for resource_spans in from_otlp_json(json.loads(line)).resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        traces.setdefault(span.trace_id, []).append(span)
    checkpoints = sorted(traces.values(), key=lambda spans: min(s.start_time_unix_nano for s in spans))
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
        # What the rule counts: a rank's own steps (the coordinator's include the global plan and metadata).
        "coordinator_steps": len([s for s in steps if _rank(s) == 0]) / max(1, len(checkpoints)),
        "rank_steps": len([s for s in steps if _rank(s) != 0]) / max(1, len([s for s in ops if _rank(s) != 0])),
        "step_spans_each": [len([s for s in t if s.name not in _NOT_STEPS]) for t in checkpoints],  # type: ignore[dict-item]
    }


def project(world: int, full: dict[str, float], summary_op_bytes: float) -> dict[str, float]:
    """One checkpoint on ``world`` ranks in each mode (default budget), from the measured sizes."""
    steps, coordinator = max(1.0, full["rank_steps"]), full["coordinator_steps"]
    every = sample_every(world, round(steps), BUDGET)
    sampled = min(world - 1, (world - 1) / every)  # with the coordinator, all a balanced job details
    worst = min(world - 1, sampled + candidate_cap(round(steps), BUDGET))  # and the capped candidates

    def step_spans(ranks: float) -> float:
        return coordinator + ranks * steps

    def size(ranks: float) -> float:  # detailed ranks send their operation span and steps; the others a summary
        detailed = 1 + ranks
        return detailed * full["op_bytes"] + step_spans(ranks) * full["step_bytes"] + (world - detailed) * summary_op_bytes

    full_steps = step_spans(world - 1)
    return {
        "full_spans": world + full_steps + 1,
        "full_bytes": world * full["op_bytes"] + full_steps * full["step_bytes"],
        "auto_spans": world + step_spans(sampled) + 1,
        "auto_steps": step_spans(sampled),
        "auto_bytes": size(sampled),
        "worst_steps": step_spans(worst),
        "worst_bytes": size(worst),
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
            "auto, I/O-bound, 16": measure(args.ranks, "auto", 16, Path(tmp), _IO_BOUND),
        }
    full, small = runs["full"], runs["auto, budget 16"]
    print(f"\nper checkpoint, {args.ranks} ranks (measured, medians of a run's checkpoints; OTLP protobuf sizes)")
    print(f"{'mode':<20} {'spans':>6} {'step spans':>11} {'KiB':>7} {'op span B':>10} {'summary-only B':>15}")
    for name, m in runs.items():
        print(f"{name:<20} {m['spans']:>6.0f} {m['step_spans']:>11.0f} {m['bytes'] / 1024:>7.1f} "
              f"{m['op_bytes']:>10.0f} {m['summary_op_bytes']:>15.0f}")  # fmt: skip
    io = runs["auto, I/O-bound, 16"]["step_spans_each"]
    print(f"balanced I/O-bound job, budget 16, step spans in each of its saves: {io} (first {len(io) - 1}: no "
          f"history yet, candidates capped at C = {candidate_cap(round(full['rank_steps']), 16)}; then the "
          f"coordinator and the sample)")  # fmt: skip
    print(f"\nprojected per checkpoint, budget {BUDGET} ({full['rank_steps']:.1f} step spans per rank, "
          f"{full['coordinator_steps']:.0f} on the coordinator, "
          f"{full['step_bytes']:.0f} B each; Tempo's default per-trace limit: {TEMPO_TRACE_LIMIT:,} B = "
          f"{TEMPO_TRACE_LIMIT / 2**20:.2f} MiB)")
    print(f"{'':>7} {'':>21} {'auto, balanced':>32} {'auto, every rank a candidate':>30}")
    print(f"{'ranks':>7} {'full spans':>11} {'full MiB':>9} {'spans':>11} {'step spans':>11} {'MiB':>8} "
          f"{'step spans':>21} {'MiB':>8}")  # fmt: skip
    for world in (args.ranks, 1_000, 10_000):
        p = project(world, full, small["summary_op_bytes"])
        print(f"{world:>7} {p['full_spans']:>11.0f} {p['full_bytes'] / 2**20:>9.2f} {p['auto_spans']:>11.0f} "
              f"{p['auto_steps']:>11.0f} {p['auto_bytes'] / 2**20:>8.2f} {p['worst_steps']:>21.0f} "
              f"{p['worst_bytes'] / 2**20:>8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
