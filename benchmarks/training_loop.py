"""What dcp-otel costs a training loop that async-saves with torch's defaults: steps, time-to-return, the whole loop.

The job a user runs: a model that keeps the CPU busy for tens of milliseconds
per step (one thread, matmuls and an optimizer step), ``dcp.async_save`` every
``--every`` steps with torch's default stager (no stager passed: torch makes a
fresh ``DefaultStager`` each save, staging into newly allocated memory), the
previous upload awaited before the next save (torchtitan's pattern), in a gloo
world of one. Plain and instrumented (``dcp_otel.instrument()`` with an SDK
tracer provider whose batch processor discards, and prometheus-client metrics)
run as fresh processes, interleaved, with a second plain arm for the noise row
(``benchmarks/ab.py``). Per case it prints the medians and ratios of:

- ``step_around_ms``: a training step while an upload runs beside it;
- ``step_quiet_ms``: a step with no checkpoint work beside it;
- ``return_ms``: ``async_save``'s time to return (the staging copy), the first save left out;
- ``loop_s``: the whole loop, everything the user waits for.

Goals: steps around a checkpoint within 1% of plain, time-to-return within 3%.

Usage::

    .venv/bin/python benchmarks/training_loop.py            # 3 rounds; 10, 100 and 10,000 tensors
    .venv/bin/python benchmarks/training_loop.py --quick    # 2 rounds; 10 and 10,000 tensors, fewer steps
    .venv/bin/python benchmarks/training_loop.py --in-process --rounds 9   # each round one process, arms as its blocks
    python benchmarks/training_loop.py --device cuda --dim 4096 --reps 20 --rounds 6   # scripts/gpu-check.sh's
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab import Arm, noise, ratio_rows, rounds_to_resolve, run_blocks, run_rounds  # noqa: E402

#: The training step (``dim``, ``reps`` and ``device`` set before it): ``reps`` matmuls, a backward, an optimizer step.
STEP = r"""
model, a = torch.nn.Linear(dim, dim, device=device), torch.randn(dim, dim, device=device) / dim ** 0.5
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
def step():
    x = a
    for _ in range(reps):
        x = torch.tanh(x @ a)
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    if device == "cuda":
        torch.cuda.synchronize()  # (the step's time is the device's too; both arms alike)
"""

JOB = r"""
import json, os, shutil, statistics, sys, tempfile, time, warnings
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")
mode, (tensors, mb, steps, every, reps, dim), device = sys.argv[1], map(int, sys.argv[2:8]), sys.argv[8]
torch.set_num_threads(1)
provider = None
if mode != "0":
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    class Discard(SpanExporter):
        def export(self, spans): return SpanExportResult.SUCCESS
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    import dcp_otel
folder = tempfile.mkdtemp(prefix="dcp-otel-bench-")
backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
if device == "cuda":
    torch.cuda.set_device(0)
dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=0, world_size=1)
per = mb * 1024 * 1024 // 4 // tensors
state = {f"t{i}": torch.randn(per, device=device) for i in range(tensors)}
""" + STEP + r"""ms = lambda xs: statistics.median(xs) * 1e3 if xs else float("nan")  # (no step beside an upload: said as nan)
def block(instrumented):
    if instrumented:
        dcp_otel.instrument(tracer_provider=provider)
    future, previous, around, quiet, returns = None, None, [], [], []
    started = time.perf_counter()
    for s in range(steps):
        t0 = time.perf_counter()
        step()
        took = time.perf_counter() - t0
        (around if future is not None and not future.done() else quiet).append(took)
        if s % every == every - 1:
            if future is not None:
                future.result()
                shutil.rmtree(previous, ignore_errors=True)
            previous = f"{folder}/{s}-{time.monotonic_ns()}"
            t1 = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=previous)
            returns.append(time.perf_counter() - t1)
    future.result()
    loop_s = time.perf_counter() - started
    shutil.rmtree(previous, ignore_errors=True)
    if instrumented:
        dcp_otel.flush(timeout_s=60)
        dcp_otel.uninstrument()
    return {"step_around_ms": ms(around), "step_quiet_ms": ms(quiet), "return_ms": ms(returns[1:]), "loop_s": loop_s}
if mode in ("0", "1"):  # one arm, this whole process
    out = block(mode == "1")
else:  # "alt:<order>": every arm a block of this one process, in that order (p plain, q plain again, i instrumented)
    names = {"p": "plain", "q": "plain again", "i": "instrumented"}
    out = {names[c]: block(c == "i") for c in mode.split(":")[1]}
dist.destroy_process_group()
shutil.rmtree(folder, ignore_errors=True)
print(json.dumps(out))
"""

MEASURES = ["step_around_ms", "step_quiet_ms", "return_ms", "loop_s"]
GOALS = {"step_around_ms": 1.01, "return_ms": 1.03}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, 10 and 10,000 tensors, fewer steps")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--reps", type=int, default=10, help="matmuls per step (256 x 256: about 2 ms each here)")
    parser.add_argument("--dim", type=int, default=256, help="the matmuls' size")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, pinned staging")
    parser.add_argument("--cases", default=None, help="tensors:MiB,... (default 10:64,100:256,10000:64)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--in-process", action="store_true",
                        help="every arm a block of one process a round: the same heap and caches, less noise; "
                             "the heap's state between saves is shared (what fresh processes measure is not)")
    args = parser.parse_args()
    default = "10:64,10000:64" if args.quick else "10:64,100:256,10000:64"
    cases = [(int(t), int(m)) for t, m in (c.split(":") for c in (args.cases or default).split(","))]
    steps, every = args.steps or (60 if args.quick else 120), args.every
    rounds = args.rounds or (2 if args.quick else 3)
    print(f"training loop on {args.device}: {steps} steps, async_save every {every} (torch's default stager), "
          f"{rounds} rounds, {'arms as blocks of one process' if args.in_process else 'interleaved fresh processes'}; "
          "ratio = median over rounds of arm / plain in the same round")
    print(f"{'case':<22}{'arm':<14}{'measure':<16}{'arm':>10}{'plain':>10}{'ratio':>8}  goal")
    for tensors, mb in cases:
        common = [str(tensors), str(mb), str(steps), str(every), str(args.reps), str(args.dim), args.device]
        if args.in_process:  # one process a round, every arm a block of it (the order rotating)
            results = run_blocks(JOB, "pqi", lambda order, _, common=common: [f"alt:{order}", *common], rounds)
        else:
            arms = [Arm("plain", ["0", *common]), Arm("plain again", ["0", *common]), Arm("instrumented", ["1", *common])]
            results = run_rounds(JOB, arms, rounds)
        case = f"{tensors} tensors, {mb} MiB"
        for arm, measure, mine, theirs, r in ratio_rows(results, "plain", MEASURES):
            goal = GOALS.get(measure)
            verdict = "" if goal is None or arm != "instrumented" else f"<= {goal:.2f} {'met' if r <= goal else 'MISSED'}"
            print(f"{case:<22}{arm:<14}{measure:<16}{mine:>10.2f}{theirs:>10.2f}{r:>8.3f}  {verdict}")
        worst = max(noise(results, "plain", "plain again", m) for m in GOALS)
        print(f"{case:<22}noise: plain again strays {worst:.3f} at most; rounds to resolve 1%: {rounds_to_resolve(worst)}")


if __name__ == "__main__":
    main()
