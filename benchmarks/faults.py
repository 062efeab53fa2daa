"""What a dead or hung OTLP endpoint costs a save, beside a healthy exporter: traced / plain, side by side.

    .venv/bin/python benchmarks/faults.py [--repeats 15]

One process saves a 64 MiB state dict, alternately with dcp-otel off and on
(blocks of saves interleaved, medians). When on, spans go through the SDK's batch
processor to an OTLP/HTTP exporter whose endpoint refuses connections ("dead")
or accepts them and never answers ("hung"): the export thread is stuck or
retrying, its queue fills and drops, and the save must not notice. The
"healthy" case, an exporter that takes every span at once, is the baseline:
what the spans themselves cost a save.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import shutil
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import dcp_otel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import Measures, interleave, median  # noqa: E402

SAVES_PER_BLOCK = 3


class _Discarding(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


KINDS = ("healthy", "dead", "hung")


def save_ratio(kind: str, repeats: int) -> tuple[float, float]:
    """(plain, traced) median seconds of a 64 MiB save, the exporter ``healthy`` (it takes
    every span at once), or its OTLP endpoint ``dead`` or ``hung``."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        if kind == "hung":
            server.listen(128)
        else:
            server.close()
        provider = TracerProvider()
        exporter = (_Discarding() if kind == "healthy"
                    else OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=5))  # fmt: skip
        provider.add_span_processor(BatchSpanProcessor(exporter))
        state = {f"layer{i}": torch.randn(1024, 1024) for i in range(16)}
        with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as root:

            def save() -> float:
                gc.collect()
                started = time.perf_counter()
                dcp.save(state, checkpoint_id=f"{root}/c")
                elapsed = time.perf_counter() - started
                shutil.rmtree(f"{root}/c")  # a filling /dev/shm would drift
                return elapsed

            def block(traced: bool) -> list[Measures]:
                # A job instruments once: each arm is a block of saves after an
                # untimed one, which pays what a first checkpoint pays once.
                if traced:
                    dcp_otel.instrument(tracer_provider=provider)
                save()
                found = [{"s": save()} for _ in range(SAVES_PER_BLOCK)]
                if traced:
                    dcp_otel.uninstrument()
                return found

            save()
            times = interleave({"plain": lambda: block(False), "traced": lambda: block(True)}, repeats)
        atexit.unregister(provider.shutdown)  # at exit it would wait for the stuck exporter
    return median(times, "plain", "s"), median(times, "traced", "s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    for kind in KINDS:
        plain, traced = save_ratio(kind, args.repeats)
        print(f"save 64 MiB, OTLP endpoint {kind}: plain {plain * 1e3:.1f} ms, traced {traced * 1e3:.1f} ms, "
              f"ratio {traced / plain:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
