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
import collections
import contextlib
import gc
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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
from dcp_otel.attach.patches import PATCHES, resolve
from dcp_otel.attach.wrapping import wrap  # noqa: E402
from dcp_otel.tracing.light import span_context as light_span_context  # noqa: E402
from dcp_otel.tracing.light import with_span  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import bytecode  # noqa: E402

ARMS = ("plain", "own", "own, no record", "by hand", "design core", "trivial ops", "settled", "back-to-back")
#: The arms held back from the builder until their block ends (the training thread's own work).
HELD = ("own", "own, no record")
#: The bare span's attributes: as many as a step's own, of the same kinds.
_BARE_ATTRIBUTES = {"dcp.rank": 0, "dcp.checkpoint_id": "/dev/shm/checkpoints/step-1000", "dcp.operation": "save",
                    "dcp.world_size": 1}  # fmt: skip


@contextlib.contextmanager
def spool_off(off: bool) -> Iterator[None]:
    """``DCP_OTEL_SPOOL_DIR=off`` while instrumenting, when ``off``."""
    before = os.environ.get("DCP_OTEL_SPOOL_DIR")
    if off:
        os.environ["DCP_OTEL_SPOOL_DIR"] = "off"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DCP_OTEL_SPOOL_DIR", None)
        else:
            os.environ["DCP_OTEL_SPOOL_DIR"] = before


def _block(saves: int, root: str, state: dict[str, torch.Tensor], settle: bool = False) -> list[tuple[float, int]]:
    """(wall seconds, training-thread CPU ns) of each save."""
    took = []
    for i in range(saves):
        cpu0 = time.thread_time_ns()
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=os.path.join(root, f"c{i % 4}"))
        took.append((time.perf_counter() - start, time.thread_time_ns() - cpu0))
        if settle:  # untimed: the builder and the exporter finish before the next save
            dcp_otel.flush(timeout_s=30)
    return took


def _bare_span_cpu_ns(tracer: trace.Tracer, spans: int = 200) -> float:
    """Training-thread CPU ns of one bare span: started with attributes, made current, detached, ended."""
    cpu0 = time.thread_time_ns()
    for _ in range(spans):
        span = tracer.start_span("dcp.write_data", attributes=_BARE_ATTRIBUTES)
        token = context.attach(trace.set_span_in_context(span))
        context.detach(token)
        span.end()
    return (time.thread_time_ns() - cpu0) / spans


class _BareSpansByHand(DCPLoggerTap):
    """Hand-written instrumentation at dcp-otel's hook, torch's logger global: one bare span per DCP call.

    Each call's start record starts a span with :data:`_BARE_ATTRIBUTES` and makes it current; its end
    record detaches and ends it; torch's logger then gets the record exactly as from dcp-otel's tap
    (this is the tap, its recorder's hot path replaced by the span). What a bare span costs amid a real
    save, measured as the bill is.
    """

    def __init__(self, logger: Any, tracer: trace.Tracer) -> None:
        super().__init__(logger, SimpleNamespace(on_record=self._span, lane=None))  # type: ignore[arg-type]
        self.tracer, self.open, self.spans = tracer, {}, 0

    def _span(self, msg: dict[str, Any]) -> bool:
        if msg["event"] == "start":
            span = self.tracer.start_span("dcp." + msg["func_name"], attributes=_BARE_ATTRIBUTES)
            self.open[msg["uuid"]] = (span, context.attach(trace.set_span_in_context(span)))
            self.spans += 1
        else:
            span, token = self.open.pop(msg["uuid"])
            context.detach(token)
            span.end()
        return True


class _DesignCore(DCPLoggerTap):
    """The training thread's part of the raw-records design, at dcp-otel's hooks (see the module doc).

    This is the tap (passing each record on to torch's logger as it does), its recorder's hot path
    replaced by a raw append, and wrappers (made as dcp-otel makes them) at the same collective and pickling points; each only
    appends a raw tuple to a per-thread log, and a call's start makes a light span (a chosen span id,
    non-recording) current.
    """

    def __init__(self, logger: Any) -> None:
        super().__init__(logger, SimpleNamespace(on_record=self._raw_record, lane=None))  # type: ignore[arg-type]
        self.local, self.wrapped = threading.local(), []
        self.var: Any = getattr(getattr(context, "_RUNTIME_CONTEXT", None), "_current_context", None)
        self.trace_id = random.getrandbits(128) or 1
        self.flags = trace.TraceFlags(trace.TraceFlags.SAMPLED)

    def _log(self) -> Any:
        try:
            return self.local.log
        except AttributeError:
            self.local.log, self.local.tokens = collections.deque(maxlen=100_000), []
            return self.local.log

    def _raw_record(self, msg: dict[str, Any]) -> bool:
        log = self._log()
        log.append((msg.get("uuid"), msg.get("func_name"), msg.get("event"), msg.get("time")))
        if msg.get("event") == "start":
            ctx = self.var.get()
            light = trace.NonRecordingSpan(light_span_context(self.trace_id, random.getrandbits(64) or 1, self.flags))
            self.local.tokens.append(self.var.set(with_span(ctx, light)))
        elif self.local.tokens:
            self.var.reset(self.local.tokens.pop())
        return True

    def wrap(self) -> None:
        """Raw appends at the points dcp-otel's patches wrap around DCP's collectives and torch's pickling."""
        for patch in PATCHES:
            if not (patch.name.startswith("_DistWrapper.") or patch.name in ("_object_to_tensor", "_tensor_to_object")):
                continue
            target = resolve(patch)
            if target is None:
                continue
            owner, attr = target
            self.wrapped.append((owner, attr, vars(owner)[attr]))
            wrap(owner, attr, self._raw(attr), patch.hot)  # as dcp-otel wraps it

    def unwrap(self) -> None:
        for owner, attr, original in reversed(self.wrapped):
            setattr(owner, attr, original)
        self.wrapped.clear()

    def _raw(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A hot patch's replacer (``patches.Patch``): the replacement appends raw records around the original."""

        def replacer(original: Callable[..., Any]) -> Callable[..., Any]:
            def replacement(*args: Any, **kwargs: Any) -> Any:  # (a method's self is args[0])
                log = self._log()
                log.append((None, name, "start", time.time_ns()))
                result = original(*args, **kwargs)
                log.append((None, name, "end", time.time_ns()))
                return result

            return replacement

        return replacer


class _TrivialOps(DCPLoggerTap):
    """The tap, its recorder's hot path replaced by ``loops`` additions to a local integer per record."""

    def __init__(self, logger: Any, loops: int) -> None:
        super().__init__(logger, SimpleNamespace(on_record=self._count, lane=None))  # type: ignore[arg-type]
        self.loops = loops

    def _count(self, msg: dict[str, Any]) -> bool:
        x = 0
        for _ in range(self.loops):
            x += 1  # noqa: SIM113 - the work is the counting
        return True


def _trivial_loops(save: Callable[[], None], logger: Any, ops_plain: float, ops_added: float) -> int:
    """Loops per record that make a save's added bytecode ``ops_added`` (``ops_plain``: with ``logger`` alone)."""
    counted = {}
    for loops in (0, 10):
        dcp_logger._dcp_logger = _TrivialOps(logger, loops)  # type: ignore[assignment]
        try:
            counted[loops] = bytecode(save)
        finally:
            dcp_logger._dcp_logger = logger
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
def gloo_world_of_one() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """torch.distributed initialized as in a job (gloo, a world of one, so DCP's collectives run), and a
    provider sending spans through a batch processor to memory; both ended on leaving."""
    store = tempfile.mktemp(prefix="dcp-otel-store-")
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
    registry = CollectorRegistry()
    state = {"w": torch.zeros(16)}
    arms: dict[str, list[tuple[float, int]]] = {arm: [] for arm in ARMS}
    bare: list[float] = []
    # Each run of len(ARMS) blocks holds every arm once: the bill per cycle cancels the drift of a
    # shared machine (its speed moves by 2x over minutes here); the median cycle is the bill.
    cycles: list[dict[str, float]] = [{} for _ in range(blocks)]
    builder_ns, built = 0, 0
    found: dict[str, float] = {}
    # plain, settled, back-to-back, back-to-back, settled, plain, ...: drift falls on every arm alike
    order = [*ARMS, *reversed(ARMS)]
    with gloo_world_of_one() as (provider, exporter):
        tracer = provider.get_tracer("bench")
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
            def one_save() -> None:
                dcp.save(state, checkpoint_id=os.path.join(root, "c0"))

            # The bytecode first (the trivial-ops arm is sized by it), after warm saves: plain, then traced
            # (settled between saves).
            for _ in range(3):
                one_save()
            found["ops_plain"] = min(bytecode(one_save) for _ in range(3))
            dcp_otel.instrument(tracer_provider=provider, registry=registry, detail="full")
            for _ in range(3):
                one_save()
                dcp_otel.flush(timeout_s=30)
            found["records"] = _records_per_save(one_save)
            dcp_otel.flush(timeout_s=30)
            traced_ops = []
            for _ in range(3):
                traced_ops.append(bytecode(one_save))
                dcp_otel.flush(timeout_s=30)
            found["ops_traced"] = min(traced_ops)
            dcp_otel.uninstrument()
            exporter.clear()
            torch_logger = dcp_logger._dcp_logger
            loops = _trivial_loops(one_save, torch_logger, found["ops_plain"], found["ops_traced"] - found["ops_plain"])
            dcp_logger._dcp_logger = _TrivialOps(torch_logger, loops)  # type: ignore[assignment]
            found["ops_trivial"] = bytecode(one_save)
            dcp_logger._dcp_logger = torch_logger

            for block in range(len(ARMS) * blocks):
                arm = order[block % len(order)]
                on = arm not in ("plain", "by hand", "design core", "trivial ops")  # dcp-otel instrumented
                if on:
                    with spool_off(arm == "own, no record"):
                        dcp_otel.instrument(tracer_provider=provider, registry=registry, detail="full")
                _block(1, root, state, settle=on)  # untimed: the first save after a switch
                gc.collect()
                if on:
                    builder = dcp_otel.DCPInstrumentor().recorder.builder
                    busy0, built0 = builder.busy_ns, builder.built
                if arm == "by hand":
                    by_hand = dcp_logger._dcp_logger = _BareSpansByHand(dcp_logger._dcp_logger, tracer)  # type: ignore[assignment]
                    _block(1, root, state)
                    gc.collect()
                    by_hand.spans = 0
                if arm == "design core":
                    design = dcp_logger._dcp_logger = _DesignCore(dcp_logger._dcp_logger)  # type: ignore[assignment]
                    design.wrap()
                    _block(1, root, state)
                    gc.collect()
                    design._log().clear()
                if arm == "trivial ops":
                    dcp_logger._dcp_logger = _TrivialOps(torch_logger, loops)  # type: ignore[assignment]
                held: list[tuple[Any, Any]] = []
                if arm in HELD:  # the builder gets this block's operations when it ends (an instance attribute)
                    builder.submit = lambda op, calls=None, held=held: held.append((op, calls))
                took = _block(saves, root, state, settle=arm == "settled")
                arms[arm].extend(took)
                cycles[block // len(ARMS)][arm] = statistics.median(cpu for _, cpu in took)
                if arm == "design core":
                    found["core_records"] = len(design._log()) / saves
                    design.unwrap()
                    dcp_logger._dcp_logger = design.logger
                if arm == "trivial ops":
                    dcp_logger._dcp_logger = torch_logger
                if arm == "by hand":
                    dcp_logger._dcp_logger = by_hand.logger
                    found["spans_by_hand"] = by_hand.spans / saves
                    provider.force_flush()
                    exporter.clear()
                if arm in HELD:
                    del builder.submit
                    for op, calls in held:
                        builder.submit(op, calls)
                if on:
                    dcp_otel.flush(timeout_s=30)
                    if arm in HELD and builder.built - built0 != saves:  # each held save built once, afterwards
                        raise RuntimeError(f"held {len(held)} saves, the builder built {builder.built - built0}")
                    if arm == "settled":
                        builder_ns += builder.busy_ns - busy0
                        built += builder.built - built0
                        gc.collect()
                        bare.append(_bare_span_cpu_ns(tracer))
                        cycles[block // len(ARMS)]["bare"] = bare[-1]
                        provider.force_flush()
                    exporter.clear()
                    dcp_otel.uninstrument()
            found["ops_bare"] = min(bytecode(lambda: _bare_span_cpu_ns(tracer, 1)) for _ in range(5))
            exporter.clear()
    for arm, took in arms.items():
        found[arm] = statistics.median(wall for wall, _ in took)
    for arm, took in arms.items():
        found[f"cpu_{arm}"] = statistics.median(cpu for _, cpu in took) / 1e9
    found["bare_span_cpu"] = statistics.median(bare) / 1e9
    # The bill in bare spans timed in a loop, and in bare spans made amid real saves (the "by hand" arm, the
    # same hook, timed the same way); the design core's in both; the trivial ops' as a share of the bill.
    spans = found["spans_by_hand"]
    _spread(found, "bare_spans", [(c["own"] - c["plain"]) / c["bare"] for c in cycles])
    _spread(found, "amid_spans", [(c["own"] - c["plain"]) / (c["by hand"] - c["plain"]) * spans for c in cycles])
    found["cpu_amid_span"] = (found["cpu_by hand"] - found["cpu_plain"]) / spans
    _spread(found, "core_spans", [(c["design core"] - c["plain"]) / c["bare"] for c in cycles])
    found["core_amid_spans"] = statistics.median(
        (c["design core"] - c["plain"]) / (c["by hand"] - c["plain"]) * spans for c in cycles)  # fmt: skip
    found["builder_cpu"] = builder_ns / max(built, 1) / 1e9
    _spread(found, "record_spans", [(c["own"] - c["own, no record"]) / c["bare"] for c in cycles])
    _spread(found, "trivial_share", [(c["trivial ops"] - c["plain"]) / (c["own"] - c["plain"]) for c in cycles])
    return found


def bill(found: dict[str, float]) -> dict[str, float]:
    """The bill in the units the docs quote: added us per save and per record, bare spans' worth."""
    added = found["cpu_own"] - found["cpu_plain"]
    bare = found["bare_span_cpu"]
    return {"added_us": added * 1e6, "settled_us": (found["cpu_settled"] - found["cpu_plain"]) * 1e6,
            "record_us": (found["cpu_own"] - found["cpu_own, no record"]) * 1e6, "record_spans": found["record_spans"],
            "record_spans_low": found["record_spans_low"], "record_spans_high": found["record_spans_high"],
            "per_record_us": added * 1e6 / found["records"], "bare_us": bare * 1e6,
            "bare_spans": found["bare_spans"], "bare_spans_low": found["bare_spans_low"],
            "bare_spans_high": found["bare_spans_high"], "amid_spans": found["amid_spans"],
            "amid_spans_low": found["amid_spans_low"], "amid_spans_high": found["amid_spans_high"],
            "amid_us": found["cpu_amid_span"] * 1e6, "core_us": (found["cpu_design core"] - found["cpu_plain"]) * 1e6,
            "core_spans": found["core_spans"], "core_spans_low": found["core_spans_low"],
            "core_spans_high": found["core_spans_high"], "core_amid_spans": found["core_amid_spans"], "builder_us": found["builder_cpu"] * 1e6,
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
