"""One of 2 gloo workers of a torchrun job that fails and restarts, for tests/test_checkpoint_life.py.

Run by ``torchrun --nproc-per-node 2 --max-restarts 1 life_rank.py`` with ``$LIFE_OUT`` set.

- Generation 1 (``TORCHELASTIC_RESTART_COUNT=0``): trains steps 1 to 25, saving ``LIFE_OUT/ckpt/step-10`` and
  ``step-20``; at step 25 rank 1 raises. Rank 0 then fails in the step's ``all_reduce``, or torchrun stops it
  (SIGTERM: then the second generation reports its end from its record); either way the agent starts a second
  generation.
- Generation 2: loads the newest checkpoint (``step-20``) and trains on to step 30, saving ``step-30``.

Every step says its number (``dcp_otel.set_training_step``), works ``STEP_S`` (a sleep standing for the step's
compute, not synchronisation) and all-reduces a tensor, as data-parallel training does. Spans go to
``LIFE_OUT/traces/gen-<restart>-rank-<R>.jsonl``; after each checkpoint operation the rank writes its
``dcp_training_blocked_seconds_total`` (summed over operations) to ``LIFE_OUT/blocked-<restart>-<R>.json``, and its
pid to ``LIFE_OUT/pid-<restart>-<R>``.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CollectorRegistry

import dcp_otel
from dcp_otel import semconv
from dcp_otel.otlp_file import OTLPJsonFileExporter

STEP_S, SAVE_EVERY, FAIL_AT, LAST, FAILING_RANK = 0.05, 10, 25, 30, 1


def newest(ckpt: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint (one with DCP's ``.metadata``), by the step in its name."""
    found = [(int(m.group(1)), p) for p in ckpt.glob("step-*")
             if (m := re.fullmatch(r"step-(\d+)", p.name)) and (p / ".metadata").exists()]  # fmt: skip
    return max(found, default=None)


def main() -> None:
    warnings.simplefilter("ignore")
    out, restart, rank = Path(os.environ["LIFE_OUT"]), os.environ["TORCHELASTIC_RESTART_COUNT"], int(os.environ["RANK"])
    (out / "traces").mkdir(parents=True, exist_ok=True)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPJsonFileExporter(out / "traces" / f"gen-{restart}-rank-{rank}.jsonl")))
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=provider, registry=registry)
    (out / f"pid-{restart}-{rank}").write_text(str(os.getpid()))  # a survivor's dcp.process span names it
    # Keys of this generation's own: torch 2.15's agent store keeps the first generation's gloo addresses, and a
    # restarted rank that reads them fails to connect (plain torch, without dcp-otel, the same).
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=timedelta(seconds=60))  # fmt: skip
    dist.init_process_group("gloo", store=dist.PrefixStore(f"generation-{restart}", agent_store), rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=60))  # fmt: skip

    def blocked() -> None:
        total = sum(s.value for m in registry.collect() if m.name == semconv.METRIC_TRAINING_BLOCKED
                    for s in m.samples if s.name.endswith("_total"))  # fmt: skip
        (out / f"blocked-{restart}-{rank}.json").write_text(json.dumps(total))

    weights = torch.full((256,), float(rank))
    step = 0
    found = newest(out / "ckpt")
    if found is not None:
        state = {"weights": torch.zeros(256), "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=str(found[1]))
        weights, step = state["weights"], int(state["step"])
        blocked()
    while step < LAST:
        step += 1
        dcp_otel.set_training_step(step)
        time.sleep(STEP_S)  # the step's compute
        if restart == "0" and step == FAIL_AT and rank == FAILING_RANK:
            raise RuntimeError(f"rank {rank} failed at step {step}")
        grad = torch.ones(256)
        dist.all_reduce(grad)
        weights -= 0.01 * grad
        if step % SAVE_EVERY == 0:
            dcp.save({"weights": weights, "step": torch.tensor(step)}, checkpoint_id=str(out / "ckpt" / f"step-{step}"))
            blocked()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
