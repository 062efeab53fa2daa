"""Soak: 5,000 save/load cycles with dcp-otel on leak nothing: memory, spans and series stay flat."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.ranks import REPO, WORKERS, rank_env

CYCLES, WARMUP = 5000, 300


def test_five_thousand_save_load_cycles_keep_memory_spans_and_series_flat() -> None:
    run = subprocess.run([sys.executable, str(WORKERS / "soak.py"), str(CYCLES), str(WARMUP)],
                         capture_output=True, text=True, timeout=600, env=rank_env(), cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # Python's objects: a leak of one per cycle would be thousands of blocks.
    assert result["blocks_after"] - result["blocks_before"] < 1000, result
    # Resident memory, steady: the second half of the cycles adds under 2 KiB per cycle.
    assert (result["rss_after_kib"] - result["rss_middle_kib"]) / 1024 < 5, result
    # Both halves together may add what the builder's backlog held at its peak: saves back to back outrun it
    # (a job saves minutes apart; the worker drains it every 50 cycles, so in either half it peaks at a few
    # dozen operations), and each operation waiting holds about 8 KiB, whose interpreter arenas stay mapped
    # after it is built. At most 16 KiB per operation of that peak, beyond the steady half's bound.
    growth_mib = (result["rss_after_kib"] - result["rss_before_kib"]) / 1024
    assert growth_mib < 5 + result["builder_peak"] * 16 / 1024, result
    assert result["open_spans"] == 0
    assert result["series_after"] == result["series_before"]  # same series, only their values moved
    # Every operation's spans went out (save: 7, load: 5 per cycle at least), and nothing was dropped.
    assert result["exported_spans"] >= (CYCLES + WARMUP) * 10
    problems = {k: v for k, v in result["diagnostics"].items() if k != "open_spans"}
    assert problems == {} and result["diagnostics"]["open_spans"] == 0
