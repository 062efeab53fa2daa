"""The caller's bill of a real save: what dcp-otel adds to one whole ``dcp.save`` on the training thread.

    .venv/bin/python benchmarks/fixed_cost.py [--blocks 15] [--saves 40]

One process in a gloo world of its own (so DCP's collectives run, as on every rank of a job) saves a
one-tensor state dict to /dev/shm over and over. The save is nearly all fixed cost (the plan, the
collectives, the metadata) and logs what every save logs: the operation, its steps, the per-key
records (counted here, per save: 14 for this state dict), and 4 of DCP's collectives, each a span with its pickled
bytes. That is the work a user's save gives dcp-otel, whatever the model's size.

Blocks of saves alternate eight arms, and their medians are compared:

* plain (``uninstrument()``): torch alone, its own logging included, measured the same way;
* own: traced (``instrument(detail="full")``, spans to an in-memory exporter through the batch
  processor, metrics on), with the finished operations held back from the builder until the block
  ends: only what the training thread itself runs, the caches as plain's (the bill of issue 27);
* own, no record: the same, with ``DCP_OTEL_SPOOL_DIR=off``: no write-ahead record (``dcp_otel.spool``); own
  less this is what the record costs the training thread (its stores as each call starts and ends, its
  operation's JSON once);
* by hand: uninstrumented, but a bare span made for each DCP call at the same hook (torch's logger
  global), started with four attributes and made current at the call's start record, detached and
  ended at its end: what a bare span costs amid a real save, the second unit of the bill;
* design core: uninstrumented, but at the same hooks (torch's logger global, and wrappers made as
  dcp-otel makes them at the collective and pickling points it patches) only what the training thread would still do if
  all pairing moved to the builder (the design that would reach 5 bare spans; not built): each record
  appended raw to a per-thread log, a light span made current for each call's start and reset at its
  end, each collective's start, end and pickled bytes appended raw. The floor of that design, amid
  real saves (``caller_parts.py`` has it in a loop);
* trivial ops: uninstrumented, but the tap in place, its recorder's hot path replaced by a loop that
  adds to a local integer, sized so that a save runs as much added bytecode as dcp-otel's (counted
  first): what that many instructions cost amid saves when they allocate, call and touch nothing;
  beside the bill, it says whether the bill is in the count of instructions or in what they do;
* settled: traced, the builder and the exporter finishing between saves, untimed: the training thread
  then also runs on caches that the builder's work has just displaced (0.1 to 0.5 ms more per save
  here; in a job, seconds of training between two saves displace them anyway);
* back to back: the builder and the exporter of one save hold the interpreter while the next save
  runs (what a job checkpointing this often would pay).

Each save is timed as wall time and as the CPU time of the training thread (``thread_time``, which
a wait for the interpreter lock or for I/O does not count: the steadier of the two on 2 cores).

The unit of the bill is a bare SDK span timed in the same process, through the same provider, the
same way (the training thread's CPU): ``start_span`` with four attributes, made current, detached,
ended; timed in a loop of 200 (the cheapest a span gets: warm caches), and amid real saves (the "by
hand" arm). Every run of blocks that holds each arm once is a cycle; the bill is the median cycle's
(a shared 2-core machine's speed moves by 2x over minutes, and a cycle shares its moment), printed
with the lowest and highest cycle. The builder's CPU per save (its own thread, holding the
interpreter lock the training thread may want) is reported beside it, and the Python bytecode the
training thread runs per save, plain and traced, counted deterministically (``sys.settrace``): the
one figure here noise cannot move.

What it leaves out: one process has no peer to wait for, so the collectives cost their local work
only; a real save's data (its write) is what makes the fixed cost small beside it (``overhead.py``);
the exporter's network work (an in-memory exporter here; ``faults.py`` has a real endpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.distributed.checkpoint.logger as dcp_logger  # noqa: E402
from opentelemetry import context, trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

import dcp_otel  # noqa: E402
from dcp_otel.attach.logger_tap import DCPLoggerTap  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import Measures, Results, interleave, median  # noqa: E402
from hook_taps import BARE_ATTRIBUTES, BareSpansByHand, DesignCore, TrivialOps, made_by, tapped  # noqa: E402
from overhead import bytecode  # noqa: E402

ARMS = ("plain", "own", "own, no record", "by hand", "design core", "trivial ops", "settled", "back-to-back")
#: The arms held back from the builder until their block ends (the training thread's own work).
HELD = ("own", "own, no record")
#: The arms that leave dcp-otel uninstrumented (the last three put a tap of their own at its hook).
UNINSTRUMENTED = ("plain", "by hand", "design core", "trivial ops")
#: The figures given per cycle (:func:`_spread`: the median cycle's, the lowest's and the highest's).
SPREADS = ("bare_spans", "amid_spans", "core_spans", "record_spans")


def _block(saves: int, root: str, state: dict[str, torch.Tensor], settle: bool = False) -> list[Measures]:
    """Each save's ``wall`` seconds and ``cpu`` (training-thread CPU ns)."""
    took = []
    for i in range(saves):
        cpu0 = time.thread_time_ns()
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=os.path.join(root, f"c{i % 4}"))
        took.append({"wall": time.perf_counter() - start, "cpu": time.thread_time_ns() - cpu0})
        if settle:  # untimed: the builder and the exporter finish before the next save
            dcp_otel.flush(timeout_s=30)
    return took


def _bare_span_cpu_ns(tracer: trace.Tracer, spans: int = 200) -> float:
    """Training-thread CPU ns of one bare span: started with attributes, made current, detached, ended."""
    cpu0 = time.thread_time_ns()
    for _ in range(spans):
        span = tracer.start_span("dcp.write_data", attributes=BARE_ATTRIBUTES)
        token = context.attach(trace.set_span_in_context(span))
        context.detach(token)
        span.end()
    return (time.thread_time_ns() - cpu0) / spans


def _trivial_loops(save: Callable[[], None], logger: Any, ops_plain: float, ops_added: float) -> int:
    """Loops per record that make a save's added bytecode ``ops_added`` (``ops_plain``: with ``logger`` alone)."""
    counted = {}
    for loops in (0, 10):
        with tapped(TrivialOps(logger, loops)):
            counted[loops] = bytecode(save)
    per_loop = (counted[10] - counted[0]) / 10  # per save: every record loops
    return max(0, round((ops_added - (counted[0] - ops_plain)) / per_loop))


def _spread(found: dict[str, float], key: str, per_cycle: list[float]) -> None:
    """``found[key]``: the median cycle's figure; ``key_low``/``key_high``: the lowest and highest cycle's."""
    found[key] = statistics.median(per_cycle)
    found[f"{key}_low"], found[f"{key}_high"] = min(per_cycle), max(per_cycle)


def _records_per_save(save: Callable[[], None]) -> int:
    """DCP log records one save hands dcp-otel's tap (torch's logger global is the tap while instrumented)."""
    tap: Any = dcp_logger._dcp_logger
    seen = [0]

    def counting(real: Callable[..., None]) -> Callable[..., None]:
        def counted(*args: Any, **kwargs: Any) -> None:
            seen[0] += 1
            real(*args, **kwargs)

        return counted

    tap.debug, tap.error = counting(tap.debug), counting(tap.error)
    try:
        save()
    finally:
        del tap.debug, tap.error
    return seen[0]


@contextlib.contextmanager
def gloo_world_of_one(store: str | None = None) -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """torch.distributed initialized as in a job (gloo, a world of one, so DCP's collectives run), and a
    provider sending spans through a batch processor to memory; both ended on leaving. ``store``: the file of
    its ``FileStore`` (default: a new one in the temporary folder), removed on leaving."""
    store = store or tempfile.mktemp(prefix="dcp-otel-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    try:
        yield provider, exporter
    finally:
        dist.destroy_process_group()
        provider.shutdown()
        if os.path.exists(store):
            os.unlink(store)


class _Bill:
    """The arms of the bill in a gloo world of one: each a block of timed saves, set up and taken down untimed."""

    def __init__(self, provider: TracerProvider, exporter: InMemorySpanExporter, root: str, saves: int) -> None:
        self.provider, self.exporter, self.root, self.saves = provider, exporter, root, saves
        self.tracer, self.registry = provider.get_tracer("bench"), CollectorRegistry()
        self.state, self.logger = {"w": torch.zeros(16)}, dcp_logger._dcp_logger  # (torch's own logger)
        self.loops = 0  # per record, in the trivial-ops arm: sized by count()
        self.found: dict[str, float] = {"builder_ns": 0, "built": 0}
        # Each round of blocks holds every arm once (a cycle): the bill per cycle cancels the drift of a shared
        # machine (its speed moves by 2x over minutes here); the median cycle is the bill. Per arm, each block's
        # median training-thread CPU per save; "bare", the bare span's, timed after each settled block.
        self.cycles: dict[str, list[float]] = {arm: [] for arm in (*ARMS, "bare")}

    def save(self) -> None:
        dcp.save(self.state, checkpoint_id=os.path.join(self.root, "c0"))

    def instrument(self, spool: bool = True) -> None:
        with mock.patch.dict(os.environ, {} if spool else {"DCP_OTEL_SPOOL_DIR": "off"}):
            dcp_otel.instrument(tracer_provider=self.provider, registry=self.registry, detail="full")

    def count(self) -> None:
        """The bytecode first (the trivial-ops arm is sized by it), after warm saves: plain, then traced (settled
        between saves)."""
        found = self.found
        for _ in range(3):
            self.save()
        found["ops_plain"] = min(bytecode(self.save) for _ in range(3))
        self.instrument()
        for _ in range(3):
            self.save()
            dcp_otel.flush(timeout_s=30)
        found["records"] = _records_per_save(self.save)
        dcp_otel.flush(timeout_s=30)
        traced_ops = []
        for _ in range(3):
            traced_ops.append(bytecode(self.save))
            dcp_otel.flush(timeout_s=30)
        found["ops_traced"] = min(traced_ops)
        dcp_otel.uninstrument()
        self.exporter.clear()
        self.loops = _trivial_loops(self.save, self.logger, found["ops_plain"], found["ops_traced"] - found["ops_plain"])
        with tapped(TrivialOps(self.logger, self.loops)):
            found["ops_trivial"] = bytecode(self.save)

    def tap(self, arm: str) -> DCPLoggerTap | None:
        """The tap of its own that an uninstrumented arm puts at dcp-otel's hook (none for the others)."""
        if arm == "by hand":
            return BareSpansByHand(self.logger, self.tracer)
        if arm == "design core":
            return DesignCore(self.logger)
        return TrivialOps(self.logger, self.loops) if arm == "trivial ops" else None

    def block(self, arm: str) -> list[Measures]:
        """``saves`` timed saves as ``arm``, after its set-up and one untimed save; its take-down after them."""
        on = arm not in UNINSTRUMENTED
        if on:
            self.instrument(spool=arm != "own, no record")
        tap = self.tap(arm)
        with tapped(tap):
            _block(1, self.root, self.state, settle=on)  # untimed: the first save after a switch
            gc.collect()
            builder = dcp_otel.DCPInstrumentor().recorder.builder if on else None
            busy0, built0 = (builder.busy_ns, builder.built) if builder else (0, 0)
            made0 = made_by(tap)
            held: list[tuple[Any, Any]] = []
            if arm in HELD:  # the builder gets this block's operations when it ends (an instance attribute)
                builder.submit = lambda op, calls=None: held.append((op, calls))  # type: ignore[union-attr]
            took = _block(self.saves, self.root, self.state, settle=arm == "settled")
            made = (made_by(tap) - made0) / self.saves
        self.cycles[arm].append(statistics.median(t["cpu"] for t in took))
        if arm == "design core":
            self.found["core_records"] = made
        if arm == "by hand":
            self.found["spans_by_hand"] = made
            self.provider.force_flush()
        if builder is not None:
            self.take_down(arm, builder, held, busy0, built0)
        self.exporter.clear()
        return took

    def take_down(self, arm: str, builder: Any, held: list[tuple[Any, Any]], busy0: int, built0: int) -> None:
        """A traced block's end: the operations held back handed to the builder (each built once, now), all
        exported; after the settled arm's, the bare span timed."""
        if arm in HELD:
            del builder.submit
            for op, calls in held:
                builder.submit(op, calls)
        dcp_otel.flush(timeout_s=30)
        if arm in HELD and builder.built - built0 != self.saves:
            raise RuntimeError(f"held {len(held)} saves, the builder built {builder.built - built0}")
        if arm == "settled":
            self.found["builder_ns"] += builder.busy_ns - busy0
            self.found["built"] += builder.built - built0
            gc.collect()
            self.cycles["bare"].append(_bare_span_cpu_ns(self.tracer))
            self.provider.force_flush()
        self.exporter.clear()
        dcp_otel.uninstrument()

    def summary(self, results: Results) -> dict[str, float]:
        """The medians, and the bill in bare spans timed in a loop and made amid real saves (the "by hand" arm,
        the same hook, timed the same way); the design core's in both; the trivial ops' as a share of the bill."""
        found = self.found
        for arm in ARMS:
            found[arm], found[f"cpu_{arm}"] = median(results, arm, "wall"), median(results, arm, "cpu") / 1e9
        found["bare_span_cpu"] = statistics.median(self.cycles["bare"]) / 1e9
        found["builder_cpu"] = found.pop("builder_ns") / max(found.pop("built"), 1) / 1e9
        cycles = [dict(zip(self.cycles, cycle, strict=True)) for cycle in zip(*self.cycles.values(), strict=True)]
        spans = found["spans_by_hand"]
        _spread(found, "bare_spans", [(c["own"] - c["plain"]) / c["bare"] for c in cycles])
        _spread(found, "amid_spans", [(c["own"] - c["plain"]) / (c["by hand"] - c["plain"]) * spans for c in cycles])
        found["cpu_amid_span"] = (found["cpu_by hand"] - found["cpu_plain"]) / spans
        _spread(found, "core_spans", [(c["design core"] - c["plain"]) / c["bare"] for c in cycles])
        found["core_amid_spans"] = statistics.median(
            (c["design core"] - c["plain"]) / (c["by hand"] - c["plain"]) * spans for c in cycles)  # fmt: skip
        _spread(found, "record_spans", [(c["own"] - c["own, no record"]) / c["bare"] for c in cycles])
        _spread(found, "trivial_share", [(c["trivial ops"] - c["plain"]) / (c["own"] - c["plain"]) for c in cycles])
        return found


def measure(blocks: int = 15, saves: int = 40) -> dict[str, float]:
    """The bill, in a gloo world of one made and ended here.

    Keys: ``plain``/``settled``/``back-to-back`` (median wall seconds per save),
    ``cpu_<arm>`` (median training-thread CPU seconds per save),
    ``bare_span_cpu`` (seconds), ``records`` (per save), ``builder_cpu`` (the
    builder's CPU seconds per save), ``ops_plain``/``ops_traced``/``ops_trivial``/``ops_bare``
    (bytecode per save and per bare span), ``trivial_share`` (the trivial-ops arm's added CPU over
    the bill, median cycle; ``_low``/``_high``: the extreme cycles).
    """
    warnings.simplefilter("ignore")
    with gloo_world_of_one() as (provider, exporter), \
            tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:  # fmt: skip
        scenario = _Bill(provider, exporter, root, saves)
        scenario.count()
        results = interleave({arm: functools.partial(scenario.block, arm) for arm in ARMS}, blocks)
        scenario.found["ops_bare"] = min(bytecode(lambda: _bare_span_cpu_ns(scenario.tracer, 1)) for _ in range(5))
        exporter.clear()
    return scenario.summary(results)


def bill(found: dict[str, float]) -> dict[str, float]:
    """The bill in the units the docs quote: added us per save and per record, bare spans' worth."""
    added = found["cpu_own"] - found["cpu_plain"]
    bare = found["bare_span_cpu"]
    spreads = {key: value for key, value in found.items() if key.startswith(SPREADS)}  # (each with its _low, _high)
    return {"added_us": added * 1e6, "settled_us": (found["cpu_settled"] - found["cpu_plain"]) * 1e6,
            "record_us": (found["cpu_own"] - found["cpu_own, no record"]) * 1e6, **spreads,
            "per_record_us": added * 1e6 / found["records"], "bare_us": bare * 1e6,
            "amid_us": found["cpu_amid_span"] * 1e6, "core_us": (found["cpu_design core"] - found["cpu_plain"]) * 1e6,
            "core_amid_spans": found["core_amid_spans"], "builder_us": found["builder_cpu"] * 1e6,
            "builder_spans": found["builder_cpu"] / bare,
            "trivial_us": (found["cpu_trivial ops"] - found["cpu_plain"]) * 1e6,
            "trivial_ops": found["ops_trivial"] - found["ops_plain"],
            "ops_added": found["ops_traced"] - found["ops_plain"],
            "ops_spans": (found["ops_traced"] - found["ops_plain"]) / found["ops_bare"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=15, help="blocks per arm")
    parser.add_argument("--saves", type=int, default=40, help="saves per block")
    args = parser.parse_args()
    found = measure(args.blocks, args.saves)
    b = bill(found)
    p = found["plain"]
    print(f"the caller's bill of a real save, 1 gloo rank (torch {torch.__version__}; medians of "
          f"{args.blocks * args.saves} saves per arm, {found['records']:.0f} DCP records per save)")  # fmt: skip
    print(f"  {'plain, wall':<50} {p * 1e6:9.1f} us")
    for arm, said in (("own", "traced, wall, builder held (training thread's own)"),
                      ("settled", "traced, wall, builder done between saves"),
                      ("back-to-back", "traced, wall, back to back (+ builder, exporter)")):  # fmt: skip
        t = found[arm]
        print(f"  {said:<50} {t * 1e6:9.1f} us   ratio {t / p:.3f}   added {(t - p) * 1e6:+8.1f} us per save")
    print(f"  {'training-thread CPU: plain / own / settled':<50} {found['cpu_plain'] * 1e6:9.1f} us / "
          f"{found['cpu_own'] * 1e6:.1f} us / {found['cpu_settled'] * 1e6:.1f} us")  # fmt: skip
    print(f"  {'added CPU per save, the training thread own':<50} {b['added_us']:9.1f} us ({b['per_record_us']:.1f} us per "
          f"record; settled {b['settled_us']:.0f} us)")  # fmt: skip
    print(f"  {'  in bare spans of ' + format(b['bare_us'], '.1f') + ' us, median cycle':<50} {b['bare_spans']:9.1f}    "
          f"(cycles: {b['bare_spans_low']:.1f} to {b['bare_spans_high']:.1f})")  # fmt: skip
    print(f"  {'  in bare spans made amid saves, median cycle':<50} {b['amid_spans']:9.1f}    "
          f"(cycles: {b['amid_spans_low']:.1f} to {b['amid_spans_high']:.1f}; one costs {b['amid_us']:.1f} us there)")  # fmt: skip
    print(f"  {'the design core alone (not built), added CPU':<50} {b['core_us']:9.1f} us = {b['core_spans']:.1f} bare spans "
          f"(cycles: {b['core_spans_low']:.1f} to {b['core_spans_high']:.1f}; {b['core_amid_spans']:.1f} made amid saves; "
          f"{found['core_records']:.0f} raw records per save)")  # fmt: skip
    print(f"  {'  of it the write-ahead record (own - no record)':<50} {b['record_us']:9.1f} us = {b['record_spans']:.2f} "
          f"bare spans (cycles: {b['record_spans_low']:.2f} to {b['record_spans_high']:.2f})")  # fmt: skip
    print(f"  {'added bytecode per save':<50} {b['ops_added']:9.0f} op = {b['ops_spans']:.2f} bare spans of "
          f"{found['ops_bare']:.0f} op")  # fmt: skip
    print(f"  {'as many trivial instructions (a loop), added CPU':<50} {b['trivial_us']:9.1f} us for {b['trivial_ops']:.0f} op "
          f"= {found['trivial_share']:.2f} of the bill (cycles: {found['trivial_share_low']:.2f} to "
          f"{found['trivial_share_high']:.2f})")  # fmt: skip
    print(f"  {'the builder CPU per save (its own thread)':<50} {b['builder_us']:9.1f} us = "
          f"{b['builder_spans']:.1f} bare spans")  # fmt: skip

if __name__ == "__main__":
    main()
