"""A training script under ``opentelemetry-instrument dcp-otel-run``, metrics pushed over OTLP.

It trains and checkpoints as users do (a save, a load, an async save in torch's
checkpoint daemon process with optimizer steps around it, and a save that fails on every rank) and reports to torchelastic's metrics API through
``OTelMetricHandler``: a timed phase (``@prof``), a counted event, and one
value that is not a number (dropped and counted). It writes
``$OUT_DIR/rank-<rank>.json``: what each call returned, and whether any
checkpoint metric reached prometheus-client (it must not, with
``DCP_OTEL_METRICS=opentelemetry``). Then it simply exits: the last metrics
leave with dcp-otel's exit flush.
"""

import json
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from prometheus_client import REGISTRY
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.elastic import metrics

from dcp_otel import OTelMetricHandler

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    dist.init_process_group("cpu:gloo")
    rank = dist.get_rank()
    metrics.configure(OTelMetricHandler(), group="trainer")
    ckpt = os.environ["CKPT"]
    own = f"rank{rank}"  # a key of its own, so every rank writes and reads bytes

    def state(value: float) -> dict[str, torch.Tensor]:
        return {"w": torch.full((256,), value), own: torch.full((64,), value + rank)}

    @metrics.prof(group="trainer")
    def checkpoint() -> object:
        return dcp.save(state(7.0), checkpoint_id=ckpt)

    saved = checkpoint()
    metrics.put_metric("checkpoints", 1, "trainer")
    metrics.put_metric("bad_value", float("nan"), "trainer")
    loaded = state(0.0)
    dcp.load(loaded, checkpoint_id=ckpt)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    for _ in range(8):  # training steps, told by torch's optimizer hook: the async save's are measured against them
        optimizer.step()
    response = dcp.async_save(state(1.0), checkpoint_id=ckpt + "-async",
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)  # fmt: skip
    optimizer.step()  # the step it was called in ends beside its upload
    uploaded = getattr(response, "upload_completion", response).result(timeout=120)
    optimizer.step()
    # A save that fails on every rank, each on its own (its folder is a file): counted where it started.
    if rank == 0:
        with open(ckpt + "-a-file", "w") as blocker:
            blocker.write("not a folder")
    dist.barrier()
    try:
        dcp.save(state(2.0), checkpoint_id=ckpt + "-a-file/c")
    except BaseException:  # noqa: BLE001, S110 - torch's CheckpointException, on every rank: expected
        pass
    result = {
        "saved": type(saved).__name__,
        "uploaded": type(uploaded).__name__,
        "loaded_ok": all(torch.equal(loaded[k], v) for k, v in state(7.0).items()),
        "prometheus_client": [m.name for m in REGISTRY.collect() if m.name.startswith(("dcp_", "torchelastic_"))],
    }
    with open(os.path.join(os.environ["OUT_DIR"], f"rank-{rank}.json"), "w") as out:
        json.dump(result, out)
    dist.destroy_process_group()
