"""Hugging Face safetensors through DCP: sharded saves, consolidation and loads, with their spans and bytes.

Two real gloo ranks save a sharded state dict with ``HuggingFaceStorageWriter``,
consolidated by the coordinator in ``finish`` and, a second time, by every rank
with ``consolidate_safetensors_files_on_every_rank``. The consolidated files are
then loaded with ``HuggingFaceStorageReader``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from torch.distributed.checkpoint import HuggingFaceStorageReader

import dcp_otel
from tests.ranks import Job, run_ranks
from tests.spans_io import by_trace, from_readable, load_spans, named
from tests.workers.hf_rank import BIAS, WEIGHT


def safetensors_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    tmp = tmp_path_factory.mktemp("hf")
    return run_ranks("hf_rank", 2, tmp, env={"DCP_OTEL_RUN_ID": "hf"}, timeout_s=240)


def results(job: Job) -> list[dict[str, Any]]:
    return [json.loads((job.out / f"result-{rank}.json").read_text()) for rank in range(job.world)]


def test_a_consolidating_save_is_one_trace_with_the_consolidation_and_its_bytes(job: Job) -> None:
    found = results(job)
    assert [r["saved"] for r in found] == ["Metadata", "Metadata"]
    assert all(r["diagnostics"] == {"open_spans": 0} for r in found)
    # write_data's bytes: every tensor byte once (the replicated bias by one rank only), on the counter.
    assert sum(r["written_bytes"] for r in found) == found[0]["tensor_bytes"]
    spans = load_spans(sorted(job.out.glob("spans-*.jsonl")))
    first = [s for s in named(spans, "dcp.save") if "/hf/" in s.attributes["dcp.checkpoint_id"]]
    assert len(first) == 2 and all(s.attributes["dcp.storage_writer"] == "HuggingFaceStorageWriter" for s in first)
    (trace,) = [t for t in by_trace(spans).values() if first[0] in t]
    assert {s.span_id for s in first} <= {s.span_id for s in trace}  # both ranks, one trace
    (consolidation,) = named(trace, "dcp.consolidate_safetensors_files")  # in finish, on the coordinator
    (finish,) = named(trace, "dcp.finish_checkpoint")
    assert consolidation.parent_id == finish.span_id and consolidation.attributes["dcp.rank"] == 0
    assert consolidation.attributes["dcp.written_bytes"] == safetensors_bytes(job.ckpt / "hf-out") > 0
    for save in first:
        assert save.attributes["dcp.written_bytes"] == found[save.attributes["dcp.rank"]]["written_bytes"]


def test_consolidating_on_every_rank_is_an_operation_with_each_ranks_bytes(job: Job) -> None:
    found = results(job)
    assert [r["consolidated"] for r in found] == ["None", "None"]
    spans = load_spans(sorted(job.out.glob("spans-*.jsonl")))
    calls = named(spans, "dcp.consolidate_safetensors_files_on_every_rank")
    assert sorted(s.attributes["dcp.rank"] for s in calls) == [0, 1]
    assert len({s.trace_id for s in calls}) == 1  # the same call on every rank: one trace
    assert all(s.attributes["dcp.operation"] == "consolidate_safetensors_files_on_every_rank" for s in calls)
    # Both ranks wrote into the one output folder: each span has what was there when its rank finished.
    assert max(s.attributes["dcp.written_bytes"] for s in calls) == safetensors_bytes(job.ckpt / "hf2-out") > 0


def load(folder: Path) -> dict[str, torch.Tensor]:
    state = {"weight": torch.zeros_like(WEIGHT), "bias": torch.zeros_like(BIAS)}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(path=str(folder)))
    return state


def test_loading_consolidated_safetensors_counts_the_bytes_read_and_restores_the_tensors(job: Job) -> None:
    plain = load(job.ckpt / "hf-out")
    exporter, provider, registry = InMemorySpanExporter(), TracerProvider(), CollectorRegistry()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    dcp_otel.instrument(tracer_provider=provider, registry=registry)
    try:
        loaded = load(job.ckpt / "hf-out")
        assert dcp_otel.flush(timeout_s=30)
        read = registry.get_sample_value("dcp_read_bytes_total", {"rank": "0"})
    finally:
        dcp_otel.uninstrument()
    assert torch.equal(loaded["weight"], WEIGHT) and torch.equal(loaded["bias"], BIAS)
    assert all(torch.equal(loaded[k], plain[k]) for k in plain)  # the same as uninstrumented
    tensor_bytes = (WEIGHT.numel() + BIAS.numel()) * 4
    assert read == tensor_bytes  # the slices the safetensors reader reads: every element once
    (span,) = named(from_readable(exporter.get_finished_spans()), "dcp.load")
    assert span.attributes["dcp.storage_reader"] == "HuggingFaceStorageReader"
    assert span.attributes["dcp.read_bytes"] == tensor_bytes
