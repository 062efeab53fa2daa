"""dcp-otel never changes how a job ends: each script runs once plain and once instrumented, and must end alike.

Alike means the same exit status (a signal's death included), the same standard output and the same
files written (tests/workers/endings.py says what each scenario does). Where dcp-otel adds evidence
(the spans of a save a SIGTERM cut short) it must be there too, and the end must come within the
flush bound however the exporter behaves.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dcp_otel import semconv
from dcp_otel.otlp_file import FileSpan, read_spans
from tests.ports import free_port_range
from tests.ranks import REPO, WORKERS, rank_env
from tests.spans_io import named

SCRIPT = WORKERS / "endings.py"


@dataclass
class Ended:
    returncode: int
    stdout: str
    stderr: str
    files: list[str]
    spans: list[FileSpan]
    seconds_after_signal: float | None = None  # from the first signal the test sent to the end

    def same_as(self, other: Ended) -> bool:
        return (self.returncode, self.stdout, self.files) == (other.returncode, other.stdout, other.files)

    def __str__(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- files {self.files}\n--- stderr\n{self.stderr[-3000:]}"


def wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 90.0) -> None:
    """Until ``path`` exists (polled, bounded); fails with the process's output if it ends first."""
    tick = threading.Event()
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"ended before {path.name}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout_s} s"
        tick.wait(0.05)


def signal_repeatedly(proc: subprocess.Popen[str], signum: int, every_s: float, times: int) -> float:
    """Send ``signum`` ``times`` times, ``every_s`` apart (the stimulus, as a user pressing Ctrl-C again),
    stopping once the process has ended; returns when the first one was sent."""
    first = time.monotonic()
    pause = threading.Event()
    for _ in range(times):
        if proc.poll() is not None:
            break
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            break
        pause.wait(every_s)
    return first


def end(proc: subprocess.Popen[str], out: Path, timeout_s: float = 120.0, first_signal: float | None = None) -> Ended:
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended_at = time.monotonic()
    files = sorted(str(p.relative_to(out / "files")) for p in (out / "files").rglob("*")) if (out / "files").exists() else []
    spans_file = out / "spans.jsonl"
    spans = read_spans([spans_file]) if spans_file.exists() and spans_file.stat().st_size else []
    return Ended(proc.returncode, stdout, stderr, files, spans,
                 None if first_signal is None else ended_at - first_signal)  # fmt: skip


def start(tmp: Path, scenario: str, plain: bool, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], Path]:
    out = tmp / ("plain" if plain else "instrumented") / scenario / (env or {}).get("RANK", "0")
    out.mkdir(parents=True)
    command = [sys.executable, str(SCRIPT), str(out), scenario, *(["--plain"] if plain else [])]
    proc = subprocess.Popen(command, env=rank_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)  # fmt: skip
    return proc, out


def run(tmp: Path, scenario: str, plain: bool) -> Ended:
    proc, out = start(tmp, scenario, plain)
    return end(proc, out)


def both(tmp: Path, scenario: str) -> tuple[Ended, Ended]:
    plain, instrumented = run(tmp, scenario, plain=True), run(tmp, scenario, plain=False)
    assert instrumented.same_as(plain), f"PLAIN\n{plain}\n\nINSTRUMENTED\n{instrumented}"
    return plain, instrumented


def errors(spans: list[FileSpan]) -> list[str]:
    return [f"{s.name}: {s.status_message}" for s in spans if s.error]


# --- frameworks and applications that own their signals ----------------------------------------------
def test_lightning_stops_at_the_batch_end_and_saves_in_on_exception_as_without_dcp_otel(tmp_path: Path) -> None:
    plain, instrumented = both(tmp_path, "lightning")
    assert plain.returncode == 0 and "saved in on_exception" in plain.stdout, plain
    assert "on_exception: SIGTERMException" in plain.stdout and "received_sigterm=True" not in plain.stdout
    (save,) = named(instrumented.spans, "dcp.save")
    assert not save.error and "on_exception" in save.attributes[semconv.ATTR_CHECKPOINT_ID]


def test_an_application_handler_installed_after_instrument_that_chains_decides_how_the_job_ends(
    tmp_path: Path,
) -> None:
    plain, instrumented = both(tmp_path, "chain")
    assert plain.returncode == 0 and "stopping after step 1" in plain.stdout, plain
    assert len(named(instrumented.spans, "dcp.save")) == 3 and errors(instrumented.spans) == []


def test_asyncio_run_gets_ctrl_c_and_a_main_task_that_returns_after_its_cancellation_exits_0(
    tmp_path: Path,
) -> None:
    plain, instrumented = both(tmp_path, "asyncio")
    assert plain.returncode == 0 and "returned normally" in plain.stdout, plain
    assert errors(instrumented.spans) == []


def test_trio_gets_ctrl_c_and_sees_no_collision_over_the_wakeup_fd(tmp_path: Path) -> None:
    plain, instrumented = both(tmp_path, "trio")
    assert plain.returncode == 0 and "KeyboardInterrupt from trio.run" in plain.stdout, plain
    # trio warns when set_wakeup_fd tells it someone else held the fd (the script prints it): dcp-otel's
    # must not show (the stdouts are equal, and the plain one has no such line).
    assert "trio warned" not in plain.stdout


def test_handlers_scoped_around_uninstrument_act_as_the_ones_they_replaced(tmp_path: Path) -> None:
    plain, _ = both(tmp_path, "scoped")
    assert plain.returncode == -signal.SIGTERM and "KeyboardInterrupt caught" in plain.stdout, plain
    assert "still alive" not in plain.stdout


def test_ctrl_c_caught_during_an_async_upload_leaves_the_save_a_success(tmp_path: Path) -> None:
    plain, instrumented = both(tmp_path, "async_ctrl_c")
    assert plain.returncode == 0 and "loaded back: True" in plain.stdout, plain
    upload = named(instrumented.spans, "dcp.async_upload")
    assert len(upload) == 1 and errors(instrumented.spans) == []  # no span says "terminated by SIGINT"


# --- repeated signals, locks, and a rank blocked in C -----------------------------------------------
def repeated(tmp: Path, signum: int, plain: bool) -> Ended:
    proc, out = start(tmp, "idle", plain, env={semconv.ENV_FLUSH_TIMEOUT_S: "8"})
    wait_for(out / "ready", proc)
    first = signal_repeatedly(proc, signum, every_s=0.5, times=20)
    return end(proc, out, first_signal=first)


def test_repeated_ctrl_c_with_a_stuck_exporter_cuts_the_exit_flush_short(tmp_path: Path) -> None:
    plain, instrumented = repeated(tmp_path, signal.SIGINT, True), repeated(tmp_path, signal.SIGINT, False)
    assert instrumented.same_as(plain) and plain.returncode == -signal.SIGINT, f"{plain}\n\n{instrumented}"
    assert plain.stderr.rstrip().endswith("KeyboardInterrupt") and instrumented.stderr.rstrip().endswith(
        "KeyboardInterrupt"), instrumented.stderr[-2000:]
    assert "Exception ignored" not in instrumented.stderr
    # The exit flush waits for the stuck exporter (8 s) until the second Ctrl-C, 0.5 s after the first.
    assert instrumented.seconds_after_signal is not None and instrumented.seconds_after_signal < 4.0


def test_repeated_sigterm_with_a_stuck_exporter_ends_by_sigterm_at_the_second_one(tmp_path: Path) -> None:
    plain, instrumented = repeated(tmp_path, signal.SIGTERM, True), repeated(tmp_path, signal.SIGTERM, False)
    assert instrumented.same_as(plain) and plain.returncode == -signal.SIGTERM, f"{plain}\n\n{instrumented}"
    assert instrumented.seconds_after_signal is not None and instrumented.seconds_after_signal < 4.0


def test_one_sigterm_with_a_stuck_exporter_ends_the_process_at_the_flush_bound(tmp_path: Path) -> None:
    proc, out = start(tmp_path, "idle", False, env={semconv.ENV_FLUSH_TIMEOUT_S: "2"})
    wait_for(out / "ready", proc)
    first = signal_repeatedly(proc, signal.SIGTERM, every_s=0, times=1)
    ended = end(proc, out, first_signal=first)
    assert ended.returncode == -signal.SIGTERM, ended
    assert ended.seconds_after_signal is not None and 1.5 < ended.seconds_after_signal < 4.0


def test_sigterm_while_the_main_thread_holds_an_operations_lock_ends_by_sigterm_with_the_evidence(
    tmp_path: Path,
) -> None:
    plain, instrumented = run(tmp_path, "lock_held", True), run(tmp_path, "lock_held", False)
    assert instrumented.same_as(plain) and plain.returncode == -signal.SIGTERM, f"{plain}\n\n{instrumented}"
    (save,) = named(instrumented.spans, "dcp.async_save")
    assert save.error and save.status_message.startswith("terminated by SIGTERM")
    assert save.attributes[semconv.ATTR_INTERRUPTED] == "SIGTERM"


def gloo_job(tmp: Path, plain: bool) -> tuple[Ended, Ended]:
    """Two gloo ranks; rank 1 hangs in write_data, rank 0 waits for it; SIGTERM to rank 0."""
    port = free_port_range(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = [start(tmp, "gloo", plain, env={**env, "RANK": str(rank)}) for rank in range(2)]
    (rank0, out0), (rank1, out1) = procs
    try:
        wait_for(out1 / "ready", rank1)  # rank 1 is in write_data for good
        if not plain:  # rank 0 says it is stuck waiting (a stall span in its file: its watchdog's exported one)
            stall = threading.Event()
            deadline = time.monotonic() + 60
            while not (out0 / "spans.jsonl").exists() or semconv.SPAN_STALL not in (out0 / "spans.jsonl").read_text():
                assert rank0.poll() is None and time.monotonic() < deadline, "rank 0 reported no stall"
                stall.wait(0.05)
        first = signal_repeatedly(rank0, signal.SIGTERM, every_s=0, times=1)
        ended0 = end(rank0, out0, timeout_s=60, first_signal=first)
    finally:
        rank1.kill()
    return ended0, end(rank1, out1)


def test_sigterm_in_a_gloo_collective_after_asyncio_with_a_hanging_exporter_ends_within_the_flush_bound(
    tmp_path: Path,
) -> None:
    plain, _ = gloo_job(tmp_path, plain=True)
    instrumented, _ = gloo_job(tmp_path, plain=False)
    assert instrumented.same_as(plain) and plain.returncode == -signal.SIGTERM, f"{plain}\n\n{instrumented}"
    # flush_timeout_s=3: the watchdog read the SIGTERM at once (the event loop gave the wakeup fd back),
    # though its stall span's export hangs for good and the main thread is blocked in gloo (30 s timeout).
    assert instrumented.seconds_after_signal is not None and instrumented.seconds_after_signal < 6.0
    # Written where the exporter allows: the file's processor comes first, so the stall span and the first
    # span the builder ends (the checkpoint's root: rank 0 coordinates) get there before the hang.
    assert named(instrumented.spans, semconv.SPAN_STALL)
    ended = [s for s in instrumented.spans if s.error and s.name != semconv.SPAN_PROCESS]
    assert ended and all(s.status_message == "terminated by SIGTERM while waiting in gather_object "
                         "(_DistWrapper.all_reduce)" for s in ended), errors(instrumented.spans)
    # The process's own end, where the exporter let it through, says so too.
    assert all(s.status_message == "terminated by SIGTERM" for s in named(instrumented.spans, semconv.SPAN_PROCESS))


def orphaned_ending(out: Path, plain: bool) -> dict[str, int]:
    """Run ``tests/workers/orphaned_ending.py`` under its reaper; SIGTERM to the child once it is blocked (plain:
    then SIGKILL to its parent, which the instrumented child's exporter does itself). The exit status by role."""
    out.mkdir()
    reaper = subprocess.Popen([sys.executable, str(WORKERS / "orphaned_ending.py"), "reaper", str(out)], cwd=REPO,
                              env=rank_env(**({"ORPHAN_PLAIN": "1"} if plain else {})), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for(out / "blocked", reaper)  # the child is in write_data for good
        os.kill(int((out / "child.pid").read_text()), signal.SIGTERM)
        if plain:
            os.kill(int((out / "parent.pid").read_text()), signal.SIGKILL)
        _, stderr = reaper.communicate(timeout=90)
    finally:
        if reaper.poll() is None:
            for pid_file in ("child.pid", "parent.pid"):
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int((out / pid_file).read_text()), signal.SIGKILL)
            reaper.kill()
            reaper.wait()
    assert reaper.returncode == 0, stderr[-3000:]
    exits: dict[str, int] = json.loads((out / "exits.json").read_text())
    assert os.WIFSIGNALED(exits["parent"]) and os.WTERMSIG(exits["parent"]) == signal.SIGKILL, exits
    return exits


def test_a_checkpoint_process_whose_parent_dies_during_its_sigterm_ending_still_writes_the_interrupted_write(
    tmp_path: Path,
) -> None:
    """torch's ``spawn`` makes SIGINT its child's parent-death signal. A scheduler's SIGTERM reaches the rank
    and its checkpoint process; the rank, dying first, sends that SIGINT into its child's ending. The ending
    goes on (it used to take the SIGINT for a second signal, cut itself short and lose the hung write's span)
    and the process dies by SIGTERM, as without dcp-otel. ``tests/workers/orphaned_ending.py`` kills the parent
    from inside the ending's export, so the SIGINT comes exactly then."""
    plain = orphaned_ending(tmp_path / "plain", plain=True)
    traced = orphaned_ending(tmp_path / "traced", plain=False)
    assert os.WIFSIGNALED(plain["child"]) and os.WTERMSIG(plain["child"]) == signal.SIGTERM, plain
    assert traced["child"] == plain["child"], (plain, traced)
    assert (tmp_path / "traced" / "sigint_taken").read_text() == "True"  # the SIGINT came in the ending: its parent's
    (write,) = named(read_spans([tmp_path / "traced" / "spans.jsonl"]), "dcp.write_data")
    assert write.error and write.status_message == "terminated by SIGTERM during write_data", write.status_message
