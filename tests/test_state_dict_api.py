"""torch's state-dict API as spans: a sharded model checkpointed as torchtitan does, and resharded loads.

FSDP2 shards a small model over 2 real gloo ranks; ``get_state_dict`` /
``set_state_dict`` run inside a ``Stateful`` that ``dcp.save`` and ``dcp.load``
call. The checkpoint is then loaded on 1 and on 4 ranks. Each checkpoint must be
one trace across its ranks with the state-dict calls as its steps, the bytes
must be what DCP wrote and read, and the loaded model must be what was saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import wrapt
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

import dcp_otel
from tests.ranks import Job, run_ranks
from tests.spans_io import SpanRecord, by_trace, from_readable, load_spans, named


def results(job: Job) -> list[dict[str, Any]]:
    return [json.loads((job.out / f"result-{rank}.json").read_text()) for rank in range(job.world)]


def spans_of(job: Job) -> list[SpanRecord]:
    return load_spans(sorted(job.out.glob("spans-*.jsonl")))


def children(spans: list[SpanRecord], parent: SpanRecord) -> list[str]:
    return sorted(s.name for s in spans if s.parent_id == parent.span_id)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The 2-rank sharded save every test here loads from (one job for the module: real ranks cost seconds)."""
    tmp = tmp_path_factory.mktemp("sharded-save")
    return run_ranks("sharded_rank", 2, tmp, extra_args=["--phase", "save"], env={"DCP_OTEL_RUN_ID": "sharded"},
                     timeout_s=240)  # fmt: skip


def test_a_sharded_save_is_one_trace_with_the_state_dict_calls_as_its_steps(saved: Job) -> None:
    spans, found = spans_of(saved), results(saved)
    assert [r["returned"] for r in found] == ["Metadata", "Metadata"]
    saves = named(spans, "dcp.save")
    assert sorted(s.attributes["dcp.rank"] for s in saves) == [0, 1]
    (trace,) = by_trace(spans).values()  # one checkpoint, one trace, both ranks
    assert [s.name for s in trace].count("dcp.checkpoint") == 1
    for rank in (0, 1):
        mine = [s for s in trace if s.attributes.get("dcp.rank") == rank]
        (conversion,) = named(mine, "dcp._stateful_to_state_dict")
        (state_dict,) = named(mine, "dcp.get_state_dict")
        assert state_dict.parent_id == conversion.span_id  # called by the Stateful, inside the save
        assert children(mine, state_dict) == ["dcp._get_model_state_dict", "dcp._get_optim_state_dict"]
        assert state_dict.attributes["dcp.operation"] == "save"
        assert conversion.start_ns <= state_dict.start_ns <= state_dict.end_ns <= conversion.end_ns
        assert found[rank]["state_dict_steps"]["get_state_dict"] == 1  # on the step histogram
        assert found[rank]["state_dict_steps"]["_get_model_state_dict"] == 1
    # The bytes are DCP's own: the data files it wrote, on the metric and on each rank's operation span.
    data = sum(f.stat().st_size for f in (saved.ckpt / "sharded").glob("*.distcp"))
    assert sum(r["written_bytes"] for r in found) == data
    for save in saves:
        assert save.attributes["dcp.written_bytes"] == found[save.attributes["dcp.rank"]]["written_bytes"] > 0
    assert all(r["diagnostics"] == {"open_spans": 0} for r in found)


@pytest.mark.parametrize("world", [1, 4])
def test_a_resharded_load_is_one_trace_reads_what_dcp_planned_and_restores_the_model(
    saved: Job, tmp_path: Path, world: int
) -> None:
    job = run_ranks("sharded_rank", world, tmp_path, extra_args=["--phase", "load"], ckpt=saved.ckpt,
                    env={"DCP_OTEL_RUN_ID": f"resharded-{world}"}, timeout_s=240)  # fmt: skip
    spans, found, before = spans_of(job), results(job), results(saved)[0]["saved"]
    for r in found:
        # Observability changes nothing: the instrumented load returns and restores what the plain one does,
        # which is what was saved on 2 ranks, and the optimizer's state (one Adam step).
        assert r["returned"] == "None"
        assert r["loaded"] == r["loaded_plain"] == before
        assert r["optimizer_steps"] == [1.0] * 4
        assert r["read_bytes"] == r["planned_read_bytes"] > 0  # the bytes of the items DCP's reader read
        assert r["diagnostics"] == {"open_spans": 0}
    if world == 1:  # one rank reads every byte that was written
        assert found[0]["read_bytes"] == sum(f.stat().st_size for f in (saved.ckpt / "sharded").glob("*.distcp"))
    loads = named(spans, "dcp.load")
    assert sorted(s.attributes["dcp.rank"] for s in loads) == list(range(world))
    (trace,) = by_trace(spans).values()
    assert [s.name for s in trace].count("dcp.checkpoint") == 1
    for load in loads:
        rank = load.attributes["dcp.rank"]
        assert load.attributes["dcp.read_bytes"] == found[rank]["read_bytes"]
        mine = [s for s in trace if s.attributes.get("dcp.rank") == rank]
        (set_call,) = named(mine, "dcp.set_state_dict")
        assert children(mine, set_call) == ["dcp._load_model_state_dict", "dcp._load_optim_state_dict"]
        assert set_call.parent_id == load.span_id and set_call.attributes["dcp.world_size"] == world
        assert found[rank]["state_dict_steps"]["set_state_dict"] == 1


# --- on its own, outside a checkpoint ---------------------------------------------------
@pytest.fixture
def spans() -> Any:
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=provider, registry=registry)
    yield provider, exporter, registry
    dcp_otel.uninstrument()
    provider.shutdown()


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    return model, optim


def test_a_state_dict_call_on_its_own_is_an_operation_linked_to_the_callers_span(spans: Any) -> None:
    provider, exporter, registry = spans
    model, optim = trained()
    with provider.get_tracer("training").start_as_current_span("train_step") as step:
        model_sd, optim_sd = get_state_dict(model, optim)
    assert set(model_sd) == {"weight", "bias"} and optim_sd["state"]  # what torch returns, untouched
    assert dcp_otel.flush(timeout_s=30)
    found = from_readable(exporter.get_finished_spans())
    (call,) = named(found, "dcp.get_state_dict")
    assert call.attributes["dcp.operation"] == "get_state_dict"
    assert children(found, call) == ["dcp._get_model_state_dict", "dcp._get_optim_state_dict"]
    assert [link["span_id"] for link in call.links] == [format(step.get_span_context().span_id, "016x")]
    assert registry.get_sample_value("dcp_operations_total",
                                     {"operation": "get_state_dict", "status": "success", "rank": "0"}) == 1  # fmt: skip


def failing_load() -> str:
    model, optim = trained()
    try:
        set_model_state_dict(model, {"weight": torch.zeros(4, 4)})  # no bias: torch's strict load refuses
    except BaseException as exc:  # noqa: BLE001 - whatever torch raises, compared as is
        return f"{type(exc).__name__}: {exc}"
    return "no exception"


def test_a_failing_state_dict_call_raises_the_same_and_its_span_is_an_error(spans: Any) -> None:
    provider, exporter, _ = spans
    dcp_otel.uninstrument()
    plain = failing_load()
    dcp_otel.instrument(tracer_provider=provider)
    assert failing_load() == plain != "no exception"
    assert dcp_otel.flush(timeout_s=30)
    found = from_readable(exporter.get_finished_spans())
    for name in ("dcp.set_model_state_dict", "dcp._load_model_state_dict"):
        (span,) = named(found, name)
        assert span.status == "ERROR", name
        (event,) = [e for e in span.events if e["name"] == "exception"]
        assert "bias" in event["attributes"]["exception.message"], span


def test_uninstrument_puts_the_state_dict_modules_helpers_back(spans: Any, tmp_path: Path) -> None:
    import torch.distributed.checkpoint.state_dict as module

    names = ("_gc_context", "_get_model_state_dict", "_get_optim_state_dict", "_load_model_state_dict",
             "_load_optim_state_dict")  # fmt: skip
    assert all(isinstance(getattr(module, name), wrapt.FunctionWrapper) for name in names)  # wrapped while instrumented
    dcp_otel.uninstrument()
    assert not any(isinstance(getattr(module, name), wrapt.FunctionWrapper) for name in names)
    model, optim = trained()
    get_state_dict(model, optim)
    set_state_dict(model, optim, model_state_dict=model.state_dict(), optim_state_dict=optim.state_dict())
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "c"))
