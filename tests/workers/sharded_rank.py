"""One rank of a sharded training job checkpointed as torchtitan does (gloo on CPU).

A small model sharded with FSDP2 (``fully_shard``: its parameters are DTensors
over a 1-D device mesh of all ranks) and an Adam optimizer, saved and loaded
through ``get_state_dict`` / ``set_state_dict`` inside a ``Stateful``.

* ``--phase save``: one training step, then ``dcp.save`` (instrumented);
* ``--phase load``: a model of another seed on however many ranks this job has
  (resharding), loaded twice: uninstrumented, then instrumented.

Spans go to ``DIR/spans-R.jsonl``; ``DIR/result-R.json`` holds the full
parameters after each step (gathered from the shards), the byte counters, the
bytes DCP's own reader planned to read, and diagnostics.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from prometheus_client import CollectorRegistry
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dcp_otel
from tests.workers import file_provider, finish_rank, rank_parser


class AppState(Stateful):
    """The model and optimizer as one checkpointable object (torchtitan's pattern)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optim)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])  # fmt: skip


class PlannedReader(dcp.FileSystemReader):
    """DCP's own reader, noting the bytes of the storage items this rank's plan reads."""

    planned = 0

    def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
        PlannedReader.planned += sum(self.storage_data[item.storage_index].length for item in plan.items)
        return super().read_data(plan, planner)


def sharded_model(seed: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def full_parameters(model: torch.nn.Module) -> dict[str, list[float]]:
    """Every parameter gathered from its shards (a collective: outside any checkpoint)."""
    return {name: p.full_tensor().flatten().tolist() for name, p in model.named_parameters()}  # type: ignore[operator]


def main() -> None:
    parser = rank_parser()
    parser.add_argument("--phase", choices=["save", "load"], required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rank, world = args.rank, args.world
    provider, spans_file = file_provider(args.out, rank, "dcp-otel-sharded")
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
    registry = CollectorRegistry()
    path = os.path.join(args.ckpt, "sharded")
    result: dict[str, Any] = {}
    if args.phase == "save":
        model, optim = sharded_model(0, world)
        model(torch.randn(4, 16)).sum().backward()
        optim.step()
        result["saved"] = full_parameters(model)
        dcp_otel.instrument(tracer_provider=provider, registry=registry)
        result["returned"] = type(dcp.save({"app": AppState(model, optim)}, checkpoint_id=path)).__name__
    else:
        plain, plain_optim = sharded_model(1, world)
        dcp.load({"app": AppState(plain, plain_optim)}, storage_reader=PlannedReader(path))
        result["loaded_plain"] = full_parameters(plain)
        PlannedReader.planned = 0
        model, optim = sharded_model(1, world)
        dcp_otel.instrument(tracer_provider=provider, registry=registry)
        result["returned"] = repr(dcp.load({"app": AppState(model, optim)}, storage_reader=PlannedReader(path)))
        result["loaded"] = full_parameters(model)
        result["planned_read_bytes"] = PlannedReader.planned
        result["optimizer_steps"] = [float(s["step"]) for s in optim.state.values()]
    assert dcp_otel.flush(timeout_s=60, tracer_provider=provider)
    labels = {"rank": str(rank)}
    result["written_bytes"] = registry.get_sample_value("dcp_written_bytes_total", labels)
    result["read_bytes"] = registry.get_sample_value("dcp_read_bytes_total", labels)
    result["state_dict_steps"] = {
        name: registry.get_sample_value("dcp_step_duration_seconds_count",
                                        {"operation": "save" if args.phase == "save" else "load", "step": name, **labels})
        for name in ("get_state_dict", "set_state_dict", "_get_model_state_dict", "_load_optim_state_dict")
    }  # fmt: skip
    result["diagnostics"] = dcp_otel.diagnostics()
    finish_rank(provider, spans_file, args.out, rank, result)


if __name__ == "__main__":
    main()
