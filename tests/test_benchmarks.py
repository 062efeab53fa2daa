"""The benchmark of the caller's bill runs as its docstring prints it, and measures what it says it does.

Its numbers are the benchmark's business (speed targets never live in tests); what is tested here is
that each arm ran and printed what it names (the benchmark itself stops when an operation held back
from the builder in the "own" arm is not built afterwards), that it counts a save's records, and that
the bytecode it counts is of the right order.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).parent.parent


def _half_step(printed: str) -> float:
    """Half the last printed digit's step: how far rounding can have moved the number (``"33.1"`` -> 0.05)."""
    decimals = len(printed.partition(".")[2])
    return 0.5 * 10.0**-decimals


def _is_ratio_of_printed(numerator: str, denominator: str, ratio: str) -> bool:
    """Whether a printed ratio is that of the unrounded numbers behind the two printed beside it.

    Each of the three was rounded on its own (a ratio of 1.280 beside 42.3 / 33.1 is right: 42.3 may be
    42.34), so the check takes the widest quotient rounding allows, and no wider.
    """
    num, den, said = float(numerator), float(denominator), float(ratio)
    dn, dd, dr = _half_step(numerator), _half_step(denominator), _half_step(ratio)
    return (num - dn) / (den + dd) - dr <= said <= (num + dn) / (den - dd) + dr


def test_fixed_cost_prints_the_real_save_bill_in_bare_spans() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/fixed_cost.py", "--blocks", "1", "--saves", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    records = int(re.search(r"medians of 3 saves per arm, (\d+) DCP records per save", out).group(1))  # type: ignore[union-attr]
    # A one-tensor save logs the operation's start and end and two records per step (torch 2.13-2.15: 7 calls).
    assert records >= 10 and records % 2 == 0, out
    for arm in ("builder held", "builder done between saves", "back to back"):  # ("by hand" has no wall row)
        assert re.search(rf"traced, wall, {arm}.*ratio \d+\.\d+ +added +[-+]\d+\.\d us per save", out), (arm, out)
    added = re.search(r"added CPU per save, the training thread own +(-?[\d.]+) us \(", out)
    spans = re.search(r"in bare spans of ([\d.]+) us, median cycle +(-?[\d.]+) +\(cycles: (-?[\d.]+) to (-?[\d.]+)\)", out)
    assert added is not None and spans is not None, out
    low, median, high = (float(spans.group(i)) for i in (3, 2, 4))
    assert low <= median <= high, out
    amid = re.search(r"in bare spans made amid saves, median cycle +(-?[\d.]+) +\(cycles: (-?[\d.]+) to (-?[\d.]+); "
                     r"one costs (-?[\d.]+) us there\)", out)  # fmt: skip
    assert amid is not None and float(amid.group(2)) <= float(amid.group(1)) <= float(amid.group(3)), out
    # The design that would reach 5 bare spans, its training-thread part at the same hooks: every DCP record
    # and each collective's start and end (and pickling) appended raw.
    core = re.search(r"the design core alone \(not built\), added CPU +(-?[\d.]+) us = (-?[\d.]+) bare spans \(cycles: "
                     r"(-?[\d.]+) to (-?[\d.]+); (-?[\d.]+) made amid saves; (\d+) raw records per save\)", out)  # fmt: skip
    assert core is not None and float(core.group(3)) <= float(core.group(2)) <= float(core.group(4)), out
    assert int(core.group(6)) >= records + 8, out  # DCP's records, and at least 4 collectives' start and end
    ops = re.search(r"added bytecode per save +(\d+) op = ([\d.]+) bare spans of (\d+) op", out)
    assert ops is not None, out
    # Deterministic: dcp-otel's work on the training thread is thousands of instructions, a bare span hundreds.
    assert int(ops.group(1)) > 1_000 and 300 < int(ops.group(3)) < 5_000, out
    # As many instructions as dcp-otel adds, doing nothing (a loop at the same hook): sized by the count above.
    trivial = re.search(r"as many trivial instructions \(a loop\), added CPU +(-?[\d.]+) us for (\d+) op = (-?[\d.]+) of "
                        r"the bill \(cycles: (-?[\d.]+) to (-?[\d.]+)\)", out)  # fmt: skip
    assert trivial is not None and float(trivial.group(4)) <= float(trivial.group(3)) <= float(trivial.group(5)), out
    assert abs(int(trivial.group(2)) - int(ops.group(1))) <= 0.05 * int(ops.group(1)), out
    builder = re.search(r"the builder CPU per save \(its own thread\) +([\d.]+) us", out)
    assert builder is not None and float(builder.group(1)) > 0, out  # the builder built the saves it was given


def test_per_key_prints_the_bytecode_and_time_dcp_otel_adds_per_key() -> None:
    done = subprocess.run([sys.executable, "benchmarks/per_key.py", "--keys", "40", "--timed-keys", "100", "--blocks", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ops = re.search(r"bytecode per save of 40 keys, plain / traced +(\d+) / (\d+) op\n +added per key +(-?[\d.]+) op "
                    r"\(([\d.]+) % of the plain save's\)", done.stdout)  # fmt: skip
    assert ops is not None, done.stdout
    plain, traced, per_key = int(ops.group(1)), int(ops.group(2)), float(ops.group(3))
    # Two records a key reach dcp-otel: each costs some bytecode, and far less than a bare span's 1,000 or so.
    assert 10 < per_key < 2000 and abs((traced - plain) / 40 - per_key) < 0.1, done.stdout
    cpu = re.search(r"CPU per save of 100 keys, plain / traced +([\d.]+) / ([\d.]+) ms +ratio ([\d.]+) +added "
                    r"([-+][\d.]+) us per key \(medians of 6 saves per arm\)", done.stdout)  # fmt: skip
    assert cpu is not None, done.stdout
    assert _is_ratio_of_printed(cpu.group(2), cpu.group(1), cpu.group(3)), done.stdout


def test_caller_parts_prints_each_part_in_bare_spans() -> None:
    done = subprocess.run([sys.executable, "benchmarks/caller_parts.py", "--repeats", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    bare = re.search(r"a bare span: ([\d.]+) us\)", done.stdout)
    assert bare is not None and float(bare.group(1)) > 0, done.stdout
    for part in ("an operation start and end, through the tap", "the design core: 20 raw records, 10 light spans current"):
        found = re.search(rf"{re.escape(part)} +(-?[\d.]+) us = (-?[\d.]+) bare spans", done.stdout)
        assert found is not None, (part, done.stdout)
        assert _is_ratio_of_printed(found.group(1), bare.group(1), found.group(2)), done.stdout
    # What replacing wrapt, then the plain wrapper, at the collectives saved per call: each call timed, the
    # difference to the replacement dcp-otel makes now printed.
    for said, arm in (("a call through wrapt", "wrapt"), ("through a plain wrapper", "plain wrapper")):
        wrapped = re.search(rf"{said}, less through a replacement +(-?[\d.]+) us = (-?[\d.]+) bare spans "
                            rf"\({arm} ([\d.]+) us, replacement ([\d.]+) us a call\)", done.stdout)  # fmt: skip
        assert wrapped is not None, (arm, done.stdout)
        assert abs(float(wrapped.group(3)) - float(wrapped.group(4)) - float(wrapped.group(1))) < 0.02, done.stdout


# About 45 s: five valgrind processes, each instrumenting only from the end of its warm-up. Where the client
# request that starts it cannot run (not x86-64, or no memory both writable and executable), callgrind
# instruments from the start and the five take about 5 minutes: past pytest's default of 300 s.
@pytest.mark.timeout(600)
def test_instructions_counts_the_real_save_bill_with_callgrind() -> None:
    # valgrind comes with the test command's set-up (scripts/setup.sh --valgrind): without it this fails.
    done = subprocess.run([sys.executable, "benchmarks/instructions.py", "--saves", "3", "--spans", "30"], cwd=REPO,
                          capture_output=True, text=True, timeout=570)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    out = done.stdout
    counts = re.search(r"instructions per save, plain / traced +([\d,]+) / ([\d,]+)", out)
    added = re.search(r"added per save +([\d,]+) = ([\d.]+) bare spans of ([\d,]+)", out)
    assert counts is not None and added is not None, out
    plain, traced = (int(counts.group(i).replace(",", "")) for i in (1, 2))
    # A save runs millions of instructions; dcp-otel's hooks add some (never none), a bare span tens of thousands.
    assert 1_000_000 < plain < traced, out
    assert abs(int(added.group(1).replace(",", "")) - (traced - plain)) <= 1, out  # each rounded to a whole one
    assert 10_000 < int(added.group(3).replace(",", "")) < 1_000_000, out
    collector = re.search(r"of which the garbage collector +(-?[\d.]+) \(with it off: (-?[\d,]+) added\)", out)
    misses = re.search(r"L1 misses added per save, code / data +(-?[\d,]+) / (-?[\d,]+) \(a bare span in a loop: "
                       r"([\d,]+) / ([\d,]+)\)", out)  # fmt: skip
    assert collector is not None and misses is not None, out
    assert int(misses.group(3).replace(",", "")) > 0, out  # callgrind's cache model ran


def run_gpu_check(*args: str) -> str:
    done = subprocess.run(["bash", "scripts/gpu-check.sh", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_gpu_check_runs_as_printed_on_cpu_tensors(tmp_path: Path) -> None:
    """scripts/gpu-check.sh's GPU-independent parts: every call, the span names, both gloo ranks, the table."""
    out = run_gpu_check("--cpu", "--gib", "0.02", "--reps", "1", "--dir", str(tmp_path / "c"))
    assert "state dict: 8 bf16 tensors on cpu, 0.02 GiB" in out, out
    names = re.search(r"span names \((\d+)\): (.*)", out)
    assert names is not None and {"dcp.save", "dcp.load", "dcp.async_save", "dcp.async_upload", "dcp.stage_state_dict",
                                  "dcp.create_checkpoint_daemon_process"} <= set(names.group(2).split(", ")), out  # fmt: skip
    assert re.search(r"staging \(device to host, pinned\): 0\.02 GiB in [\d.]+ s \(fastest of \d+\): [\d.]+ GB/s", out)
    for call in ("save", "async_save", "load"):
        assert re.search(rf"  {call} +plain +[\d.]+ ms +instrumented +[\d.]+ ms \([\d.]+\) +plain again", out), out
    assert "one trace for the save across ranks: True" in out and "FAILED" not in out, out
    # Then the training loop, plain vs instrumented: each measure's ratio, the noise row and the rounds it needs.
    assert "training loop on cpu: 20 steps, async_save every 5" in out, out
    for measure in ("step_around_ms", "step_quiet_ms", "return_ms", "loop_s"):
        assert re.search(rf"10 tensors, 16 MiB +instrumented +{measure} +[\d.]+ +[\d.]+ +[\d.]+", out), out
    assert re.search(r"noise: plain again strays [\d.]+ at most; rounds to resolve 1%: \d+", out), out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-check.sh is run on one by hand)")
def test_the_gpu_check_on_a_gpu_adds_no_device_synchronisation_and_names_the_same_spans(tmp_path: Path) -> None:
    out = run_gpu_check("--gib", "0.5", "--reps", "1", "--dir", str(tmp_path / "c"))
    assert "device synchronisations" in out and "none added" in out, out
    assert "span names on CPU tensors: the same" in out and "FAILED" not in out, out


def test_death_evidence_times_the_jobs_end_and_the_evidences_arrival() -> None:
    done = subprocess.run([sys.executable, "benchmarks/death_evidence.py", "--runs", "1"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"death to the job end, plain +[\d.]+ s +exit \[1\]", done.stdout), done.stdout
    assert re.search(r"opentelemetry-instrument +[\d.]+ s +exit \[1\] +added [-+][\d.]+ s", done.stdout), done.stdout
    assert re.search(r"at the receiver +[\d.]+ s +\(slowest [\d.]+ s\)", done.stdout), done.stdout


def test_staging_walk_prints_the_walk_and_the_async_save_it_sits_in() -> None:
    done = subprocess.run([sys.executable, "benchmarks/staging_walk.py", "--tensors", "200", "--rounds", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"the walk alone: [\d.]+ ms for 200 tensors \([\d.]+ us each\)", done.stdout), done.stdout
    assert re.search(r"plain [\d.]+ ms, instrumented [\d.]+ ms, ratio [\d.]+ \(added [-+][\d.]+ ms", done.stdout), done.stdout


def test_straggler_marks_prints_what_the_marks_add_to_the_coordinators_gather() -> None:
    done = subprocess.run([sys.executable, "benchmarks/straggler_marks.py", "--ranks", "500", "--items", "4", "--blocks", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]  # (it stops when a marked result differs from the plain one)
    found = re.search(r"unpickling, plain / marked +([\d.]+) / +([\d.]+) ms +ratio ([\d.]+) +added ([-+][\d.]+) ms",
                      done.stdout)  # fmt: skip
    assert found is not None and _is_ratio_of_printed(found.group(2), found.group(1), found.group(3)), done.stdout
    size = re.search(r"bytes a mark adds per rank +(\d+) B \(of (\d+) B\)", done.stdout)
    assert size is not None and 30 < int(size.group(1)) < 100 < int(size.group(2)), done.stdout


def test_signal_exceptions_prints_what_the_agent_loop_and_an_error_path_pay() -> None:
    done = subprocess.run([sys.executable, "benchmarks/signal_exceptions.py", "--quick"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    loop = re.search(r"agent loop \(4 metrics\): torch ([\d.]+) us, with OTelMetricHandler ([\d.]+) us \(x([\d.]+)\); "
                     r"added [-\d.]+ us = [\d.]+% of a 0.1 s monitor interval", done.stdout)  # fmt: skip
    assert loop is not None and _is_ratio_of_printed(loop.group(2), loop.group(1), loop.group(3)), done.stdout
    error = re.search(r"without the check ([\d.]+) us, with reraise_if_signalled ([\d.]+) us \(x([\d.]+);", done.stdout)
    assert error is not None and _is_ratio_of_printed(error.group(2), error.group(1), error.group(3)), done.stdout


def test_checkpointing_calls_prints_torch_checkpointings_bill_in_bare_spans_and_its_times() -> None:
    done = subprocess.run([sys.executable, "benchmarks/checkpointing_calls.py", "--quick"], capture_output=True,
                          text=True, timeout=600, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    bare = re.search(r"a bare span: (\d+)\)", done.stdout)
    assert bare is not None and 500 < int(bare.group(1)) < 5000, done.stdout
    for call in ("sync save", "load", "async save \\(returns\\)"):
        row = re.search(rf"^{call} +(\d+) +(\d+) +(-?\d+) +(-?[\d.]+)$", done.stdout, re.M)
        assert row is not None, (call, done.stdout)
        plain, traced, added, spans = row.groups()
        assert int(traced) > int(plain) and int(added) == int(traced) - int(plain)
        assert abs(float(spans) - int(added) / int(bare.group(1))) <= 0.005
    times = done.stdout.partition("plain us")[2]
    for call in ("sync save", "load", "async save \\(returns\\)", "  its caller's CPU", "async save \\(durable\\)"):
        row = re.search(rf"^{call} +([\d.]+) +([\d.]+) +(-?[\d.]+) +([\d.]+)$", times, re.M)
        assert row is not None and _is_ratio_of_printed(row.group(2), row.group(1), row.group(4)), (call, done.stdout)


def test_the_ab_harness_compares_arms_round_by_round_and_says_the_rounds_noise_needs() -> None:
    """benchmarks/ab.py: a ratio is the median of per-round ratios (a round with nothing measured, nan, left out),
    and the rounds needed to resolve 1% grow with the square of the noise."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import ab
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    results = {"plain": [{"t": 10.0}, {"t": 20.0}, {"t": 10.0}], "instrumented": [{"t": 11.0}, {"t": 20.0}, {"t": float("nan")}]}
    assert ab.ratio(results, "instrumented", "plain", "t") == pytest.approx(1.05)  # rounds 1 and 2: 1.1 and 1.0
    assert ab.median(results, "instrumented", "t") == pytest.approx(15.5)
    assert ab.ratio_rows(results, "plain", ["t"]) == [("instrumented", "t", pytest.approx(15.5), 10.0, pytest.approx(1.05))]
    assert ab.rounds_to_resolve(0.0) == 1 and ab.rounds_to_resolve(0.004) == 1
    assert ab.rounds_to_resolve(0.02) == 25 and ab.rounds_to_resolve(0.04) == 4 * ab.rounds_to_resolve(0.02)
    done = ab.run_job("import json, sys; print('noise'); print(json.dumps({'argv': sys.argv[1:]}))", ab.Arm("a", ["x"]))
    assert done == {"argv": ["x"]}


def test_own_share_counts_dcp_otels_threads_and_the_callers_cpu_apart_from_the_collector() -> None:
    done = subprocess.run([sys.executable, "benchmarks/own_share.py", "--cases", "10:8", "--rounds", "1", "--steps", "40",
                           "--reps", "2", "--spans-elsewhere", "--otlp", "--node", "--ring-full"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    # The spans went over OTLP/HTTP to the benchmark's receiver, on the confirming thread (a flush a checkpoint).
    received = re.search(r"spans the OTLP receiver decoded +(\d+)", out)
    assert received is not None and int(received.group(1)) > 0, out
    confirm = re.search(r"dcp-otel-spool-confirm, ms +([\d.]+)", out)
    assert confirm is not None and float(confirm.group(1)) > 0, out
    assert re.search(r"async_save CPU on the caller, ms +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +<= 1.03", out), out
    assert re.search(r"collections per checkpoint, ms +[\d.]+ +[\d.]+", out), out
    # The caller's CPU split by phase, timed in both arms: the conversion and the staging copy take some; the rest,
    # a save's whole less its two phases, is never below zero (no phase counted twice, none beyond its save).
    for title, takes_cpu in (("of it converting (2 records a key)", True), ("of it staging the copy", True),
                             ("the rest (dcp-otel's wrappers in it)", False)):  # fmt: skip
        row = re.search(rf"  {re.escape(title)} +(-?[\d.]+) +(-?[\d.]+) ", out)
        assert row is not None, out
        mine, plain = float(row.group(1)), float(row.group(2))
        assert (mine > 0 and plain > 0) if takes_cpu else (mine >= 0 and plain >= 0), (title, out)
    builder = re.search(r"dcp-otel-builder, ms +([\d.]+)", out)  # its CPU clock, read from outside the thread
    assert builder is not None and float(builder.group(1)) > 0, out
    assert re.search(r"own threads share of the loop +[\d.]+ +<= 0.01", out), out
    # What the steps waited for and took, per checkpoint, in both arms; beside them, torch's upload thread's CPU (a
    # row of its own, as every thread that ran beside them has) and the share the instrumented arm's waits add.
    for title in ("the steps' waits per checkpoint, ms", "the steps' CPU per checkpoint, ms"):
        row = re.search(rf"{re.escape(title)} +([\d.]+) +([\d.]+) ", out)
        assert row is not None, (title, out)
        assert title.startswith("the steps' waits") or (float(row.group(1)) > 0 and float(row.group(2)) > 0), out
    upload = re.search(r"CPU of AsyncCheckpointExecutor beside them, ms +([\d.]+) +([\d.]+)", out)
    assert upload is not None, out
    assert re.search(r"waits added to the steps, of the loop +-?[\d.]+ +[\d.]+ +<= 0.01", out), out
    # Each round's, with the blocks' places in their process: one round, the arms in their first order (pqin).
    assert re.search(r"instrumented, by round \(places\) +[-+][\d.]+% \(3 on 1\)$", out, re.M), out
    assert re.search(r"plain again, by round \(places\) +[-+][\d.]+% \(2 on 1\)$", out, re.M), out
    elsewhere = re.search(r"\[spans elsewhere\]   the builder by its own clock, ms +([\d.]+)", out)
    assert elsewhere is not None and float(elsewhere.group(1)) > 0, out  # (metrics and interference still built)
    # span_export="node": the benchmark's own process sends that arm's spans (as torchelastic's agent would), the arm's
    # process runs no confirming thread.
    node = re.search(r"\[node exports\] spans the node sent +(\d+)", out)
    assert node is not None and int(node.group(1)) > 0, out
    assert re.search(r"\[node exports\] waits added, of the loop +-?[\d.]+ +[\d.]+ +<= 0.01", out), out
    hook = re.search(r"optimizer hook per step, ns +(-?\d+)", out)
    assert hook is not None and abs(int(hook.group(1))) < 100_000, out
    for shape in ("flat", "nested"):  # counted: the instrumented arm runs more of them than plain, never fewer
        counted = re.search(rf"Python instructions, {shape}.*? +([\d.]+)M +([\d.]+)M +([\d.]+) +\+(\d+) a save", out)
        assert counted is not None and float(counted.group(3)) >= 1.0 and int(counted.group(4)) > 0, out
    # Torch's upload thread converts the staged copy again, and dcp-otel reads its records there: counted apart.
    uploads = re.findall(r"on the upload thread +([\d.]+)M +([\d.]+)M +([\d.]+) +([+-]\d+) a save", out)
    assert len(uploads) == 2 and all(float(plain) > 0 for _, plain, _, _ in uploads), out
    assert int(uploads[0][3]) > 0, out  # the flat state dict's keys, read on the upload thread too


def test_faulthandler_dumps_runs_every_arm_and_counts_the_dumps_it_sent() -> None:
    done = subprocess.run([sys.executable, "benchmarks/faulthandler_dumps.py", "--runs", "1", "--saves", "5",
                           "--every", "0.05"], cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for arm in ("save, plain", "save, instrumented", "async_save, plain", "async_save, instrumented"):
        assert re.search(rf"{arm} +\d of 1 +\d+ +[\d.]+", done.stdout), done.stdout
