"""One rank of a small training job that feeds the real Prometheus of tests/stack.py.

Run by ``dcp-otel-run --max-restarts 1`` (so the torchelastic agent has a
restart to report: every worker of the first attempt exits with an error). Each
rank trains a small model and checkpoints through every kind of operation
Grafana shows: ``save``, ``async_save``, ``load``, and a ``save`` that fails on
``$STACK_FAIL_RANK``; ``$STACK_SLOW_RANK`` writes and reads slowly (a
straggler). After each operation the rank waits until Prometheus has scraped
it twice (the second scrape starts only once the first is stored), so every
operation lands in its own scrape. Last, an ``async_save`` that does not finish
while the test looks: its write on ``$STACK_SLOW_RANK`` waits for the test's
"exit" (a hung storage mount, as Grafana's "where each rank is now" shows it); the
job runs with ``DCP_OTEL_STALL_AFTER_S=2``, and each rank waits until its watchdog
has reported the stall. Then it tells the test through a TCPStore and waits for
the test's "exit", after which the last upload completes.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    sys.exit(3)  # the first attempt fails: the agent restarts the workers

import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from torch.distributed.elastic import metrics

import dcp_otel
from dcp_otel import OTelMetricHandler, semconv

RANK = int(os.environ.get("RANK", "0"))
SLOW_RANK = int(os.environ["STACK_SLOW_RANK"])
FAIL_RANK = int(os.environ["STACK_FAIL_RANK"])
SLOW_S = 0.3  # the straggler's extra time in write_data and read_data
SCRAPE_TIMEOUT_S = 120.0
PLAN = ["save", "async_save", "load", "failing_save", "save", "async_save", "load"]


class Writer(dcp.FileSystemWriter):
    """The job's storage: slow on the straggler, out of space on the failing rank when asked, hung on the
    straggler until the test's "exit" when asked."""

    full = False
    hung = False

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if RANK == SLOW_RANK:
            time.sleep(SLOW_S)
            if Writer.hung:
                _store().wait(["exit"])
        if Writer.full and RANK == FAIL_RANK:
            raise OSError(28, "No space left on device")
        return super().write_data(plan, planner)


class Reader(dcp.FileSystemReader):
    def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if RANK == SLOW_RANK:
            time.sleep(SLOW_S)
        return super().read_data(plan, planner)


@metrics.prof(group="trainer")
def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> float:
    loss = model(torch.randn(16, 64)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    metrics.put_metric("steps", 1, "trainer")
    return float(loss)


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", int(os.environ["STACK_STORE_PORT"]), is_master=False,
                         timeout=timedelta(seconds=300))  # fmt: skip


def stalls() -> float:
    """This rank's stall reports so far (from the registry its endpoint serves)."""
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() if m.name == semconv.METRIC_STALLS for s in m.samples
               if s.name.endswith("_total"))  # fmt: skip


def checkpoint(kind: str, model: torch.nn.Module, path: str, optim: torch.optim.Optimizer) -> None:
    state = {"model": model.state_dict()}
    if kind == "load":
        dcp.load(state, storage_reader=Reader(path))
    elif kind == "async_save":
        future = dcp.async_save(state, storage_writer=Writer(path))
        for _ in range(2):  # training goes on beside the upload: the steps it overlapped, and what they lost
            train_step(model, optim)
        future.result(timeout=SCRAPE_TIMEOUT_S)
        train_step(model, optim)  # (the step the upload ended in has ended: measured before the flush below)
    elif kind == "failing_save":
        Writer.full = True
        try:
            dcp.save(state, storage_writer=Writer(path + "-full"))
        except BaseException:  # noqa: BLE001 - torch's CheckpointException, on every rank: expected
            pass
        finally:
            Writer.full = False
    else:
        dcp.save(state, storage_writer=Writer(path))


def main() -> None:
    warnings.simplefilter("ignore")
    dcp_otel.instrument(tracer_provider=TracerProvider())  # recorded spans: exemplars carry their trace ids
    # Address and file_sd folder from DCP_OTEL_* variables; the port is ours to keep (not
    # DCP_OTEL_METRICS_PORT, with which instrument() would serve on it first).
    endpoint = dcp_otel.start_metrics_server(int(os.environ["STACK_METRICS_PORT"]))
    assert endpoint is not None
    metrics.configure(OTelMetricHandler(), group="trainer")
    metrics.put_metric("loss", float("nan"), "trainer")  # a bad value: dropped and counted
    store = _store()
    dist.init_process_group("cpu:gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    path = os.path.join(os.environ["STACK_CKPT"], "step")
    for kind in PLAN:
        for _ in range(3):
            train_step(model, optim)
        checkpoint(kind, model, path, optim)
        dcp_otel.flush(timeout_s=SCRAPE_TIMEOUT_S)  # an async save's upload metrics are in before the scrape
        for _ in range(2):
            if not endpoint.wait_for_scrape(SCRAPE_TIMEOUT_S):
                raise SystemExit(f"rank {RANK}: Prometheus never scraped {endpoint.url}")
    # The checkpoint that does not finish while the test looks (the slow rank's write waits for "exit").
    Writer.hung = True
    unfinished = dcp.async_save({"model": model.state_dict()}, storage_writer=Writer(path + "-last"))
    while not stalls():  # the watchdog reports it (DCP_OTEL_STALL_AFTER_S=2), and its series are served
        if not endpoint.wait_for_scrape(SCRAPE_TIMEOUT_S):
            raise SystemExit(f"rank {RANK}: Prometheus never scraped {endpoint.url}")
    for _ in range(2):
        endpoint.wait_for_scrape(SCRAPE_TIMEOUT_S)
    store.set(f"scraped/{RANK}", "1")
    store.wait(["exit"])
    unfinished.result(timeout=SCRAPE_TIMEOUT_S)
    dist.destroy_process_group()
    endpoint.close()


if __name__ == "__main__":
    main()
