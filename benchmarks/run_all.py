"""Every benchmark, one table: what dcp-otel costs, as ratios measured side by side in one run.

    .venv/bin/python benchmarks/run_all.py            # ~10 min on 2 cores
    .venv/bin/python benchmarks/run_all.py --quick    # fewer repetitions, ~6 min

Rows come from overhead.py (span cost per step; save, load, async save on 2
ranks), metric_sinks.py (Prometheus and OpenTelemetry metrics, on the caller's
thread and on the builder's), metrics_overhead.py (put_metric paths), faults.py (saves with a dead
or hung OTLP endpoint), fixed_cost.py (the caller's bill of a real save: a save that is all fixed cost, in a gloo world of one),
instructions.py (the same bill counted in instructions by valgrind's callgrind), process_async.py (the traced checkpoint daemon) and stall_watchdog.py (a save with
the stall watchdog ticking or stopped, and the watchdog's own CPU).
Each compares instrumented with uninstrumented runs interleaved in this run
(medians), never with a number from elsewhere. The series budget is
series_budget.py's own table.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import faults  # noqa: E402
import fixed_cost  # noqa: E402
import instructions  # noqa: E402
import metric_sinks  # noqa: E402
import metrics_overhead  # noqa: E402
import overhead  # noqa: E402
import process_async  # noqa: E402
import stall_watchdog  # noqa: E402
import torch  # noqa: E402

Row = tuple[str, float, float, float | None, str]  # measure, ours, baseline, goal, unit
#: (case, ms the background builder spent per checkpoint, its peak queue depth), off the caller's thread.
BUILDER_ROWS: list[tuple[str, float, int]] = []
#: (metrics sinks, microseconds the builder spent per DCP step): what each sink costs off the caller's thread.
BUILDER_STEP_ROWS: list[tuple[str, float]] = []
#: fixed_cost.py's measure() and bill(): the caller's bill of a real save.
REAL_SAVE: dict[str, float] = {}
#: (what, microseconds of the stall watchdog's CPU per second of wall time, or per event).
WATCHDOG_ROWS: list[tuple[str, float]] = []


def rows(quick: bool) -> list[Row]:
    found: list[Row] = []
    step = overhead.step_cost(repeats=7 if quick else 25, steps=2_000 if quick else 10_000)
    found.append(("span cost per DCP step / bare span", step["added_per_step_s"] * 1e6, step["bare_span_s"] * 1e6,
                  0.5, "us"))  # fmt: skip
    found.append(("span cost per DCP step / same span + histogram by hand", step["added_per_step_s"] * 1e6,
                  step["equivalent_span_s"] * 1e6, None, "us"))  # fmt: skip
    ops = overhead.instructions_per_step()
    found.append(("bytecode per DCP step / bare span (deterministic)", ops["added"], ops["bare"], None, "op"))
    for name, (plain, traced, _) in overhead.checkpoint_ratios(repeats=3 if quick else 9).items():
        found.append((f"{name}, 2 ranks", traced * 1e3, plain * 1e3, overhead.GOALS.get(name), "ms"))
    for name in overhead.BUILDS:
        busy_ms, peak = overhead.builder_stats(name)
        BUILDER_ROWS.append((name, busy_ms, peak))
    sinks = metric_sinks.measure(repeats=5 if quick else 15, steps=2_000 if quick else 10_000)
    prometheus, both = sinks["prometheus"], sinks["prometheus,opentelemetry"]
    found.append(("DCP step on the caller, both metric sinks / Prometheus", both["step_us"], prometheus["step_us"],
                  None, "us"))  # fmt: skip
    for name, row in sinks.items():
        BUILDER_STEP_ROWS.append((name, row["builder_us"]))
    costs = metrics_overhead.put_metric_costs(calls=2_000 if quick else 10_000, repeats=3 if quick else 9)
    for path, by in costs.items():
        found.append((f"put_metric {path} / ConsoleMetricHandler", by["OTelMetricHandler"] * 1e6,
                      by["ConsoleMetricHandler"] * 1e6, 1.0 if path == "counter" else None, "us"))  # fmt: skip
    for kind in faults.KINDS:
        plain, traced = faults.save_ratio(kind, repeats=5 if quick else 15)
        what = "exporter healthy" if kind == "healthy" else f"OTLP endpoint {kind}"
        found.append((f"save 64 MiB, 1 process, {what}", traced * 1e3, plain * 1e3, 1.005 if kind == "healthy" else 1.01, "ms"))
    real = fixed_cost.measure(blocks=5 if quick else 15)
    REAL_SAVE.update(real, **fixed_cost.bill(real))
    # A ratio per cycle of interleaved blocks (every arm once), then their median: the bare spans' worth.
    found.append(("real save: training thread's own CPU, in bare spans", REAL_SAVE["bare_spans"], 1.0, 5.0, "x"))
    found.append(("real save: the same, in bare spans made amid saves", REAL_SAVE["amid_spans"], 1.0, 5.0, "x"))
    found.append(("real save: the design core (not built), in bare spans", REAL_SAVE["core_spans"], 1.0, 5.0, "x"))
    found.append(("real save: bytecode added / bare span (deterministic)", REAL_SAVE["ops_added"],
                  REAL_SAVE["ops_bare"], 5.0, "op"))  # fmt: skip
    counted = instructions.measure(saves=10 if quick else 20, spans=100 if quick else 200)
    REAL_SAVE.update({f"callgrind_{key}": value for key, value in counted.items()})
    found.append(("real save: instructions added / bare span (callgrind)", counted["added"], counted["ir_bare"], 5.0,
                  "Ir"))  # fmt: skip
    found.append(("real save, 1 gloo rank, wall, builder done between saves", real["settled"] * 1e3,
                  real["plain"] * 1e3, None, "ms"))  # fmt: skip
    found.append(("real save, 1 gloo rank, wall, back to back", real["back-to-back"] * 1e3, real["plain"] * 1e3,
                  None, "ms"))  # fmt: skip
    daemon = process_async.measure(rounds=2 if quick else 3, saves=3 if quick else 5, mb=16)
    found.append(("process async_save 16 MiB, upload (warm daemon)", daemon["upload_traced"] * 1e3,
                  daemon["upload_plain"] * 1e3, None, "ms"))  # fmt: skip
    found.append(("process async_save 16 MiB, first (starts daemon)", daemon["first_traced"] * 1e3,
                  daemon["first_plain"] * 1e3, None, "ms"))  # fmt: skip
    watched = stall_watchdog.measure(quick)
    for arm in ("watchdog every 1 s", "watchdog every 50 ms"):
        found.append((f"save 64 tensors, 1 process, {arm} / stopped", watched[f"save, {arm}"] * 1e3,
                      watched["save, watchdog stopped"] * 1e3, None, "ms"))  # fmt: skip
    for tick in (1.0, 0.05):
        for what in ("idle", "one save open"):
            WATCHDOG_ROWS.append((f"CPU per wall second, tick {tick:g} s, {what}", watched[f"cpu, tick {tick:g} s, {what}"] * 1e6))
    WATCHDOG_ROWS.append(("one stall report (stack, span, warning, counter)", watched["one stall report"] * 1e6))
    WATCHDOG_ROWS.append(("one scrape's in-progress gauges, one save open",
                          watched["one collection of the in-progress gauges"] * 1e6))  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    table = rows(args.quick)
    print(f"\ndcp-otel: instrumented / uninstrumented (torch {torch.__version__}, {os.cpu_count()} cores; medians of "
          f"interleaved repetitions{', quick' if args.quick else ''})")  # fmt: skip
    print(f"{'measure':<56} {'ours':>11} {'baseline':>11} {'ratio':>7} {'goal':>7}")
    for name, ours, base, goal, unit in table:
        ratio = ours / base
        verdict = "" if goal is None else ("ok" if ratio <= goal else "OVER")
        goal_text = "" if goal is None else f"<={goal}"
        print(f"{name:<56} {ours:>9.2f}{unit} {base:>9.2f}{unit} {ratio:>7.3f} {goal_text:>7} {verdict}")
    r = REAL_SAVE
    print(f"\nthe caller's bill of a real save (fixed_cost.py: 1 gloo rank, {r['records']:.0f} DCP records per save, "
          "torch's own logging subtracted)")  # fmt: skip
    print(f"  training thread's own CPU added  {r['added_us']:8.1f} us per save = {r['bare_spans']:.1f} bare spans of "
          f"{r['bare_us']:.1f} us (median cycle; cycles {r['bare_spans_low']:.1f} to {r['bare_spans_high']:.1f}); "
          f"{r['per_record_us']:.1f} us per record")  # fmt: skip
    print(f"  in bare spans made amid saves    {r['amid_spans']:8.1f} (median cycle; cycles {r['amid_spans_low']:.1f} to "
          f"{r['amid_spans_high']:.1f}; one costs {r['amid_us']:.1f} us there, by hand at the same hook)")  # fmt: skip
    print(f"  the design core alone (not built) {r['core_us']:7.1f} us per save = {r['core_spans']:.1f} bare spans (median cycle; "
          f"cycles {r['core_spans_low']:.1f} to {r['core_spans_high']:.1f}; {r['core_amid_spans']:.1f} made amid saves)")  # fmt: skip
    print(f"  with the builder's work between saves (settled)  {r['settled_us']:8.1f} us per save")
    print(f"  bytecode added                   {r['ops_added']:8.0f} op per save = {r['ops_spans']:.2f} bare spans")
    print(f"  instructions added (callgrind)   {r['callgrind_added']:8.0f} Ir per save = {r['callgrind_spans']:.2f} bare "
          f"spans (L1 misses per 1,000 added: {r['callgrind_misses_per_k']:.1f}; a bare span in a loop: "
          f"{r['callgrind_bare_misses_per_k']:.1f})")  # fmt: skip
    print(f"  as many trivial instructions     {r['trivial_us']:8.1f} us per save = {r['trivial_share']:.2f} of the bill "
          "(the count of bytecode is not where the bill is)")  # fmt: skip
    print(f"  the builder's CPU (own thread)   {r['builder_us']:8.1f} us per save = {r['builder_spans']:.1f} bare spans")
    print("\nthe background builder (its own thread; rank 0 of the 2-rank cases)")
    print(f"{'case':<56} {'ms per checkpoint':>18} {'peak queue':>11}")
    for name, busy_ms, peak in BUILDER_ROWS:
        print(f"{name:<56} {busy_ms:>18.3f} {peak:>11d}")
    print(f"\n{'the builder per DCP step, by metrics sinks (full detail)':<56} {'us per step':>18}")
    for name, busy_us in BUILDER_STEP_ROWS:
        print(f"{name:<56} {busy_us:>18.2f}")
    print(f"\n{'the stall watchdog (its own thread, holding the interpreter lock)':<56} {'us':>18}")
    for name, value_us in WATCHDOG_ROWS:
        print(f"{name:<56} {value_us:>18.1f}")


if __name__ == "__main__":
    main()
