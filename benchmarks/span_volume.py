"""Spans and exported bytes per checkpoint, ``detail="full"`` against ``detail="auto"``, and at scale.

    .venv/bin/python benchmarks/span_volume.py            # 16 real gloo ranks, 3 saves per mode (~2 min)
    .venv/bin/python benchmarks/span_volume.py --ranks 8

Runs the same job (``tests/workers/detail_rank.py``: small saves, one rank
slow) once per mode with the default span budget, counts the spans of each
checkpoint's trace and their size as OTLP protobuf (what an exporter sends),
then projects both to 1,000 and 10,000 ranks from the measured sizes: in
``full`` every rank sends every step span; in ``auto`` every rank sends its
operation span with its summary, the coordinator and the 1-in-K sample
(K from :func:`dcp_otel.tracing.detail.sample_every`) their step spans.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.proto.trace.v1.trace_pb2 import Span  # noqa: E402

from dcp_otel.otlp_file import from_otlp_json  # noqa: E402
from dcp_otel.tracing.detail import sample_every  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402

BUDGET = 2000
TEMPO_TRACE_LIMIT = 5 * 1024 * 1024


def measure(ranks: int, detail: str, tmp: Path) -> dict[str, float]:
    """Spans per checkpoint and the bytes of an operation span and of a step span, as OTLP protobuf."""
    job = run_ranks("detail_rank", ranks, tmp / detail, env={"DCP_OTEL_DETAIL": detail, "DCP_OTEL_RUN_ID": detail},
                    extra_args=["--slow-rank", "1", "--slow-s", "0.2", "--saves", "3"], timeout_s=600)  # fmt: skip
    import json

    per_trace: dict[bytes, list[Span]] = {}
    for path in sorted(job.out.glob("spans-*.jsonl")):
        for line in path.read_text().splitlines():
            request = from_otlp_json(json.loads(line))
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        per_trace.setdefault(span.trace_id, []).append(span)
    traces = [spans for spans in per_trace.values() if len(spans) > 1]
    op_sizes = [s.ByteSize() for t in traces for s in t if s.name == "dcp.save"]
    step_sizes = [s.ByteSize() for t in traces for s in t if s.name not in ("dcp.save", "dcp.checkpoint")]
    steps_per_rank = statistics.median(
        len([s for s in t if s.name not in ("dcp.save", "dcp.checkpoint")]) / ranks for t in per_trace.values()
    ) if detail == "full" else 0.0  # fmt: skip
    return {
        "spans": statistics.median(len(t) for t in traces),
        "bytes": statistics.median(sum(s.ByteSize() for s in t) for t in traces),
        "op_bytes": statistics.median(op_sizes),
        "step_bytes": statistics.median(step_sizes) if step_sizes else 0.0,
        "steps_per_rank": steps_per_rank,
    }


def project(world: int, full: dict[str, float], auto: dict[str, float]) -> dict[str, tuple[float, float]]:
    """(spans, bytes) of one checkpoint on ``world`` ranks in each mode, from the measured sizes."""
    steps = max(1.0, full["steps_per_rank"])
    full_spans = world * (1 + steps) + 1
    full_bytes = world * (full["op_bytes"] + steps * full["step_bytes"])
    every = sample_every(world, round(steps), BUDGET)
    detailed = 1 + world / every  # the coordinator and the sample, in a balanced job
    auto_steps = detailed * steps
    auto_spans = world + auto_steps + 1
    auto_bytes = world * auto["op_bytes"] + auto_steps * full["step_bytes"]
    return {"full": (full_spans, full_bytes), "auto": (auto_spans, auto_bytes), "auto_steps": (auto_steps, 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        full = measure(args.ranks, "full", Path(tmp))
        auto = measure(args.ranks, "auto", Path(tmp))
    print(f"\nspans per checkpoint, {args.ranks} ranks (measured; span budget {BUDGET})")
    print(f"{'mode':<6} {'spans':>8} {'KiB':>9} {'op span B':>10} {'step span B':>12}")
    for name, m in (("full", full), ("auto", auto)):
        print(f"{name:<6} {m['spans']:>8.0f} {m['bytes'] / 1024:>9.1f} {m['op_bytes']:>10.0f} {m['step_bytes']:>12.0f}")
    print(f"\nprojected per checkpoint ({full['steps_per_rank']:.1f} step spans per rank; Tempo's default trace limit 5 MiB)")
    print(f"{'ranks':>7} {'full spans':>11} {'full MiB':>9} {'auto spans':>11} {'auto step spans':>16} {'auto MiB':>9}")
    for world in (args.ranks, 1_000, 10_000):
        p = project(world, full, auto)
        print(f"{world:>7} {p['full'][0]:>11.0f} {p['full'][1] / 2**20:>9.2f} {p['auto'][0]:>11.0f} "
              f"{p['auto_steps'][0]:>16.0f} {p['auto'][1] / 2**20:>9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
