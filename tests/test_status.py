"""``dcp-otel status`` and the stall reports each endpoint serves, piece by piece.

The whole command runs against a real hung 2-rank job in tests/test_hung_checkpoints.py;
here: the order and bounds of what it prints for 1,024 ranks, endpoints that do not
answer, and the ``/dcp-otel/stalls`` route (real endpoints on loopback).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import dcp_otel
from dcp_otel import semconv
from dcp_otel.cli.status import Position, Snapshot, from_endpoints, parse_metrics, render
from dcp_otel.live.status import STALLS_PATH, board
from tests.ports import free_port_range
from tests.ranks import REPO

NOW = 1_800_000_000.0


def position(rank: int, step: str, age_s: float, threshold_s: float | None = 300.0, run: str = "r1") -> Position:
    return Position("llama", run, "save", str(rank), step, NOW - age_s, threshold_s, f"node{rank // 8}",
                    f"node{rank // 8}:{9710 + rank % 8}")  # fmt: skip


def test_at_1024_ranks_the_stuck_one_comes_first_and_the_waiting_ones_are_folded() -> None:
    # Rank 700 has been in write_data for 10 minutes; the others finished theirs and wait between steps.
    positions = [position(r, semconv.STEP_NONE, 500 - r / 10) for r in range(1024) if r != 700]
    positions.append(position(700, "write_data", 600))
    screen = render(Snapshot(positions=positions, asked=128), NOW, rows=5).splitlines()
    assert screen[0] == ("run r1 (job llama) save: 1024 rank(s) open, 1023 waiting between steps - "
                         "STALLED: 1 rank(s) stuck in a step")  # fmt: skip
    rows = [line.split() for line in screen[2:7]]
    assert rows[0][:5] == ["700", "node87", "write_data", "10m", "00s"] and rows[0][-1] == "STALLED"
    assert [row[0] for row in rows[1:]] == ["0", "1", "2", "3"]  # then the longest waiting
    assert screen[7] == "  ... 1019 more rank(s), 1019 of them waiting between steps"
    assert len(screen) == 8


def test_ranks_within_their_threshold_are_in_progress_and_runs_are_told_apart() -> None:
    screen = render(Snapshot(positions=[position(0, "write_data", 10, run="a"), position(0, "write_data", 400, run="b"),
                                        position(1, "planning", 5, threshold_s=None, run="a")]), NOW)  # fmt: skip
    blocks = screen.split("\n\n")
    assert blocks[0].startswith("run a (job llama) save: 2 rank(s) open, 0 waiting between steps - in progress")
    assert "STALLED" not in blocks[0] and " -  " in blocks[0]  # no threshold known: "-"
    assert blocks[1].startswith("run b (job llama) save: 1 rank(s) open") and blocks[1].rstrip().endswith("STALLED")


def test_a_stall_report_is_shown_only_for_the_stall_it_was_made_in() -> None:
    stuck = position(3, "write_data", 400)
    old = {"operation": "save", "step": "write_data", "rank": "3", "reported_at": stuck.since - 60, "stack": "stale stack"}
    new = {"operation": "save", "step": "write_data", "rank": "3", "reported_at": NOW - 10, "stack": "File x\n  now()",
           "collective": None}  # fmt: skip
    screen = render(Snapshot(positions=[stuck], reports={(stuck.instance, "3"): [old, new]}), NOW)
    assert "last stall report of rank 3 on node0 (write_data" in screen and "    File x\n      now()" in screen
    assert "stale stack" not in screen
    assert "last stall report" not in render(Snapshot(positions=[stuck], reports={(stuck.instance, "3"): [old]}), NOW)


def test_the_metrics_text_gives_each_open_operation_its_threshold() -> None:
    text = (f'{semconv.METRIC_IN_PROGRESS}{{operation="save",step="write_data",rank="3"}} 1.7e9\n'
            f'{semconv.METRIC_IN_PROGRESS}{{operation="load",step="read_data",rank="3"}} 0.0\n'  # ended (multiprocess)
            f'{semconv.METRIC_STALL_THRESHOLD}{{operation="save",rank="3"}} 120.0\n')  # fmt: skip
    (found,) = parse_metrics(text, {semconv.LABEL_RUN_ID: "r9", semconv.LABEL_HOST: "n1", "job": "j"}, "n1:9713")
    assert found == Position("j", "r9", "save", "3", "write_data", 1.7e9, 120.0, "n1", "n1:9713")


def test_an_endpoint_serves_its_stall_reports_and_that_is_not_a_scrape() -> None:
    board().clear()
    board().record(operation="save", step="write_data", rank="3", seconds=312.5, threshold_s=300.0,
                   stack='File "w.py", line 1, in write_data', collective=None)  # fmt: skip
    endpoint = dcp_otel.start_metrics_server(0, "127.0.0.1", registry=CollectorRegistry())
    assert endpoint is not None
    try:
        seen = endpoint._watch.count()
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}{STALLS_PATH}", timeout=10) as response:
            assert response.headers["Content-Type"] == "application/json"
            body = json.load(response)
        (report,) = body["stalls"]
        assert (report["rank"], report["step"], report["seconds_without_progress"]) == ("3", "write_data", 312.5)
        assert "in write_data" in report["stack"] and body["pid"] > 0
        assert endpoint._watch.count() == seen  # a wait for the last scrape is not ended by it
    finally:
        endpoint.close()
        board().clear()


def test_endpoints_that_do_not_answer_are_named_and_nothing_open_is_said(tmp_path: Path) -> None:
    endpoint = dcp_otel.start_metrics_server(0, "127.0.0.1", registry=CollectorRegistry())
    assert endpoint is not None
    dead = f"127.0.0.1:{free_port_range(1)}"
    try:
        snapshot = from_endpoints([(f"127.0.0.1:{endpoint.port}", {}), (dead, {})], timeout_s=5)
    finally:
        endpoint.close()
    screen = render(snapshot, NOW)
    assert screen.splitlines()[0] == "no checkpoint in progress (1 of 2 endpoints answered)"
    assert f"unreachable: {dead} (" in screen


def test_the_command_asks_only_the_chosen_runs_endpoints_and_prints_json_for_scripts(tmp_path: Path) -> None:
    endpoints = [dcp_otel.start_metrics_server(0, "127.0.0.1", registry=CollectorRegistry(), file_sd_dir=tmp_path,
                                               run_id=run) for run in ("run-a", "run-b", "run-b")]  # fmt: skip
    try:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-m", "dcp_otel", "status", "--targets", str(tmp_path), "--run", "run-b"],
                              capture_output=True, text=True, timeout=60, cwd=REPO, env=env)  # fmt: skip
        assert (done.returncode, done.stdout) == (0, "no checkpoint in progress (2 of 2 endpoints answered)\n"), done.stderr
        done = subprocess.run([sys.executable, "-m", "dcp_otel", "status", "--targets", str(tmp_path), "--json"],
                              capture_output=True, text=True, timeout=60, cwd=REPO, env=env)  # fmt: skip
        assert done.returncode == 0 and json.loads(done.stdout)["asked"] == 3 and json.loads(done.stdout)["ranks"] == []
    finally:
        for endpoint in endpoints:
            assert endpoint is not None
            endpoint.close()


def test_as_json_the_stuck_rank_comes_first_with_its_report() -> None:
    from dcp_otel.cli.status import as_json

    stuck = position(5, "write_data", 400)
    report = {"operation": "save", "step": "write_data", "rank": "5", "reported_at": NOW - 5, "stack": "File y"}
    found = as_json(Snapshot(positions=[position(0, semconv.STEP_NONE, 390), stuck],
                             reports={(stuck.instance, "5"): [report]}, asked=2), NOW)  # fmt: skip
    first, second = found["ranks"]
    assert (first["rank"], first["stalled"], first["waiting"], first["stall_report"]) == ("5", True, False, report)
    assert (second["rank"], second["waiting"], second["stall_report"]) == ("0", True, None)
    assert first["seconds_without_progress"] == 400 and found["unreachable"] == []


def test_the_command_says_what_to_fix_and_exits_2(tmp_path: Path) -> None:
    def status(*args: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
        return subprocess.run([sys.executable, "-m", "dcp_otel", "status", *args], capture_output=True, text=True,
                              timeout=60, cwd=REPO, env=env)  # fmt: skip

    cases: list[tuple[tuple[str, ...], str]] = [
        ((), "--targets FOLDER"),
        (("--targets", str(tmp_path)), "no rank endpoint announced"),
        (("--targets", str(tmp_path / "nope")), "is not a folder"),
        (("--prometheus", f"http://127.0.0.1:{free_port_range(1)}"), "cannot query"),
    ]
    for args, words in cases:
        done = status(*args)
        assert done.returncode == 2 and words in done.stderr and not done.stdout, (args, done.stderr)


@pytest.fixture(autouse=True)
def _no_discovery_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(semconv.ENV_FILE_SD_DIR, raising=False)
