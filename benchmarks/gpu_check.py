"""dcp-otel on a GPU: CUDA state dicts through DCP over NCCL and gloo, plain vs instrumented (scripts/gpu-check.sh).

Usage::

    python benchmarks/gpu_check.py [--gib 2] [--reps 3] [--dir /dev/shm/dcp-otel-gpu] [--cpu]

Prints, for a state dict of ``--gib`` GiB of bf16 tensors on ``cuda:0``:

* the span names of ``dcp.save``, ``dcp.load``, ``dcp.async_save`` (pinned staging) and the process-based
  async save, in a world of one whose CUDA backend is NCCL (``cpu:gloo,cuda:nccl``), and whether they
  are the same as the same calls on CPU tensors; then for 2 gloo ranks sharing the GPU: their span names
  and whether both ranks are in one trace per checkpoint;
* the device-to-host staging of the async save: bytes, seconds (the staging span), GB/s;
* device synchronisations during a save and an async save, plain and instrumented (torch's
  ``set_sync_debug_mode("warn")`` warns once per synchronising call): dcp-otel must add none;
* save time, async_save time-to-return and load time, plain and instrumented, interleaved, medians
  and their ratios.

``--cpu`` runs the same on CPU tensors with gloo only (the CPU-independent parts: what the test suite
runs here). Checkpoints go to ``--dir`` (RAM by default: the figures are about the GPU and the
caller, not a disk) and are removed after each call.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dcp_otel  # noqa: E402
from dcp_otel import semconv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import Measures, interleave, median  # noqa: E402

TENSORS = 8


def state_dict(gib: float, device: str) -> dict[str, torch.Tensor]:
    per = int(gib * 2**30 / TENSORS / 2)  # bf16: 2 bytes
    return {f"layer{i}.weight": torch.full((per,), float(i), dtype=torch.bfloat16, device=device) for i in range(TENSORS)}


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


class Run:
    """One process's calls, instrumented or not, into checkpoints under ``root`` removed after each call."""

    def __init__(self, root: Path, device: str, name: str) -> None:
        self.root, self.device, self.name = root, device, name
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.count = 0

    def path(self) -> str:
        self.count += 1
        return str(self.root / f"{self.name}-{self.count}")

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def save(self, sd: dict[str, torch.Tensor]) -> float:
        path = self.path()
        self.sync()
        start = time.perf_counter()
        dcp.save(sd, checkpoint_id=path)
        took = time.perf_counter() - start
        shutil.rmtree(path, ignore_errors=True)
        return took

    def load(self, sd: dict[str, torch.Tensor], path: str) -> float:
        self.sync()
        start = time.perf_counter()
        dcp.load(sd, checkpoint_id=path)
        self.sync()
        return time.perf_counter() - start

    def async_save(self, sd: dict[str, torch.Tensor], process: bool = False) -> float:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        path = self.path()
        cuda = self.device.startswith("cuda")
        kwargs: dict[str, Any] = {}
        if process:
            kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        else:  # pinned, non-blocking staging on its own stream where there is a GPU
            kwargs["async_stager"] = DefaultStager(StagingOptions(cuda, False, cuda, cuda))
        self.sync()
        start = time.perf_counter()
        result = dcp.async_save(sd, checkpoint_id=path, **kwargs)
        took = time.perf_counter() - start
        upload = getattr(result, "upload_completion", result)
        upload.result()
        stager = kwargs.get("async_stager")
        if stager is not None:
            stager.close()
        shutil.rmtree(path, ignore_errors=True)
        return took


def span_names(exporter: InMemorySpanExporter) -> list[str]:
    return sorted({s.name for s in exporter.get_finished_spans()})


def staging(exporter: InMemorySpanExporter) -> list[tuple[float, dict[str, Any]]]:
    """Seconds and ``dcp.staging.*`` attributes of each staging: the staging future's span where staging is
    asynchronous (the step then only submits it), else the ``stage_state_dict`` step."""
    spans = exporter.get_finished_spans()
    names = {s.name for s in spans}
    name = semconv.SPAN_ASYNC_STAGING if semconv.SPAN_ASYNC_STAGING in names else "dcp.stage_state_dict"
    return [((s.end_time - s.start_time) / 1e9, {k: v for k, v in (s.attributes or {}).items() if k.startswith("dcp.staging.")})
            for s in spans if s.name == name]  # fmt: skip


def syncs(call: Callable[[], object]) -> int:
    """Synchronising CUDA calls made by ``call`` (torch warns once per call in "warn" mode)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def one_process(args: argparse.Namespace) -> None:
    cuda = not args.cpu
    device = "cuda:0" if cuda else "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}; {torch.cuda.get_device_name(0) if cuda else 'CPU'}; backend "
          f"{dist.get_backend()}; NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if cuda else '-'}")  # fmt: skip
    sd = state_dict(args.gib, device)
    size = nbytes(sd)
    print(f"state dict: {TENSORS} bf16 tensors on {device}, {size / 2**30:.2f} GiB")
    plain, traced, again = Run(root, device, "plain"), Run(root, device, "traced"), Run(root, device, "again")
    baseline_path = plain.path()
    dcp.save(sd, checkpoint_id=baseline_path)  # the checkpoint the loads read
    target = {k: torch.empty_like(v) for k, v in sd.items()}

    def arm(run: Run, instrumented: bool) -> Measures:
        if instrumented:
            dcp_otel.instrument(tracer_provider=run.provider)
        try:
            return {"save": run.save(sd), "async_save": run.async_save(sd), "load": run.load(target, baseline_path)}
        finally:
            if instrumented:
                dcp_otel.flush()
                dcp_otel.uninstrument()

    # "again": plain once more, the noise row; the first round warms up (CUDA context, pinned pool, NCCL)
    times = interleave({"plain": lambda: arm(plain, False), "traced": lambda: arm(traced, True),
                        "again": lambda: arm(again, False)}, args.reps, warm=1)  # fmt: skip
    assert all(torch.equal(target[k], sd[k]) for k in sd), "the load did not restore the state dict"
    stage = staging(traced.exporter)
    # The process-based async save (it starts a daemon process; a quarter GiB through shared memory).
    dcp_otel.instrument(tracer_provider=traced.provider)
    try:
        traced.async_save(state_dict(min(args.gib, 0.25), device), process=True)
    except Exception as exc:  # noqa: BLE001 - say it and go on: one run on a lent GPU tells as much as it can
        print(f"process-based async save FAILED: {type(exc).__name__}: {exc}")
    dcp_otel.flush()
    dcp_otel.uninstrument()
    names = span_names(traced.exporter)
    print(f"span names ({len(names)}): {', '.join(names)}")
    if stage:
        best, attributes = min(stage, key=lambda found: found[0])
        print(f"staging (device to host, pinned): {size / 2**30:.2f} GiB in {best:.3f} s (fastest of {len(stage)}): "
              f"{size / best / 1e9:.1f} GB/s")  # fmt: skip
        rate = attributes.get(semconv.ATTR_STAGING_RATE)
        print(f"  its span says: bytes {attributes.get(semconv.ATTR_STAGING_BYTES)} (state dict: {size}), device "
              f"{attributes.get(semconv.ATTR_STAGING_DEVICE)}, pinned {attributes.get(semconv.ATTR_STAGING_PINNED)}, "
              f"shared {attributes.get(semconv.ATTR_STAGING_SHARED)}, "
              f"{'-' if rate is None else f'{rate / 1e9:.1f} GB/s'}")  # fmt: skip
    if cuda:
        counted: dict[str, list[tuple[int, int]]] = {"plain": [], "traced": []}
        for arm in ("plain", "traced", "plain", "traced"):
            if arm == "traced":
                dcp_otel.instrument(tracer_provider=traced.provider)
            counted[arm].append((syncs(lambda: plain.save(sd)), syncs(lambda: plain.async_save(sd))))
            if arm == "traced":
                dcp_otel.flush()
                dcp_otel.uninstrument()
        added = max(t[i] - p[i] for p, t in zip(counted["plain"], counted["traced"], strict=True) for i in (0, 1))
        print(f"device synchronisations (save, async_save), two rounds: plain {counted['plain']}, instrumented "
              f"{counted['traced']}: {'none added' if added <= 0 else 'ADDED ' + str(added)}")  # fmt: skip
    print(f"medians over {args.reps} interleaved rounds, each arm first in turn (ratios to plain):")
    for k in ("save", "async_save", "load"):
        p, t, a = (median(times, arm, k) for arm in ("plain", "traced", "again"))
        print(f"  {k:<11} plain {p * 1000:9.1f} ms   instrumented {t * 1000:9.1f} ms ({t / p:.3f})   "
              f"plain again {a * 1000:9.1f} ms ({a / p:.3f})")  # fmt: skip
    dist.destroy_process_group()
    if cuda:  # the same calls on CPU tensors must give the same span names
        cpu = Run(root, "cpu", "cpu")
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
        dcp_otel.instrument(tracer_provider=cpu.provider)
        small = state_dict(0.01, "cpu")
        cpu.save(small)
        cpu.async_save(small)
        base = cpu.path()
        dcp.save(small, checkpoint_id=base)
        cpu.load({k: torch.empty_like(v) for k, v in small.items()}, base)
        cpu.async_save(small, process=True)
        dcp_otel.flush()
        dcp_otel.uninstrument()
        dist.destroy_process_group()
        on_cpu = span_names(cpu.exporter)
        # Expected differences, torch's not ours: CPU tensors stage synchronously (no staging future), and the
        # async save daemon started on the GPU part is reused (no second create_checkpoint_daemon_process).
        expected = {semconv.SPAN_ASYNC_STAGING, "dcp.create_checkpoint_daemon_process"}
        only_gpu, only_cpu = set(names) - set(on_cpu), set(on_cpu) - set(names)
        same = not only_cpu and only_gpu <= expected
        print(f"span names on CPU tensors: {'the same' if same else 'DIFFERENT'} (CPU lacks {sorted(only_gpu) or '-'}; "
              f"only on CPU: {sorted(only_cpu) or '-'})")  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)


def gloo_rank(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    device = "cpu" if args.cpu else "cuda:0"  # both ranks share the one GPU
    run = Run(Path(args.dir) / "gloo", device, f"rank{rank}")
    dcp_otel.instrument(tracer_provider=run.provider)
    sd = state_dict(min(args.gib, 0.5), device)
    path = str(Path(args.dir) / "gloo" / "shared")
    dcp.save(sd, checkpoint_id=path)
    dcp.load({k: torch.empty_like(v) for k, v in sd.items()}, checkpoint_id=path)
    dcp_otel.flush()
    spans = run.exporter.get_finished_spans()
    queue.put((rank, sorted({s.name for s in spans}),
               sorted({format(s.context.trace_id, "032x") for s in spans if s.name == "dcp.save"})))  # fmt: skip
    dist.barrier()
    dcp_otel.uninstrument()
    dist.destroy_process_group()


def two_gloo_ranks(args: argparse.Namespace) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=gloo_rank, args=(rank, args, 29518, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = sorted(queue.get(timeout=300) for _ in procs)
    for proc in procs:
        proc.join(60)
    (_, names0, trace0), (_, names1, trace1) = results
    print(f"2 gloo ranks sharing {'the CPU' if args.cpu else 'one GPU'}: span names on rank 0 ({len(names0)}): "
          f"{', '.join(names0)}; rank 1 exports {len(names1)} of them (detail=auto: the coordinator's collectives "
          f"are its own); one trace for the save across ranks: {trace0 == trace1}")  # fmt: skip
    shutil.rmtree(Path(args.dir) / "gloo", ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="default: /dev/shm/dcp-otel-gpu when it has room, else /tmp")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors and gloo only (no GPU needed)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (use --cpu to run the CPU-independent parts)")
    if args.dir is None:
        room = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
        args.dir = "/dev/shm/dcp-otel-gpu" if room > 4 * args.gib * 2**30 else "/tmp/dcp-otel-gpu"
    print(f"checkpoints in {args.dir}")
    warnings.simplefilter("ignore")
    started = time.monotonic()
    one_process(args)
    try:
        two_gloo_ranks(args)
    except Exception as exc:  # noqa: BLE001
        print(f"2 gloo ranks FAILED: {type(exc).__name__}: {exc}")
    print(f"gpu_check: done in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
