"""What the stall watchdog costs: a save on the caller's thread, and the watchdog's own CPU per second.

    .venv/bin/python benchmarks/stall_watchdog.py            # ~1 min on 2 cores
    .venv/bin/python benchmarks/stall_watchdog.py --quick

The watchdog (``dcp_otel/live/watchdog.py``) never runs on the caller's thread: it
reads the recorder's open calls from its own thread, once a tick. What a save
could still pay is the interpreter lock the watchdog holds while it ticks. One
process, instrumented throughout, real saves of a 64-tensor state dict (about 20
DCP records each) to ``/dev/shm``, in interleaved blocks (medians):

* **the caller**: a save with the watchdog stopped, with it ticking every second
  (the default), and every 50 ms (the fastest tick: ``stall_after_s`` at 0.2 s);
* **the watchdog**: its CPU time per second of wall time (all of it holds the
  interpreter lock: it is Python), measured from the thread's own clock while
  nothing is open and while one save is open, at both ticks; one stall report
  (stack, span, warning, counter) timed alone; and one collection of the
  in-progress gauges (what a scrape adds) with one operation open.

Left out: the signal handlers (they cost nothing until a signal comes) and the
multiprocess-mode gauges (a tick writes them only when where a call is changes).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ab import Measures, interleave, median, per_call  # noqa: E402
from overhead import DiscardingExporter  # noqa: E402

import dcp_otel  # noqa: E402
from dcp_otel.live.watchdog import Watchdog  # noqa: E402

STATE = {f"layer{i}": torch.randn(256) for i in range(64)}


class Held(dcp.FileSystemWriter):
    """A save that stays open (in write_data) until released."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.entered, self.release = threading.Event(), threading.Event()

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.release.wait()
        return super().write_data(plan, planner)


def instrumented(tick_s: float | None) -> Watchdog:
    """Instrument with the watchdog ticking every ``tick_s`` (``None``: stopped); return it."""
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(DiscardingExporter()))
    dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry(), stall_after_s=3600.0)
    watchdog = dcp_otel.DCPInstrumentor().watchdog
    assert watchdog is not None
    if tick_s is None:
        watchdog.stop()
    else:
        watchdog.tick_s = tick_s
        watchdog.ensure_running()
    return watchdog


def save_times(repeats: int, saves: int, root: str) -> dict[str, float]:
    """Per arm, the median seconds per save over interleaved blocks."""
    arms = {"watchdog stopped": None, "watchdog every 1 s": 1.0, "watchdog every 50 ms": 0.05}
    names = itertools.count()

    def block(tick_s: float | None) -> Measures:
        instrumented(tick_s)
        dcp.save(STATE, checkpoint_id=f"{root}/warm")
        took = per_call(lambda: dcp.save(STATE, checkpoint_id=f"{root}/c{next(names) % 4}"), saves)
        dcp_otel.uninstrument()
        return {"s": took}

    times = interleave({name: functools.partial(block, tick) for name, tick in arms.items()}, repeats)
    return {name: median(times, name, "s") for name in arms}


def cpu_per_second(tick_s: float, seconds: float, root: str, *, open_call: bool) -> float:
    """The watchdog thread's CPU seconds per wall second, over ``seconds`` (one save held open, or none)."""
    watchdog = instrumented(tick_s)
    held = Held(f"{root}/held")
    thread = threading.Thread(target=dcp.save, args=(STATE,), kwargs={"storage_writer": held})
    try:
        if open_call:
            thread.start()
            held.entered.wait()
        cpu, wall = watchdog.cpu_ns, time.perf_counter()
        threading.Event().wait(seconds)  # the measured interval itself: the watchdog runs meanwhile
        return (watchdog.cpu_ns - cpu) / 1e9 / (time.perf_counter() - wall)
    finally:
        held.release.set()
        if open_call:
            thread.join()
        dcp_otel.uninstrument()


def one_report_and_one_collection(root: str) -> tuple[float, float]:
    """Seconds for one stall report, and for one collection of the in-progress gauges, one save open."""
    registry = CollectorRegistry()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(DiscardingExporter()))
    dcp_otel.instrument(tracer_provider=provider, registry=registry, stall_after_s=3600.0)
    watchdog = dcp_otel.DCPInstrumentor().watchdog
    assert watchdog is not None and watchdog.reporter is not None
    held = Held(f"{root}/held")
    thread = threading.Thread(target=dcp.save, args=(STATE,), kwargs={"storage_writer": held})
    logging.getLogger("dcp_otel").setLevel(logging.ERROR)  # (the report's warning line is timed, not shown)
    try:
        thread.start()
        held.entered.wait()
        (progress,) = watchdog.live.progress()
        reports = []
        for n in range(20):
            start = time.perf_counter()
            watchdog.reporter.report(progress, 3600.0, n + 2)
            reports.append(time.perf_counter() - start)
        collections = []
        for _ in range(200):
            start = time.perf_counter()
            list(registry.collect())
            collections.append(time.perf_counter() - start)
        return statistics.median(reports), statistics.median(collections)
    finally:
        held.release.set()
        thread.join()
        logging.getLogger("dcp_otel").setLevel(logging.NOTSET)
        dcp_otel.uninstrument()


def measure(quick: bool) -> dict[str, float]:
    found: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as root:
        saves = save_times(repeats=6 if quick else 16, saves=30 if quick else 60, root=root)
        found.update({f"save, {name}": value for name, value in saves.items()})
        seconds = 2.0 if quick else 5.0
        for tick in (1.0, 0.05):
            for open_call in (False, True):
                what = "one save open" if open_call else "idle"
                found[f"cpu, tick {tick:g} s, {what}"] = cpu_per_second(tick, seconds, root, open_call=open_call)
        found["one stall report"], found["one collection of the in-progress gauges"] = one_report_and_one_collection(root)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    found = measure(args.quick)
    stopped = found["save, watchdog stopped"]
    print(f"\nthe caller: a save (64 tensors, /dev/shm), torch {torch.__version__}; medians of interleaved blocks")
    print(f"{'arm':<32} {'us per save':>12} {'/ stopped':>10}")
    for name in ("watchdog stopped", "watchdog every 1 s", "watchdog every 50 ms"):
        value = found[f"save, {name}"]
        print(f"{name:<32} {value * 1e6:>12.1f} {value / stopped:>10.3f}")
    print(f"\n{'the watchdog thread':<44} {'CPU us per wall second':>24}")
    for tick in (1.0, 0.05):
        for what in ("idle", "one save open"):
            print(f"{f'tick {tick:g} s, {what}':<44} {found[f'cpu, tick {tick:g} s, {what}'] * 1e6:>24.1f}")
    print(f"\n{'one stall report (stack, span, warning, counter)':<56} {found['one stall report'] * 1e6:>10.1f} us")
    print(f"{'one collection of the in-progress gauges, one save open':<56} "
          f"{found['one collection of the in-progress gauges'] * 1e6:>10.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
