"""What tracing the async save daemon costs: upload time of process-based async_save, with and without dcp-otel.

Each round runs two fresh single-rank jobs side by side (order alternating):
one plain, one instrumented with spans going over OTLP/HTTP to a receiver on
127.0.0.1 (the daemon builds its SDK from the inherited ``OTEL_*`` variables
and flushes after every save). Each job starts the daemon with a first
``async_save`` (measured separately), then times ``--saves`` more uploads of
``--mb`` MiB. Prints the median upload time of each variant and their ratio.

Usage::

    .venv/bin/python benchmarks/process_async.py            # 3 rounds, 5 saves of 16 MiB
    .venv/bin/python benchmarks/process_async.py --rounds 5 --mb 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

JOB = r"""
import json, os, sys, tempfile, time, warnings
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
if __name__ == "__main__":
    warnings.simplefilter("ignore")
    port, instrumented, saves, mb = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
    if instrumented:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        import dcp_otel
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        dcp_otel.instrument()
    dist.init_process_group("cpu:gloo")
    state = {"w": torch.randn(mb * 1024 * 1024 // 4)}
    folder = tempfile.mkdtemp()
    times = []
    for i in range(saves + 1):
        start = time.perf_counter()
        response = dcp.async_save(state, checkpoint_id=f"{folder}/{i}", async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        getattr(response, "upload_completion", response).result()
        times.append(time.perf_counter() - start)
    print(json.dumps({"first": times[0], "uploads": times[1:]}), flush=True)
    dist.destroy_process_group()
"""


def run_job(script: Path, instrumented: bool, saves: int, mb: int, endpoint: str) -> dict[str, object]:
    from tests.ports import free_port_range

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    run = subprocess.run([sys.executable, str(script), str(free_port_range(1)), "1" if instrumented else "0",
                          str(saves), str(mb)], capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(run.stderr[-3000:])
    result: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def measure(rounds: int, saves: int, mb: int) -> dict[str, float]:
    """Medians of plain and traced jobs, side by side, order alternating."""
    from tests.otlp_receiver import OtlpReceiver

    uploads: dict[bool, list[float]] = {False: [], True: []}
    firsts: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp, OtlpReceiver() as receiver:
        script = Path(tmp) / "job.py"
        script.write_text(JOB)
        for round_ in range(rounds):
            for instrumented in ((False, True) if round_ % 2 == 0 else (True, False)):
                result = run_job(script, instrumented, saves, mb, receiver.endpoint)
                uploads[instrumented] += result["uploads"]  # type: ignore[arg-type]
                firsts[instrumented].append(float(result["first"]))  # type: ignore[arg-type]
        spans = len(receiver.spans)
    return {
        "upload_plain": statistics.median(uploads[False]), "upload_traced": statistics.median(uploads[True]),
        "first_plain": statistics.median(firsts[False]), "first_traced": statistics.median(firsts[True]),
        "spans": spans,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--mb", type=int, default=16)
    args = parser.parse_args()
    started = time.monotonic()
    m = measure(args.rounds, args.saves, args.mb)
    print(f"process-based async_save, {args.mb} MiB, {args.rounds} rounds x {args.saves} uploads "
          f"({time.monotonic() - started:.0f} s, {m['spans']:.0f} spans received)")  # fmt: skip
    print(f"  upload (daemon warm):   plain {m['upload_plain'] * 1e3:8.1f} ms   traced {m['upload_traced'] * 1e3:8.1f} ms"
          f"   ratio {m['upload_traced'] / m['upload_plain']:.3f}")  # fmt: skip
    print(f"  first (starts daemon):  plain {m['first_plain'] * 1e3:8.1f} ms   traced {m['first_traced'] * 1e3:8.1f} ms"
          f"   ratio {m['first_traced'] / m['first_plain']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
