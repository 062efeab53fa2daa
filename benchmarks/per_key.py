"""What dcp-otel adds per key of a state dict: a save's per-key records, counted and timed.

    .venv/bin/python benchmarks/per_key.py [--keys 1000] [--timed-keys 10000] [--blocks 6]

torch logs two records for every top-level key of a state dict (``_stateful_to_state_dict.<key>``):
a 10,000-key save hands dcp-otel 20,000 records. One process in a gloo world of its own saves a state
dict of many small tensors to /dev/shm:

* counted: the Python bytecode the training thread runs per save (``sys.settrace``, deterministic),
  plain (``uninstrument()``'s state, torch's own logging included) and traced (``instrument(detail=
  "full")``, the builder run between saves, outside the count), for ``--keys`` keys; the difference
  per key, and as a share of the plain save's;
* timed: the training thread's CPU per save (``thread_time``) for ``--timed-keys`` keys, plain and
  traced in interleaved blocks (the builder and exporter finishing between saves, untimed); the ratio
  of the medians, and the added time per key.

What it leaves out: the builder's CPU (on its own thread: ``run_all.py``'s builder table has the
10,000-key save's), a real save's data, and peers: one process, tiny tensors, so torch's own per-key
work (hundreds of µs a key here) is nearly all of the save.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from ab import Measures, interleave, median, per_call  # noqa: E402
from fixed_cost import gloo_world_of_one  # noqa: E402
from overhead import bytecode  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

import dcp_otel  # noqa: E402


def _state(keys: int) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.zeros(4) for i in range(keys)}


def measure(keys: int = 1000, timed_keys: int = 10_000, blocks: int = 6, saves: int = 3) -> dict[str, float]:
    """``ops_plain``/``ops_traced`` (bytecode per save of ``keys`` keys), ``cpu_plain``/``cpu_traced``
    (median training-thread CPU seconds per save of ``timed_keys`` keys)."""
    warnings.simplefilter("ignore")
    registry = CollectorRegistry()
    found: dict[str, float] = {}
    with gloo_world_of_one() as (provider, exporter), tempfile.TemporaryDirectory(
            dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:  # fmt: skip
        def saver(state: dict[str, torch.Tensor]) -> Callable[[], None]:
            return lambda: dcp.save(state, checkpoint_id=os.path.join(root, "c"))

        counted = saver(_state(keys))
        for _ in range(2):
            counted()
        found["ops_plain"] = min(bytecode(counted) for _ in range(2))
        dcp_otel.instrument(tracer_provider=provider, registry=registry, detail="full")
        try:
            traced_ops = []
            for _ in range(4):  # two warm-up saves, then two counted; the builder finishes between them
                traced_ops.append(bytecode(counted))
                dcp_otel.flush(timeout_s=60)
                exporter.clear()
            found["ops_traced"] = min(traced_ops[2:])
        finally:
            dcp_otel.uninstrument()

        timed = saver(_state(timed_keys))
        timed()

        def block(traced: bool) -> list[Measures]:
            if traced:
                dcp_otel.instrument(tracer_provider=provider, registry=registry, detail="full")
            timed()  # untimed: the first save after a switch
            dcp_otel.flush(timeout_s=60)
            gc.collect()
            took = []
            for _ in range(saves):
                took.append({"cpu": per_call(timed, clock=time.thread_time)})
                dcp_otel.flush(timeout_s=60)  # untimed: the builder and the exporter finish
                exporter.clear()
            if traced:
                dcp_otel.uninstrument()
            return took

        took = interleave({"plain": lambda: block(False), "traced": lambda: block(True)}, blocks)
        found["cpu_plain"], found["cpu_traced"] = (median(took, arm, "cpu") for arm in ("plain", "traced"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1000, help="keys of the state dict whose bytecode is counted")
    parser.add_argument("--timed-keys", type=int, default=10_000, help="keys of the state dict whose saves are timed")
    parser.add_argument("--blocks", type=int, default=6, help="interleaved blocks of 3 saves per arm")
    args = parser.parse_args()
    f = measure(args.keys, args.timed_keys, args.blocks)
    added = f["ops_traced"] - f["ops_plain"]
    print(f"what dcp-otel adds per key of a state dict, 1 gloo rank (torch {torch.__version__})")
    print(f"  bytecode per save of {args.keys} keys, plain / traced   {f['ops_plain']:.0f} / {f['ops_traced']:.0f} op")
    print(f"  added per key                                  {added / args.keys:9.1f} op "
          f"({added / f['ops_plain'] * 100:.2f} % of the plain save's)")  # fmt: skip
    extra = f["cpu_traced"] - f["cpu_plain"]
    print(f"  CPU per save of {args.timed_keys} keys, plain / traced     {f['cpu_plain'] * 1e3:.1f} / "
          f"{f['cpu_traced'] * 1e3:.1f} ms   ratio {f['cpu_traced'] / f['cpu_plain']:.3f}   added "
          f"{extra / args.timed_keys * 1e6:+.2f} us per key (medians of {args.blocks * 3} saves per arm)")  # fmt: skip


if __name__ == "__main__":
    main()
