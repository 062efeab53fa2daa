"""A training script that knows nothing of dcp-otel: it only checkpoints with DCP."""

import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    dcp.save({"w": torch.ones(4)}, checkpoint_id=os.environ["CKPT"])
    dist.destroy_process_group()
