"""Real multi-process jobs the tests run: each file is one rank (or one process) of a job.

Ranks started by :func:`tests.ranks.run_ranks` share one command line, read by
:func:`rank_parser`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import IO, Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter


def rank_parser() -> argparse.ArgumentParser:
    """``--rank --world`` (ints) and ``--store --out --ckpt`` (paths), as tests/ranks.py passes them;
    add a worker's own options to it."""
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world"):
        parser.add_argument(name, type=int, required=True)
    for name in ("--store", "--out", "--ckpt"):
        parser.add_argument(name, type=Path, required=True)
    return parser


def rss_kib() -> int:
    """This process's resident memory, in KiB (Linux)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def file_provider(out: Path, rank: int, service: str) -> tuple[TracerProvider, IO[str]]:
    """A tracer provider writing this rank's spans to ``out/spans-<rank>.jsonl`` (``tests.spans_io`` reads them)."""
    spans_file = open(os.path.join(out, f"spans-{rank}.jsonl"), "w")  # noqa: SIM115 - closed by finish_rank
    provider = TracerProvider(resource=Resource.create({"service.name": service, "test.rank": rank}))
    provider.add_span_processor(
        BatchSpanProcessor(ConsoleSpanExporter(out=spans_file, formatter=lambda s: s.to_json(indent=None) + "\n"))
    )
    return provider, spans_file


def finish_rank(provider: TracerProvider, spans_file: IO[str], out: Path, rank: int, result: dict[str, Any]) -> None:
    """Uninstrument, write every span, leave the process group, and write ``out/result-<rank>.json``."""
    import torch.distributed as dist

    import dcp_otel

    dcp_otel.uninstrument()
    provider.shutdown()
    spans_file.close()
    dist.destroy_process_group()
    with open(os.path.join(out, f"result-{rank}.json"), "w") as fh:
        json.dump(result, fh)


def write_result(out: Path, rank: int, result: dict[str, Any], provider: TracerProvider | None = None,
                 registry: Any = None) -> None:  # fmt: skip
    """Instrumented (``provider``): flush, add the rank's metrics (``registry``) and diagnostics, uninstrument,
    shut the provider down; then write ``out/result-<rank>.json``."""
    if provider is not None:
        import dcp_otel

        assert dcp_otel.flush(timeout_s=60, tracer_provider=provider)
        result["samples"] = [(s.name, s.labels, s.value) for m in registry.collect() for s in m.samples]
        result["diagnostics"] = dcp_otel.diagnostics()
        dcp_otel.uninstrument()
        provider.shutdown()
    with open(os.path.join(out, f"result-{rank}.json"), "w") as fh:
        json.dump(result, fh)
