"""A training script that checkpoints with torch_checkpointing and knows nothing of dcp-otel (torchrun, gloo).

An async ``CheckpointManager`` (its defaults, but for ``O_DIRECT``, which ext4 refuses; see TRAPS.md) saves
``$CKPT/step-100`` and loads it back. Run it under ``opentelemetry-instrument torchrun``: whatever is traced,
the OTEL_* variables set it up.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


def main() -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    state = {"model": {"w": torch.arange(1024.0) + dist.get_rank()}, "step": 100}
    manager = CheckpointManager(CheckpointManager.Config(storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
    path = os.path.join(os.environ["CKPT"], "step-100")
    written = manager.save(path, state)
    assert written is not None
    written.result()
    dist.barrier()  # rank 0 renamed the folder onto its path
    loaded = manager.load(path, into={"model": None, "step": None})
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
