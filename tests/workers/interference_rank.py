"""One rank of a training loop whose async save's upload slows its steps, or does not (gloo on CPU).

Each step is a fixed amount of Python work (it holds the interpreter lock, as a
training loop's Python does between kernels), a wait as long as a GPU step's
kernels (the training thread waits them out) and an optimizer step: dcp-otel
sees the steps through torch's optimizer hook, with no change to this loop.
After ``BASELINE`` steps the rank calls ``async_save`` with a storage writer
whose ``write_data`` first spends ``UPLOAD_S`` seconds, on the upload thread of
this process:

- ``--mode burn``: spinning in Python, so it takes the interpreter lock from the
  training thread, as a pickling or hashing storage plugin does;
- ``--mode quiet``: sleeping (slow storage that releases the lock).

The loop keeps stepping until the upload is durable, and ``AFTER`` steps more.
``--plain``: the same loop without dcp-otel. Spans go to ``out/traces``; the
metrics endpoint, its discovery file and the final scrape come from the
environment the test sets. ``out/result-<rank>.json`` holds what the job did:
the future's result, the steps taken, the checkpoint's files.
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from tests.workers import rank_parser

BASELINE, AFTER, UPLOAD_S, WORK, DEVICE_S = 24, 4, 2.0, 300_000, 0.02


class SlowUpload(dcp.FileSystemWriter):
    """A storage writer whose upload first burns the interpreter lock, or sleeps, for UPLOAD_S seconds."""

    def __init__(self, path: str, burn: bool) -> None:
        super().__init__(path)
        self.burn = burn

    def write_data(self, plan: Any, planner: Any) -> Any:
        started = time.monotonic()
        if self.burn:
            while time.monotonic() - started < UPLOAD_S:
                sum(range(2000))  # Python bytecode: the interpreter lock, taken from the training thread
        else:
            time.sleep(UPLOAD_S)  # slow storage: the lock released
        return super().write_data(plan, planner)


def main() -> None:
    parser = rank_parser()
    parser.add_argument("--mode", choices=("burn", "quiet"), required=True)
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world)
    provider = None
    if not args.plain:
        import dcp_otel
        from dcp_otel.otlp_file import OTLPJsonFileExporter

        (args.out / "traces").mkdir(parents=True, exist_ok=True)
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(args.out / "traces" / f"rank-{args.rank}.jsonl")))
        dcp_otel.instrument(tracer_provider=provider)
    torch.manual_seed(args.rank)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    took: list[float] = []

    def step() -> None:
        started = time.perf_counter()
        total = 0
        for i in range(WORK):  # the step's own work on this thread: a fixed amount of Python (~10 ms)
            total += i
        time.sleep(DEVICE_S)  # (not a synchronisation: the step's device time, which the training thread waits out)
        model(torch.ones(1, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        took.append(time.perf_counter() - started)

    for _ in range(BASELINE):
        step()
    path = args.ckpt / f"step-{BASELINE}"
    future = dcp.async_save({"model": model.state_dict()}, storage_writer=SlowUpload(str(path), args.mode == "burn"))
    during = 0
    while not future.done():
        step()
        during += 1
    for _ in range(AFTER):
        step()
    result = future.result()
    files = {p.name: p.read_bytes().hex() for p in sorted(path.iterdir()) if p.name != ".metadata"}
    out: dict[str, Any] = {"result": repr(result), "during": during, "files": files,
                           "took_ms": [round(t * 1e3, 2) for t in took]}  # (what a failed assertion shows)
    if provider is not None:
        import dcp_otel

        assert dcp_otel.flush(timeout_s=60)  # (instrumented to the end: the endpoint's final scrape is at exit)
    dist.destroy_process_group()
    (args.out / f"result-{args.rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
