"""The report says where each rank ran and who sent nothing: from a generated run whose files say their host,
and one whose rank 1 left no file (a process killed before it exported)."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

from tests.generated_run import START_NS, write_run
from tests.ranks import REPO

RANKS = 4


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dcp_otel", "report", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)  # fmt: skip


def on_hosts(folder: Path) -> None:
    """Give rank R's resource ``host.name`` node-R (and rank 3 a pod), as the SDK's resource detectors do."""
    for rank in range(RANKS):
        path = folder / f"rank-{rank}.jsonl"
        requests = [json.loads(line) for line in path.read_text().splitlines()]
        for request in requests:
            for resource_spans in request["resourceSpans"]:
                said = resource_spans["resource"]["attributes"]
                said.append({"key": "host.name", "value": {"stringValue": f"node-{rank}"}})
                if rank == 3:
                    said.append({"key": "k8s.pod.name", "value": {"stringValue": "trainer-0-3"}})
        path.write_text("".join(json.dumps(r) + "\n" for r in requests))


def test_each_ranks_host_is_beside_it_in_the_terminal_and_the_perfetto_trace(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "traces", checkpoints=2, ranks=RANKS)
    on_hosts(folder)
    shown = report(str(folder), "--perfetto", str(tmp_path / "trace.json"))
    assert shown.returncode == 0, shown.stderr
    assert len(re.findall(r"\n  rank +host +(?:total|returned) ", shown.stdout)) == 2  # a save's table, an async save's
    for rank in range(RANKS - 1):
        assert len(re.findall(rf"\n  {rank}(?: <- straggler)? +node-{rank} +\d", shown.stdout)) == 2, rank
    assert len(re.findall(r"\n  3 +node-3/trainer-0-3 +\d", shown.stdout)) == 2
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (node-0)", 1: "rank 1 (node-1)", 2: "rank 2 (node-2)", 3: "rank 3 (node-3/trainer-0-3)"}


def test_a_rank_that_sent_nothing_is_named_in_the_summary_and_in_every_table(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "traces", checkpoints=3, ranks=RANKS)
    (folder / "rank-1.jsonl").unlink()
    shown = report(str(folder), "--all")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("3 checkpoint operations (") and " on 3 of 4 ranks: " in lines[0]
    assert lines[1] == "no spans from rank 1: a process killed before it exported, or a file not given"
    assert sum(1 for line in lines if re.fullmatch(r"  1 +no spans", line)) == 3


def test_the_html_page_says_where_and_who_too(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "traces", checkpoints=2, ranks=RANKS)
    on_hosts(folder)
    (folder / "rank-1.jsonl").unlink()
    shown = report(str(folder), "--html", str(tmp_path / "page.html"))
    assert shown.returncode == 0, shown.stderr
    page = (tmp_path / "page.html").read_text()
    assert " on 3 of 4 ranks: " in page and "No spans from rank 1: a process killed before it exported" in page
    assert page.count('<th title="where the rank ran: its resource&#x27;s host.name, and its pod or container">host</th>') == 2
    assert page.count("<td>node-3/trainer-0-3</td>") == 2 and page.count("<td>node-0</td>") == 2
    assert page.count('<tr class="silent"><td>1</td>') == 2


def test_each_checkpoint_says_when_it_started_on_the_wall_clock(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "traces", checkpoints=1, ranks=2)
    shown = report(str(folder), "--html", str(tmp_path / "page.html"))
    assert shown.returncode == 0, shown.stderr
    when = datetime.datetime.fromtimestamp(START_NS / 1e9, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    (title,) = [line for line in shown.stdout.splitlines() if line.startswith("save /ckpt/step-0 ")]
    assert f"  started {when}.000 UTC  trace " in title
    assert f"started {when}.000 UTC, trace " in (tmp_path / "page.html").read_text()
