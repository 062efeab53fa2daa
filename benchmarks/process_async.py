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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ab import Arm, median, run_rounds  # noqa: E402

JOB = r"""
import json, os, shutil, sys, tempfile, time, warnings
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
warnings.simplefilter("ignore")
instrumented, saves, mb = sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3])
os.environ["MASTER_ADDR"] = "127.0.0.1"  # (where the daemon's own store listens, on a free port it picks)
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
folder = tempfile.mkdtemp()
dist.init_process_group("cpu:gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
state = {"w": torch.randn(mb * 1024 * 1024 // 4)}
times = []
for i in range(saves + 1):
    start = time.perf_counter()
    process = AsyncCheckpointerType.PROCESS
    response = dcp.async_save(state, checkpoint_id=f"{folder}/{i}", async_checkpointer_type=process)
    getattr(response, "upload_completion", response).result()
    times.append(time.perf_counter() - start)
dist.destroy_process_group()
shutil.rmtree(folder, ignore_errors=True)
print(json.dumps([{"first": times[0]}, *({"upload": t} for t in times[1:])]), flush=True)  # a sample each
"""


def measure(rounds: int, saves: int, mb: int) -> dict[str, float]:
    """Medians of plain and traced jobs, side by side, order alternating."""
    from tests.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        arms = [Arm(name, [flag, str(saves), str(mb)], env) for name, flag in (("plain", "0"), ("traced", "1"))]
        found = run_rounds(JOB, arms, rounds, say=False)
        medians = {f"{measure}_{arm}": median(found, arm, measure) for arm in ("plain", "traced")
                   for measure in ("upload", "first")}  # fmt: skip
        medians["spans"] = len(receiver.spans)
    return medians


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
