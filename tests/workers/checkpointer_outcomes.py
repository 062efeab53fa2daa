"""What torch's ``_experimental`` checkpointer returns and raises, without and then with dcp-otel.

One process (``RankInfo(world_size=1, rank=0)``, no process group) runs the same
calls twice, into two folders: first uninstrumented, then instrumented. Each
outcome is what a call returned (normalized: a load's tensors as sums) or what
it raised (the type and the last line of the message, folder names replaced),
printed as one JSON line ``{"plain": [...], "traced": [...], "spans": [...]}``.

A failure in the checkpoint process reaches the caller as torch's
``RuntimeError`` quoting the process's traceback, whose frames include
dcp-otel's wrappers when instrumented: its last line (the error itself) is
what must match.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from concurrent.futures import Future
from typing import Any

import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch.distributed.checkpoint._experimental import (
    CheckpointerConfig,
    DefaultStager,
    RankInfo,
    make_async_checkpointer,
    make_sync_checkpointer,
)

import dcp_otel
from tests.workers.checkpointer_rank import STAGING


def normalized(value: Any, folder: str) -> Any:
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), list(value.shape), float(value.sum())]
    if isinstance(value, dict):
        return {k: normalized(v, folder) for k, v in sorted(value.items())}
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, *(normalized(v, folder) for v in value)]
    if isinstance(value, Future):
        return ["future", outcome(value.result, folder)]
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    return type(value).__name__


def outcome(call: Any, folder: str) -> Any:
    """What ``call()`` returned, or raised."""
    try:
        return {"returned": normalized(call(), folder)}
    except Exception as exc:  # noqa: BLE001 - compared by the test
        lines = [line for line in str(exc).replace(folder, "<dir>").splitlines() if line.strip()]
        return {"raised": type(exc).__name__, "error": lines[-1] if lines else ""}


def scenario(folder: str) -> list[Any]:
    rank = RankInfo(global_world_size=1, global_rank=0)
    state = {"w": torch.arange(1024, dtype=torch.float32), "b": torch.ones(3), "step": 3}
    path = lambda name: os.path.join(folder, name)  # noqa: E731
    os.makedirs(path("blocked/checkpoint_0.pt"))  # a folder where the rank's file goes: the write fails
    results = []
    sync = make_sync_checkpointer(rank_info=rank)
    results.append(outcome(lambda: sync.save(path("sync"), state), folder))
    results.append(outcome(lambda: sync.load(path("sync")), folder))
    results.append(outcome(lambda: sync.load(path("sync"), {"w": torch.zeros(1024)}), folder))
    results.append(outcome(lambda: sync.load(path("sync"), {"w": torch.zeros(1024), "gone": 1}, strict=True), folder))
    results.append(outcome(lambda: sync.load(path("missing")), folder))
    results.append(outcome(lambda: sync.save(path("blocked"), state), folder))
    sync.close()
    stager = DefaultStager(STAGING)
    results.append(outcome(lambda: stager.stage(state), folder))
    stager.close()
    checkpointer = make_async_checkpointer(CheckpointerConfig(staging_config=STAGING), rank_info=rank)
    results.append(outcome(lambda: checkpointer.save(path("async"), state), folder))
    results.append(outcome(lambda: checkpointer.load(path("async"), strict=True), folder))
    # back to back: the second waits for the first's write
    results.append(outcome(lambda: [checkpointer.save(path("a1"), state), checkpointer.save(path("a2"), state)], folder))
    results.append(outcome(lambda: checkpointer.save(path("blocked"), state), folder))  # fails in the process
    results.append(outcome(lambda: checkpointer.save(path("after"), state), folder))  # the process is gone
    results.append(outcome(checkpointer.close, folder))
    return results


def main() -> None:
    warnings.simplefilter("ignore")
    base = sys.argv[1]
    plain = scenario(os.path.join(base, "plain"))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    dcp_otel.instrument(tracer_provider=provider, metrics_port=None)
    traced = scenario(os.path.join(base, "traced"))
    assert dcp_otel.flush(timeout_s=30, tracer_provider=provider)
    spans = [[s.name, s.status.status_code.name] for s in exporter.get_finished_spans()]
    print(json.dumps({"plain": plain, "traced": traced, "spans": spans, "diagnostics": dcp_otel.diagnostics()}))


if __name__ == "__main__":
    main()
