"""dcp-otel never changes how a job ends: each script runs once plain and once instrumented, and must end alike.

Alike means the same exit status (a signal's death included), within 0.5 s of the signal as plain, the
same standard output and the same files written (tests/workers/endings.py says what each scenario
does). dcp-otel installs no signal handler: where a signal ends the process, the evidence of what was
open is in the process's record, and the test, playing the survivor that saw the process end (the
agent, the parent), reads what dcp-otel's survivor sends from it (tests/survive.py).
"""

from __future__ import annotations

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
from tests.conftest import Traced
from tests.ports import free_port_range
from tests.ranks import REPO, WORKERS, rank_env
from tests.spans_io import named
from tests.survive import survive

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
    env = {semconv.ENV_SPOOL_DIR: str(out / "spool"), **(env or {})}
    command = [sys.executable, str(SCRIPT), str(out), scenario, *(["--plain"] if plain else [])]
    proc = subprocess.Popen(command, env=rank_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
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


# --- signals that end the process: it ends as plain, and its record says what was open -----------------
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


def signalled(tmp: Path, scenario: str, plain: bool, signum: int = signal.SIGTERM,
              env: dict[str, str] | None = None) -> tuple[Ended, int]:  # fmt: skip
    """Run ``scenario`` until it is ready, send ``signum`` once, and collect how it ended (and its pid)."""
    proc, out = start(tmp, scenario, plain, env=env)
    wait_for(out / "ready", proc)
    first = signal_repeatedly(proc, signum, every_s=0, times=1)
    return end(proc, out, first_signal=first), proc.pid


def ends_alike(tmp: Path, scenario: str, env: dict[str, str] | None = None) -> tuple[Ended, Ended, int]:
    """The scenario plain and instrumented, SIGTERM once each: the same end, as soon after the signal."""
    (plain, _), (instrumented, pid) = (signalled(tmp, scenario, True, env=env),
                                       signalled(tmp, scenario, False, env=env))  # fmt: skip
    assert instrumented.same_as(plain), f"PLAIN\n{plain}\n\nINSTRUMENTED\n{instrumented}"
    assert plain.seconds_after_signal is not None and instrumented.seconds_after_signal is not None
    assert instrumented.seconds_after_signal < plain.seconds_after_signal + 0.5, (plain, instrumented)
    return plain, instrumented, pid


def test_sigterm_during_a_save_ends_the_process_at_once_and_its_record_keeps_the_open_and_the_unexported_saves(
    tmp_path: Path,
) -> None:
    """Three finished saves wait for a collector that never answers, and a fourth is blocked: SIGTERM kills at once
    (no handler: nothing of dcp-otel's runs), and a survivor sends them all, the blocked one as interrupted."""
    plain, instrumented, pid = ends_alike(tmp_path, "term")
    assert plain.returncode == -signal.SIGTERM and plain.seconds_after_signal < 1.0, plain
    spans = survive(tmp_path / "instrumented" / "term" / "0" / "spool", {pid: -signal.SIGTERM})
    saves = named(spans, "dcp.save")
    assert len(saves) == 4 and sum(not s.error for s in saves) == 3  # the finished ones, from the record: none lost
    (hung,) = [s for s in saves if s.error]
    assert hung.status_message == "terminated by SIGTERM during write_data"
    assert hung.attributes[semconv.ATTR_INTERRUPTED] == "SIGTERM"
    (write,) = [s for s in named(spans, "dcp.write_data") if s.error]
    assert write.attributes[semconv.ATTR_END_INFERRED] is True and write.trace_id == hung.trace_id
    (process,) = named(spans, semconv.SPAN_PROCESS)
    assert process.attributes[semconv.ATTR_ENDED_BY] == "SIGTERM" and process.status_message == "terminated by SIGTERM"
    assert semconv.ATTR_RECOVERY_POINT_ID in process.attributes  # the last durable save: step-2


def test_a_rank_hung_before_its_first_checkpoint_ends_at_once_on_sigterm(tmp_path: Path) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port_range(1)), "WORLD_SIZE": "2", "RANK": "0"}
    plain, _, _ = ends_alike(tmp_path, "hung_init", env=env)
    assert plain.returncode == -signal.SIGTERM and plain.seconds_after_signal < 1.0, plain


def test_faulthandler_registered_for_sigterm_dumps_the_stacks_and_the_process_goes_on(tmp_path: Path) -> None:
    plain, instrumented, _ = ends_alike(tmp_path, "faulthandler")
    assert plain.returncode == 0 and "stacks dumped; going on" in plain.stdout and "saved after" in plain.stdout, plain
    stacks = (tmp_path / "instrumented" / "faulthandler" / "0" / "stacks.txt").read_text()
    assert "Thread" in stacks or "Stack" in stacks, stacks  # faulthandler's own dump, in both
    assert len(named(instrumented.spans, "dcp.save")) == 2 and errors(instrumented.spans) == []


def test_no_thread_of_dcp_otels_starts_or_ends_around_checkpoints_after_the_first_starts(
    tmp_path: Path, traced: Traced
) -> None:
    """A faulthandler dump of all threads (registered for SIGTERM or SIGUSR1, to see where a hung job is) can
    crash CPython 3.11+ when a thread starts or ends while it walks them (cpython#116008): the SEGV above. So
    dcp-otel's threads start as the first checkpoint starts and run until uninstrument(); the spool's
    confirmations flush on their own thread instead of a new thread for each."""
    import torch
    import torch.distributed.checkpoint as dcp

    import dcp_otel

    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "first"))  # dcp-otel's threads start with it
    spool = dcp_otel.DCPInstrumentor()._spool
    assert spool is not None
    assert traced.recorder().drain(30) and spool.keep.wait_idle(30)  # (their helpers have started them)
    watchdog, survivor = dcp_otel.DCPInstrumentor().watchdog, spool.survivor._thread
    assert watchdog is not None and watchdog.wait_running(30) and survivor is not None and survivor._started.wait(30)
    ours = {t for t in threading.enumerate() if t.name.startswith("dcp-otel")}
    assert {t.name for t in ours} >= {"dcp-otel-builder", "dcp-otel-watchdog", "dcp-otel-spool-confirm", "dcp-otel-survivor"}
    started: list[str] = []

    def first_call(frame, event, arg):  # type: ignore[no-untyped-def]  # threading's profile hook: a new thread
        started.append(threading.current_thread().name)
        sys.setprofile(None)

    threading.setprofile(first_call)
    try:
        for n in range(3):
            dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / f"sync-{n}"))
            dcp.async_save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / f"async-{n}")).result(timeout=60)
        assert traced.recorder().drain(30) and spool.keep.wait_idle(30)  # built, kept and confirmed: no thread
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    assert [name for name in started if name.startswith("dcp-otel")] == []
    assert {t for t in threading.enumerate() if t.name.startswith("dcp-otel")} == ours


def test_the_applications_other_threads_write_nothing_after_sigterm(tmp_path: Path) -> None:
    signalled_at: dict[bool, float] = {}
    for plain in (True, False):
        proc, out = start(tmp_path, "threads", plain)
        wait_for(out / "ready", proc)
        signalled_at[plain] = time.time()
        first = signal_repeatedly(proc, signal.SIGTERM, every_s=0, times=1)
        ended = end(proc, out, first_signal=first)
        assert ended.returncode == -signal.SIGTERM and ended.seconds_after_signal is not None
        ticks = [float(t) for t in (out / "files" / "ticks.txt").read_text().split()]
        late = [t for t in ticks if t > signalled_at[plain] + 0.05]  # (a line being written as the signal came)
        assert ticks and late == [], (plain, len(late))  # it was 58 lines with dcp-otel's SIGTERM ending


def test_sigterm_during_an_async_upload_leaves_the_checkpoint_as_incomplete_as_plain(tmp_path: Path) -> None:
    plain, instrumented, pid = ends_alike(tmp_path, "async_upload")
    assert plain.returncode == -signal.SIGTERM and "files/step1/.metadata" not in plain.files, plain
    assert "step0/.metadata" in plain.files  # the files are the same, instrumented (same_as): step1 incomplete
    spans = survive(tmp_path / "instrumented" / "async_upload" / "0" / "spool", {pid: -signal.SIGTERM})
    (upload,) = named(spans, semconv.SPAN_ASYNC_UPLOAD)
    assert upload.error and upload.attributes[semconv.ATTR_INTERRUPTED] == "SIGTERM"
    (save,) = [s for s in named(spans, "dcp.async_save") if s.error]
    assert save.status_message == "terminated by SIGTERM during write_data", save.status_message


def test_uvloop_imported_before_instrument_ends_at_once_on_sigterm(tmp_path: Path) -> None:
    plain, _, _ = ends_alike(tmp_path, "uvloop")
    assert plain.returncode == -signal.SIGTERM and plain.seconds_after_signal < 1.0, plain


def test_a_one_shot_timeout_handlers_exception_is_never_swallowed_by_dcp_otel(tmp_path: Path) -> None:
    """A SIGALRM handler that restores the previous disposition and raises TimeoutError, armed around
    ``get_model_state_dict`` at varying delays, 240 times: dcp-otel swallows none of those that land in its code
    (19 to 26 were, logged as "failed to detach a DCP call's context"), and none leaves anything behind in it:
    no call open, no operation current, none open in the record (one or two were, each time; CI once saw the
    record's 64 slots overrun and said so). Where they land is timing: torch's own code may lose one, plain as
    instrumented; ``test_signal_exceptions.py`` and ``test_cut_short.py`` land one in dcp-otel's code for sure."""
    plain, instrumented = both(tmp_path, "alarm")
    assert plain.returncode == 0 and "alarm loop done" in plain.stdout, plain
    counts = json.loads((tmp_path / "instrumented" / "alarm" / "0" / "alarms.json").read_text())
    assert counts["fired"] > 20, counts  # (the alarms did land: about 100 of 240 on this machine)
    assert counts["dcp_otel_problems"] == {"open_spans": 0}, counts  # none taken for ours, none open or evicted
    assert counts["left"] == {"operation_current": False, "record_unbuilt": 0}, counts
    assert "dcp_otel" not in instrumented.stderr and "dcp-otel" not in instrumented.stderr, instrumented.stderr[-2000:]
    last = max((s for s in instrumented.spans if s.name == "dcp.get_model_state_dict"), key=lambda s: s.start_ns)
    in_its_trace = [s.name for s in instrumented.spans if s.trace_id == last.trace_id]
    assert in_its_trace.count("dcp.get_model_state_dict") == 1, in_its_trace  # the call after them all: its own trace


def test_forked_children_that_save_and_end_normally_leave_no_record_and_no_death(tmp_path: Path) -> None:
    """A ``multiprocessing`` fork child ends by ``os._exit`` (no ``atexit``), a plain fork child by ``sys.exit``
    (the parent's ``atexit`` hooks, inherited): each saved, so each had a record. Both end normally, so the
    parent, which outlives them with its survivor, must report no death, and their saves reach the exporter."""
    plain, instrumented = both(tmp_path, "forked")
    assert plain.returncode == 0 and "mp child exited 0" in plain.stdout and "fork child exited 0" in plain.stdout
    assert errors(instrumented.spans) == [], errors(instrumented.spans)
    assert len(named(instrumented.spans, semconv.SPAN_PROCESS)) == 1  # the parent's own life; no child's death
    saved = sorted(s.attributes[semconv.ATTR_CHECKPOINT_ID].rsplit("/", 1)[-1] for s in named(instrumented.spans, "dcp.save"))
    assert saved == ["fork-child", "mp-child", "parent-after", "parent-before"], saved
    spool = tmp_path / "instrumented" / "forked" / "0" / "spool"
    assert sorted(p.name for p in spool.iterdir() if p.is_dir()) == [], "records left behind"


def test_a_rank_of_torch_multiprocessing_spawn_stopped_in_a_save_is_reported_by_its_parent(tmp_path: Path) -> None:
    """Lightning's ``ddp_spawn``: ranks started by ``mp.spawn``. SIGTERM to rank 1 in ``write_data``: ``spawn``
    ends the job as plain, and the parent, outliving its ranks, sends what rank 1 had open."""
    ended: dict[bool, Ended] = {}
    for plain in (True, False):
        proc, out = start(tmp_path, "spawn", plain, env={"SPAWN_PORT": str(free_port_range(1))})
        wait_for(out / "ready", proc)
        os.kill(int((out / "rank1.pid").read_text()), signal.SIGTERM)
        ended[plain] = end(proc, out)
    assert ended[False].same_as(ended[True]), f"{ended[True]}\n\n{ended[False]}"
    assert ended[True].returncode == 0 and "spawn: rank 1 ended with -15" in ended[True].stdout, ended[True]
    (write,) = [s for s in named(ended[False].spans, "dcp.write_data") if s.error]
    assert write.attributes[semconv.ATTR_RANK] == 1
    assert write.status_message == "terminated by SIGTERM during write_data", write.status_message


def test_sigterm_to_a_rank_waiting_in_a_gloo_collective_ends_it_at_once_with_the_collective_on_record(
    tmp_path: Path,
) -> None:
    """Two gloo ranks; rank 1 hangs in write_data, rank 0 waits for it in DCP's collective (blocked in C, where no
    Python handler would run); its spans go to an exporter that hangs for good: SIGTERM to rank 0."""
    plain, _ = gloo_job(tmp_path, plain=True)
    instrumented, pid = gloo_job(tmp_path, plain=False)
    assert instrumented.same_as(plain) and plain.returncode == -signal.SIGTERM, f"{plain}\n\n{instrumented}"
    assert instrumented.seconds_after_signal is not None and instrumented.seconds_after_signal < 1.0
    assert named(instrumented.spans, semconv.SPAN_STALL)  # exported while it hung, before the exporter hung
    spans = survive(tmp_path / "instrumented" / "gloo" / "0" / "spool", {pid: -signal.SIGTERM})
    ended = [s for s in spans if s.error and s.name != semconv.SPAN_PROCESS]
    assert ended and all(s.status_message == "terminated by SIGTERM while waiting in gather_object (_DistWrapper.all_reduce)"
                         for s in ended), errors(spans)  # fmt: skip
    (collective,) = [s for s in ended if s.name.startswith(semconv.SPAN_COLLECTIVE_PREFIX)]
    assert collective.stacktrace and "gather_object" in collective.stacktrace  # the watchdog's stall report's stack


def gloo_job(tmp: Path, plain: bool) -> tuple[Ended, int]:
    """Two gloo ranks; rank 1 hangs in write_data, rank 0 waits for it in DCP's collective; SIGTERM to rank 0."""
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
        end(rank1, out1)
    return ended0, rank0.pid


def test_instrument_changes_no_signal_disposition_and_never_takes_the_wakeup_fd(tmp_path: Path) -> None:
    """For every signal, ``signal.getsignal`` and the wakeup fd are what they were, instrumented, after a save (the
    watchdog and the survivor running), and after ``uninstrument()``; a forked child finds the same."""
    script = f"""
import os, signal, sys, torch, dcp_otel
import torch.distributed.checkpoint as dcp
def state():
    fd = signal.set_wakeup_fd(-1)
    if fd != -1:
        signal.set_wakeup_fd(fd)
    return {{int(s): repr(signal.getsignal(s)) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)}}, fd
before = state()
dcp_otel.instrument()
after_instrument = state()
dcp.save({{"w": torch.ones(4)}}, checkpoint_id={str(tmp_path / "ckpt")!r})
after_save = state()
pid = os.fork()
if pid == 0:
    os._exit(0 if state() == before else 1)
child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
dcp_otel.uninstrument()
print(before == after_instrument, before == after_save, child, state() == before)
"""
    done = subprocess.run([sys.executable, "-c", script], env=rank_env(**{semconv.ENV_SPOOL_DIR: str(tmp_path / "spool")}),
                          capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "True", "0", "True"], done.stdout
