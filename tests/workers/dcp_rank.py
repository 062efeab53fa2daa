"""One rank of a real multi-process DCP job, for the tests (gloo on CPU).

Run as ``python dcp_rank.py --rank R --world N --store FILE --out DIR --ckpt DIR``.
It performs, in order, with spans written to ``DIR/spans-R.jsonl`` and a summary
of what the caller saw to ``DIR/result-R.json``:

1. ``save`` inside a user ``train_step`` span; 2. ``save`` to the same id again;
3. ``load``; 4. ``async_save`` and wait; 5. if ``--fail-rank`` is given, a
``save`` whose storage writer raises ENOSPC in ``write_data`` on that rank, once
uninstrumented and once instrumented, recording the exception the caller got.
"""

from __future__ import annotations

import errno
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcp_otel
from tests.workers import file_provider, finish_rank, rank_parser


class FailingWriter(dcp.FileSystemWriter):
    """A storage writer that runs out of space on one rank."""

    fail_rank = -1

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if dist.get_rank() == self.fail_rank:
            raise OSError(errno.ENOSPC, "No space left on device (injected by the test)")
        return super().write_data(plan, planner)


def describe(exc: BaseException) -> dict:
    failures = getattr(exc, "failures", {}) or {}
    return {
        "type": type(exc).__name__,
        "failure_ranks": sorted(failures),
        "failure_types": {str(r): type(f[0]).__name__ for r, f in failures.items()},
        "failure_messages": {str(r): str(f[0]) for r, f in failures.items()},
    }


def failing_save(ckpt: str, rank: int, fail_rank: int) -> dict:
    FailingWriter.fail_rank = fail_rank
    state = {"w": torch.full((64,), float(rank))}
    try:
        dcp.save(state, storage_writer=FailingWriter(ckpt))
    except BaseException as exc:  # CheckpointException derives from BaseException
        return describe(exc)
    return {"type": None}


def main() -> None:
    parser = rank_parser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rank = args.rank

    provider, spans_file = file_provider(args.out, rank, "dcp-otel-test")
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=args.world)
    result: dict = {}

    if args.fail_rank >= 0:  # the same failure without instrumentation, for comparison
        result["uninstrumented_failure"] = failing_save(os.path.join(args.ckpt, "fail-plain"), rank, args.fail_rank)

    dcp_otel.instrument(tracer_provider=provider)
    tracer = provider.get_tracer("training-script")
    state = {"model": torch.nn.Linear(8, 8), "step": torch.tensor([42])}  # replicated on all ranks
    with tracer.start_as_current_span("train_step") as user_span:
        dcp.save(state, checkpoint_id=os.path.join(args.ckpt, "a"))
        result["train_step_span_id"] = format(user_span.get_span_context().span_id, "016x")
    dcp.save(state, checkpoint_id=os.path.join(args.ckpt, "a"))
    loaded = {"model": torch.nn.Linear(8, 8), "step": torch.tensor([-1])}
    dcp.load(loaded, checkpoint_id=os.path.join(args.ckpt, "a"))
    result["loaded_step"] = int(loaded["step"].item())
    future = dcp.async_save({"w": torch.ones(16) * rank}, checkpoint_id=os.path.join(args.ckpt, "async"))
    future.result()
    result["flushed"] = dcp_otel.flush(timeout_s=60, tracer_provider=provider)
    if args.fail_rank >= 0:
        result["instrumented_failure"] = failing_save(os.path.join(args.ckpt, "fail"), rank, args.fail_rank)

    result["diagnostics"] = dcp_otel.diagnostics()
    recorder = dcp_otel.DCPInstrumentor().recorder
    result["stack_depth"] = recorder.stack_depth() if recorder else -1
    finish_rank(provider, spans_file, args.out, rank, result)


if __name__ == "__main__":
    main()
