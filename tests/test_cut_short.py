"""A DCP record whose handling an exception cut short is made whole: a start undone, an end finished.

A signal handler's exception (a one-shot SIGALRM timeout's) comes out wherever the main thread is, dcp-otel's
own bookkeeping of a call included. It reaches the application as without dcp-otel (test_signal_exceptions.py);
here, what it leaves behind in dcp-otel: nothing. After each, no call is open, the thread's context is the one
it had, the process's record holds no open operation (a survivor would name it as where a later death
happened), and the next checkpoint is a trace of its own, exported. Each test makes the signal land at one
chosen place, deterministically: the signal is sent from code that runs there.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from opentelemetry import context as context_api
from opentelemetry import trace
from torch.distributed.checkpoint import logger as torch_logger

from dcp_otel import _selftelemetry, semconv
from dcp_otel.spool import layout
from dcp_otel.spool.reader import read_record
from dcp_otel.tracing import call_ends, records, tracker
from dcp_otel.tracing.cut_short import LEFT_BEHIND
from dcp_otel.tracing.operations import OPERATION_KEY
from tests.conftest import Traced

STATE = {"w": torch.arange(8.0)}


def _one_shot(signum: int, frame: Any) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a timeout's way: the previous disposition back, then raise
    raise TimeoutError("one shot")


@pytest.fixture
def alarm() -> Iterator[Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """``alarm(fn)``: ``fn`` that, the first time it is called, runs and then has SIGALRM's one-shot handler
    raise ``TimeoutError`` out of it (the handler runs at the next instruction after the signal is sent)."""
    previous = signal.signal(signal.SIGALRM, _one_shot)
    fired = threading.Event()

    def then_alarm(fn: Callable[..., Any]) -> Callable[..., Any]:
        def called(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            if not fired.is_set() and threading.current_thread() is threading.main_thread():
                fired.set()
                os.kill(os.getpid(), signal.SIGALRM)
            return result

        return called

    yield then_alarm
    signal.signal(signal.SIGALRM, previous)


def record_of_this_process() -> Any:
    spool = Path(os.environ[semconv.ENV_SPOOL_DIR])
    (name,) = [n for n in os.listdir(spool) if layout.parse_name(n) and not layout.parse_name(n).state]  # type: ignore[union-attr]
    return read_record(str(spool / name))


def assert_nothing_left(traced: Traced) -> None:
    """No call open, the thread's context its own again, no operation open in the record (once built)."""
    assert traced.recorder().open_count() == 0
    assert traced.recorder().lane is None  # (no state dict conversion holds the per-key lane)
    assert context_api.get_value(OPERATION_KEY) is None
    assert trace.get_current_span() is trace.INVALID_SPAN
    traced.provider.force_flush()  # (builds what is queued first)
    assert record_of_this_process().unbuilt_ops() == []


def assert_next_save_is_its_own_trace(traced: Traced, tmp_path: Path) -> None:
    before = {s.trace_id for s in traced.spans()}
    dcp.save(STATE, checkpoint_id=str(tmp_path / "next"))
    (save,) = [s for s in traced.spans() if s.name == "dcp.save" and s.trace_id not in before]
    assert save.status != "ERROR" and save.attributes[semconv.ATTR_CHECKPOINT_ID].endswith("next")
    assert_nothing_left(traced)


def test_a_start_cut_short_as_its_context_is_attached_never_runs_and_leaves_nothing(
    traced: Traced, tmp_path: Path, alarm: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Right after the save's context is attached, before dcp-otel keeps the token that detaches it: the save
    never runs (the exception comes out where torch logs its start), its context is taken back all the same."""
    with monkeypatch.context() as patched, pytest.raises(TimeoutError, match="one shot"):
        patched.setattr(tracker, "light_attach", alarm(tracker.light_attach))
        dcp.save(STATE, checkpoint_id=str(tmp_path / "cut"))
    assert not (tmp_path / "cut" / ".metadata").exists()  # it never ran
    assert_nothing_left(traced)
    assert [s.name for s in traced.spans()] == []  # no span for a call that never ran
    assert_next_save_is_its_own_trace(traced, tmp_path)


def test_an_end_cut_short_after_its_context_is_detached_is_finished_and_built_once(
    traced: Traced, tmp_path: Path, alarm: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between detaching the save's context and handing the save to the builder: the save ran (its checkpoint
    is whole), its span ends and is exported once."""
    with monkeypatch.context() as patched, pytest.raises(TimeoutError, match="one shot"):
        patched.setattr(call_ends, "light_detach", alarm(call_ends.light_detach))  # (the operation call's end)
        dcp.save(STATE, checkpoint_id=str(tmp_path / "cut"))
    assert (tmp_path / "cut" / ".metadata").exists()
    assert_nothing_left(traced)
    saves = [s for s in traced.spans() if s.name == "dcp.save"]
    assert len(saves) == 1 and saves[0].attributes[semconv.ATTR_CHECKPOINT_ID].endswith("cut")
    assert_next_save_is_its_own_trace(traced, tmp_path)


def test_an_operation_complete_but_not_handed_to_the_builder_is_handed_on_once(
    traced: Traced, tmp_path: Path, alarm: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Right after the save's last part is counted (the operation complete), before it goes to the builder."""
    with monkeypatch.context() as patched, pytest.raises(TimeoutError, match="one shot"):
        patched.setattr(records.Operation, "part_done", alarm(records.Operation.part_done))
        dcp.save(STATE, checkpoint_id=str(tmp_path / "cut"))
    assert_nothing_left(traced)
    saves = [s for s in traced.spans() if s.name == "dcp.save"]
    assert len(saves) == 1 and saves[0].status != "ERROR"
    assert_next_save_is_its_own_trace(traced, tmp_path)


def test_an_async_save_cut_short_as_its_upload_opens_leaves_no_upload_open(
    traced: Traced, tmp_path: Path, alarm: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Right after the upload is counted open, before async_save hands the future its callback: the upload is
    ended with the exception (nothing else would end it: every flush waited out its timeout)."""
    import dcp_otel
    from dcp_otel.tracing.uploads import InFlight

    with monkeypatch.context() as patched, pytest.raises(BaseException) as raised:  # noqa: PT011 - torch may wrap it
        patched.setattr(InFlight, "started", alarm(InFlight.started))
        dcp.async_save(STATE, checkpoint_id=str(tmp_path / "cut")).result()
    assert "one shot" in repr(raised.value) or "one shot" in repr(getattr(raised.value, "failures", ""))
    assert dcp_otel.flush(timeout_s=10)
    assert traced.recorder().uploads.open_calls() == []
    assert_nothing_left(traced)
    assert_next_save_is_its_own_trace(traced, tmp_path)


def test_a_state_dict_call_cut_short_as_it_ends_is_finished(
    traced: Traced, tmp_path: Path, alarm: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dcp-otel's own wrapper of a call torch does not log: the exception comes out as the wrapper reads the
    clock for the call's end, before the end reaches the recorder. The call ran and returned: its span ends."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from dcp_otel.attach import unlogged_calls

    real = unlogged_calls.time.time_ns
    alarmed = alarm(real)

    class Clock:
        @staticmethod
        def time_ns() -> int:
            caller = sys._getframe(1)
            ending = caller.f_code.co_name == "_end" and caller.f_locals["record"]["func_name"] == "get_model_state_dict"
            return alarmed() if ending else real()  # type: ignore[no-any-return]

    model = torch.nn.Linear(4, 4)
    with monkeypatch.context() as patched, pytest.raises(TimeoutError, match="one shot"):
        patched.setattr(unlogged_calls, "time", Clock)
        get_model_state_dict(model)
    assert_nothing_left(traced)
    (call,) = [s for s in traced.spans() if s.name == "dcp.get_model_state_dict"]
    assert call.status != "ERROR" and call.end_ns > call.start_ns  # it returned; the handler raised as it did
    assert_next_save_is_its_own_trace(traced, tmp_path)


def test_an_operation_whose_end_never_came_ends_failed_when_its_thread_starts_the_next(
    traced: Traced, tmp_path: Path
) -> None:
    """What no ``try`` reaches: an exception out of a function's first instruction (the tap's, as torch logs a
    save's end) loses the end. Here the end is just never told: the frame that ran the save returns without it.
    The thread's next save finds the call left behind, ends it failed, and starts a trace of its own."""
    tap = torch_logger._dcp_logger
    left = {"func_name": "save", "uuid": uuid.uuid4().hex, "checkpoint_id": str(tmp_path / "left")}

    def save_whose_end_is_lost() -> None:
        tap.feed({**left, "event": "start", "time": 1_700_000_000_000_000_000})

    save_whose_end_is_lost()
    assert traced.recorder().open_count() == 1 and context_api.get_value(OPERATION_KEY) is not None
    dcp.save(STATE, checkpoint_id=str(tmp_path / "next"))
    spans = traced.spans()
    (lost,) = [s for s in spans if s.name == "dcp.save" and s.attributes[semconv.ATTR_CHECKPOINT_ID].endswith("left")]
    (saved,) = [s for s in spans if s.name == "dcp.save" and s.attributes[semconv.ATTR_CHECKPOINT_ID].endswith("next")]
    assert lost.status == "ERROR" and LEFT_BEHIND in (lost.status_description or "")
    assert saved.status != "ERROR" and saved.trace_id != lost.trace_id
    assert_nothing_left(traced)
    assert "recorder_error" not in _selftelemetry.counts()


def test_a_context_still_naming_a_built_operation_does_not_swallow_the_next_save(traced: Traced, tmp_path: Path) -> None:
    """A context captured inside a save and attached again after it ended (an end whose detach an exception
    cut short left it so; a plugin that keeps a context does the same): the next save is a trace of its own."""
    captured: list[context_api.Context] = []

    class Capturing(dcp.FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            captured.append(context_api.get_current())
            return super().write_data(plan, planner)

    dcp.save(STATE, storage_writer=Capturing(str(tmp_path / "first")))
    traced.provider.force_flush()  # (built)
    context_api.attach(captured[0])
    dcp.save(STATE, checkpoint_id=str(tmp_path / "second"))
    saves = {s.attributes[semconv.ATTR_CHECKPOINT_ID][-6:]: s for s in traced.spans() if s.name == "dcp.save"}
    assert saves.keys() == {"/first", "second"} and saves["/first"].trace_id != saves["second"].trace_id
    assert_nothing_left(traced)


def test_a_save_nested_in_a_running_one_still_nests(traced: Traced, tmp_path: Path) -> None:
    """The check for a call left behind never takes a running one for it: a save inside a save's own call
    (a Stateful saving from its state_dict) is a step of the outer save, in its trace."""
    inner_id = str(tmp_path / "inner")

    class SavesInside:
        def state_dict(self) -> dict[str, Any]:
            dcp.save(STATE, checkpoint_id=inner_id, no_dist=True)
            return {"x": torch.ones(2)}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    dcp.save({"s": SavesInside()}, checkpoint_id=str(tmp_path / "outer"))
    spans = traced.spans()
    outer, inner = sorted((s for s in spans if s.name == "dcp.save"), key=lambda s: s.start_ns)
    assert inner.trace_id == outer.trace_id and outer.start_ns < inner.start_ns and inner.end_ns < outer.end_ns
    assert not any(s.status == "ERROR" for s in spans)
    assert_nothing_left(traced)


# --- everywhere: a signal at each place in dcp-otel's own code where Python would run its handler ----------------
class Stateful:
    """A Stateful whose state_dict is a state-dict call (torchtitan's model wrapper's way): a call inside a save."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class RefusingPlanner(dcp.DefaultSavePlanner):
    def create_local_plan(self) -> Any:
        raise ValueError("the planner refuses")


def _scenario(name: str, tmp_path: Path, model: torch.nn.Module) -> Callable[[int], None]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    def run(n: int) -> None:
        if name == "get_model_state_dict":
            get_model_state_dict(model)
        elif name == "save":
            dcp.save(STATE, checkpoint_id=str(tmp_path / f"s{n}"))
        elif name == "save_with_a_state_dict_call_inside":
            dcp.save({"m": Stateful(model), "w": STATE["w"]}, checkpoint_id=str(tmp_path / f"n{n}"))
        elif name == "failing_save":
            dcp.save(STATE, checkpoint_id=str(tmp_path / f"f{n}"), planner=RefusingPlanner())
        else:
            dcp.async_save(STATE, checkpoint_id=str(tmp_path / f"a{n}")).result()

    return run


def _dcp_otels(frame: Any) -> bool:
    """A frame of dcp-otel's code: its files, the tap's ``debug`` and ``error`` (under logging's file name), and the
    standard library's ``threading`` entered from them (an ``Event.set`` on the training thread had a lock that a
    handler's exception at its ``__enter__``'s return left held for good: found by a review, not by this test as it
    was)."""
    code = frame.f_code
    if "/dcp_otel/" in code.co_filename or code.co_name.startswith("dcp_otel_logger_tap_"):
        return True
    if not code.co_filename.endswith("threading.py"):
        return False
    caller = frame.f_back
    while caller is not None and caller.f_code.co_filename.endswith("threading.py"):
        caller = caller.f_back
    return caller is not None and "/dcp_otel/" in caller.f_code.co_filename


def _alarm_at(n: int, run: Callable[[], None]) -> tuple[bool, BaseException | None, int]:
    """Run ``run`` with SIGALRM's one-shot handler made to run at the ``n``-th place in dcp-otel's code (``_dcp_otels``) where
    Python runs a pending handler on the main thread: a function's first instruction (the profiler's "call")
    and the check after a call into C returns ("c_return"). Whether it fired, what ``run`` raised, and how many
    such places it passed."""
    seen = [0]
    fired = [False]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_return") and _dcp_otels(frame):
            seen[0] += 1
            if seen[0] == n:
                sys.setprofile(None)
                fired[0] = True
                signal.raise_signal(signal.SIGALRM)  # its handler runs right here: what it raises comes out here

    previous = signal.signal(signal.SIGALRM, _one_shot)
    sys.setprofile(profile)
    try:
        run()
        raised = None
    except BaseException as exc:  # noqa: BLE001 - the test looks at what reached the application (a failing save too)
        raised = exc
    finally:
        sys.setprofile(None)
        signal.signal(signal.SIGALRM, previous)
    return fired[0], raised, seen[0]


TRIES_AT_THE_END = 3
"""Runs that stop short of a place before the sweep ends there. A run passes a few places more or fewer where timing
has it: a ``Condition.notify`` of dcp-otel's releases a waiter only while a thread waits on it (two places), and the
call's end wakes the survivor only when its periodic look fell inside the call (``Survivor.nudge``). Counting the
places once, up front, left the sweep's last places beyond the runs that followed (CI: 183 of 188 landed)."""


def _sweep(run: Callable[[int], None], after: Callable[[int, bool, BaseException | None], None]) -> int:
    """Every place of ``run``, one after another, from the first up to where ``TRIES_AT_THE_END`` runs in a row
    end before it; ``after(runs, fired, raised)`` after each run. How many places it swept."""
    _alarm_at(10**9, functools.partial(run, 0))  # (a first run starts dcp-otel's threads; a failing save fails)
    n, short, runs = 1, 0, 0
    while short < TRIES_AT_THE_END:
        runs += 1
        # A lock left held deadlocks the caller: the whole run ends with every thread's stack, not a silent hang.
        faulthandler.dump_traceback_later(120, exit=True)
        try:
            fired, raised, _ = _alarm_at(n, functools.partial(run, runs))
        finally:
            faulthandler.cancel_dump_traceback_later()
        after(runs, fired, raised)
        n, short = (n + 1, 0) if fired else (n, short + 1)
    return n - 1


@pytest.mark.parametrize("scenario", ["get_model_state_dict", "save", "save_with_a_state_dict_call_inside",
                                      "failing_save", "async_save"])  # fmt: skip
def test_a_handlers_exception_at_any_place_in_dcp_otels_code_reaches_the_caller_and_leaves_nothing(
    traced: Traced, tmp_path: Path, scenario: str
) -> None:
    """Every place of one call where Python would run a pending handler, one after another (a deterministic
    stand-in for the timing of a real alarm: the profiler runs the real handler there). Each time the
    handler's TimeoutError reaches the caller (or torch's CheckpointException carrying it), and afterwards
    nothing is left: no call open, the context clean, no record slot held, nothing counted as dcp-otel's own
    problem, and the next save is one whole trace."""
    model = torch.nn.Linear(4, 4)
    recorder = traced.recorder()
    cleans = []

    def after(runs: int, fired: bool, raised: BaseException | None) -> None:
        if fired:
            failures = list(getattr(raised, "failures", {}).values())
            assert isinstance(raised, TimeoutError) or any("one shot" in repr(f) for f in failures), (runs, repr(raised))
        clean = tmp_path / f"clean{runs}"
        dcp.save(STATE, checkpoint_id=str(clean))
        cleans.append(runs)
        assert recorder.wait_for_uploads(10), runs
        traced.provider.force_flush()
        assert recorder.open_count() == 0, (runs, [c.func_name for c in recorder._open.values()])
        assert context_api.get_value(OPERATION_KEY) is None and trace.get_current_span() is trace.INVALID_SPAN, runs
        assert not recorder._stack(), runs
        assert all(op is None for op in recorder.record._slot_ops), runs
        assert _selftelemetry.counts() == {}, (runs, _selftelemetry.counts())

    count = _sweep(_scenario(scenario, tmp_path, model), after)
    assert count > 100, count  # (all of dcp-otel's work in one call: a few hundred places)
    saves = [s for s in traced.spans() if s.name == "dcp.save" and "clean" in s.attributes[semconv.ATTR_CHECKPOINT_ID]]
    assert len(saves) == len(cleans) >= count + TRIES_AT_THE_END and all(s.status != "ERROR" for s in saves)
    assert record_of_this_process().unbuilt_ops() == []
