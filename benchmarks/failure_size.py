"""What a mass failure costs: the caller's time and the exported span, at 1,024 and 4,096 failed ranks.

torch's ``CheckpointException`` holds every failed rank's traceback. torch's
own logging decorator formats it once (``f"{error}"``), instrumented or not;
this measures what dcp-otel adds on the training thread to record the failure,
and the size of the operation span it exports (OTLP protobuf), side by side
with torch's own formatting and the whole text.

Usage::

    .venv/bin/python benchmarks/failure_size.py
"""

from __future__ import annotations

import errno
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.logger import _dcp_method_logger  # noqa: E402

import dcp_otel  # noqa: E402


def checkpoint_exception(ranks: int) -> CheckpointException:
    """As torch's coordinator builds it: each rank's exception and its stack (a realistic depth)."""
    failures = {}
    for rank in range(ranks):
        try:
            raise OSError(errno.EIO, f"I/O error writing shard {rank}")
        except OSError as exc:
            failures[rank] = (exc, traceback.extract_stack()[-24:] + traceback.extract_tb(exc.__traceback__))
    return CheckpointException("write", failures)


def raise_in_save(error: BaseException) -> float:
    """Seconds a DCP-logged call that raises ``error`` takes, on the caller's thread."""

    @_dcp_method_logger(log_exceptions=True)
    def save() -> None:
        raise error

    t0 = time.perf_counter()
    try:
        save()
    except CheckpointException:
        pass
    return time.perf_counter() - t0


def main() -> None:
    os.environ.setdefault("RANK", "3")
    print(f"{'failed ranks':>12}  {'whole text':>11}  {'torch alone':>11}  {'traced':>9}  {'added':>9}  {'span (OTLP)':>11}")
    for ranks in (1024, 4096):
        error = checkpoint_exception(ranks)
        text = len(str(error))
        plain = min(raise_in_save(error) for _ in range(3))
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        traced = []
        for _ in range(3):
            dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
            try:
                traced.append(raise_in_save(error))
                dcp_otel.flush()
            finally:
                dcp_otel.uninstrument()
        span = next(s for s in exporter.get_finished_spans() if s.name == "dcp.save")
        size = len(encode_spans([span]).SerializeToString())
        print(f"{ranks:>12}  {text / 1e6:>9.2f}MB  {plain * 1e3:>9.1f}ms  {min(traced) * 1e3:>7.1f}ms  "
              f"{(min(traced) - plain) * 1e3:>7.1f}ms  {size / 1024:>9.1f}KB")  # fmt: skip


if __name__ == "__main__":
    main()
