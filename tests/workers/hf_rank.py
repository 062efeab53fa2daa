"""One rank of a job saving Hugging Face safetensors with DCP (gloo on CPU).

A state dict with a DTensor sharded over the ranks and a replicated tensor:

1. saved with ``HuggingFaceStorageWriter(save_distributed=True,
   enable_consolidation=True)``: each rank writes its shards, and the coordinator
   merges them into ``hf-out/`` in ``finish``;
2. saved again without consolidation, then merged by every rank with
   ``consolidate_safetensors_files_on_every_rank`` into ``hf2-out/``, as a
   script does after training.

Spans go to ``DIR/spans-R.jsonl``; ``DIR/result-R.json`` has what each call
returned, the byte counters and the tensor bytes of the state dict.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from prometheus_client import CollectorRegistry
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint import _consolidate_hf_safetensors as consolidation
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dcp_otel
from tests.workers import file_provider, finish_rank, rank_parser

#: The full tensors; ``weight`` is sharded by rows, ``bias`` replicated.
WEIGHT = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
BIAS = torch.ones(16)


def main() -> None:
    args = rank_parser().parse_args()
    warnings.simplefilter("ignore")
    rank, world = args.rank, args.world
    provider, spans_file = file_provider(args.out, rank, "dcp-otel-hf")
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = {"weight": distribute_tensor(WEIGHT, mesh, [Shard(0)]), "bias": BIAS.clone()}
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=provider, registry=registry)
    result: dict[str, Any] = {"tensor_bytes": (WEIGHT.numel() + BIAS.numel()) * 4}

    out = os.path.join(args.ckpt, "hf-out")
    os.makedirs(out, exist_ok=True)
    writer = HuggingFaceStorageWriter(path=os.path.join(args.ckpt, "hf"), save_distributed=True,
                                      enable_consolidation=True)  # fmt: skip
    writer.consolidated_output_path = out
    result["saved"] = type(dcp.save(state, storage_writer=writer)).__name__
    result["written_bytes"] = registry.get_sample_value("dcp_written_bytes_total", {"rank": str(rank)})

    path2, out2 = os.path.join(args.ckpt, "hf2"), os.path.join(args.ckpt, "hf2-out")
    os.makedirs(out2, exist_ok=True)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(path=path2, save_distributed=True))
    dist.barrier()  # every rank's shards are written before any rank reads them
    # Through the module, as dcp-otel wraps it (a name imported before instrument() keeps torch's function).
    mapping = {"weight": 1, "bias": 1}
    result["consolidated"] = repr(consolidation.consolidate_safetensors_files_on_every_rank(path2, out2, mapping))
    assert dcp_otel.flush(timeout_s=60, tracer_provider=provider)
    result["diagnostics"] = dcp_otel.diagnostics()
    finish_rank(provider, spans_file, args.out, rank, result)


if __name__ == "__main__":
    main()
