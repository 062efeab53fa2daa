"""A training script that knows nothing of dcp-otel: it only checkpoints with DCP.

A ``save``, then an ``async_save`` in torch's checkpoint daemon process. With
``$SCRAPE_TO`` set, it finally reads its own rank's metrics endpoint
(``$DCP_OTEL_METRICS_PORT`` + ``LOCAL_RANK``) into ``$SCRAPE_TO/metrics-<rank>.txt``:
test instrumentation, standing in for Prometheus.
"""

import os
import urllib.request
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    dist.init_process_group("cpu:gloo")
    dcp.save({"w": torch.ones(4)}, checkpoint_id=os.environ["CKPT"])
    if os.environ.get("ASYNC_PROCESS"):
        response = dcp.async_save({"w": torch.ones(4)}, checkpoint_id=os.environ["CKPT"] + "-async",
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS)  # fmt: skip
        getattr(response, "upload_completion", response).result(timeout=120)
    if os.environ.get("SCRAPE_TO"):
        port = int(os.environ["DCP_OTEL_METRICS_PORT"]) + int(os.environ["LOCAL_RANK"])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            text = reply.read().decode()
        with open(os.path.join(os.environ["SCRAPE_TO"], f"metrics-{os.environ['RANK']}.txt"), "w") as out:
            out.write(text)
    dist.destroy_process_group()
