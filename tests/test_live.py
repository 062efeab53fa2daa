"""What is open now, in one process: the in-progress metrics, stall reports, and the ending of open calls.

The multi-rank jobs (a real torchrun, a rank hung for good) are in test_hung_checkpoints.py; here, a
save blocked on a thread of this process, the watchdog driven tick by tick with chosen clocks, and
scripts stopped by a signal (tests/workers/signal_script.py).
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry

import dcp_otel
from dcp_otel import semconv
from dcp_otel.live.progress import FLOOR_S, NO_HISTORY_S, StallPolicy
from dcp_otel.live.watchdog import Watchdog
from dcp_otel.otlp_file import FileSpan, read_spans
from dcp_otel.report.model import checkpoints
from dcp_otel.tracing.records import DurationHistory
from tests.conftest import Traced
from tests.ranks import REPO, WORKERS, rank_env
from tests.spans_io import named


class BlockedWriter(dcp.FileSystemWriter):
    """A writer whose ``write_data`` waits until released, saying when it has started waiting."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.entered = threading.Event()
        self.release = threading.Event()

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.release.wait(timeout=120)
        return super().write_data(plan, planner)


@pytest.fixture
def blocked_save(tmp_path: Path) -> Iterator[BlockedWriter]:
    """A save on its own thread, inside write_data until the test releases it (released at the end regardless)."""
    writer = BlockedWriter(str(tmp_path / "blocked"))
    thread = threading.Thread(target=dcp.save, args=({"w": torch.ones(8)},), kwargs={"storage_writer": writer},
                              name="trainer")  # fmt: skip
    thread.start()
    assert writer.entered.wait(60)
    yield writer
    writer.release.set()
    thread.join(60)


def in_progress(registry: CollectorRegistry) -> dict[tuple[str, str, str], float]:
    return {(s.labels["operation"], s.labels["step"], s.labels["rank"]): s.value
            for m in registry.collect() if m.name == semconv.METRIC_IN_PROGRESS for s in m.samples}  # fmt: skip


def pushed(reader: InMemoryMetricReader, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    data = reader.get_metrics_data()
    return {tuple(sorted(p.attributes.items())): p.value
            for rm in (data.resource_metrics if data else ()) for sm in rm.scope_metrics for m in sm.metrics
            if m.name == name for p in m.data.data_points}  # fmt: skip


# --- live progress ------------------------------------------------------------------------------
def test_an_open_save_is_in_progress_in_its_step_while_it_runs_and_gone_once_it_ends(
    tmp_path: Path, provider: tuple
) -> None:
    tracer, _ = provider
    registry, reader = CollectorRegistry(), InMemoryMetricReader()
    meters = MeterProvider([reader])
    dcp_otel.instrument(tracer_provider=tracer, registry=registry, meter_provider=meters)
    writer = BlockedWriter(str(tmp_path / "c"))
    thread = threading.Thread(target=dcp.save, args=({"w": torch.ones(8)},), kwargs={"storage_writer": writer})
    try:
        assert in_progress(registry) == {}
        thread.start()
        assert writer.entered.wait(60)
        scraped = in_progress(registry)
        assert list(scraped) == [("save", "write_data", "0")]
        assert abs(scraped["save", "write_data", "0"] - time.time()) < 60  # Unix seconds
        threshold = {s.labels["operation"]: s.value for m in registry.collect()
                     if m.name == semconv.METRIC_STALL_THRESHOLD for s in m.samples}  # fmt: skip
        assert threshold == {"save": NO_HISTORY_S}  # no save has finished in this process yet
        otel = pushed(reader, semconv.IN_PROGRESS.otel)
        assert list(otel) == [(("operation", "save"), ("rank", "0"), ("step", "write_data"))]
        writer.release.set()
        thread.join(60)
        assert dcp_otel.flush(timeout_s=30)
        assert in_progress(registry) == {}
        assert pushed(reader, semconv.IN_PROGRESS.otel) == {}
    finally:
        writer.release.set()
        dcp_otel.uninstrument()
        meters.shutdown()


def test_an_async_save_shows_its_background_step_after_async_save_returned(tmp_path: Path, traced: Traced) -> None:
    writer = BlockedWriter(str(tmp_path / "a"))
    future = dcp.async_save({"w": torch.ones(8)}, storage_writer=writer)
    try:
        assert writer.entered.wait(60)
        assert list(in_progress(traced.registry)) == [("async_save", "write_data", "0")]
    finally:
        writer.release.set()
    future.result(timeout=60)
    assert dcp_otel.flush(timeout_s=30)
    assert in_progress(traced.registry) == {}


# --- stalls ---------------------------------------------------------------------------------------
def test_a_stall_is_reported_at_its_threshold_and_again_at_two_and_four_times_it(
    traced: Traced, blocked_save: BlockedWriter, caplog: pytest.LogCaptureFixture
) -> None:
    """Driven tick by tick with chosen clocks (a watchdog of its own, never started, beside the instrumentor's)."""
    instrumentor = dcp_otel.DCPInstrumentor()
    assert instrumentor.watchdog is not None and instrumentor.watchdog.wait_running(60)  # started by the save
    live = instrumentor.watchdog.live
    ticks = Watchdog(live, instrumentor.watchdog.reporter)
    (progress,) = live.progress()
    assert progress.step == "write_data" and progress.thread_id is not None
    threshold = live.policy.threshold("save")
    assert threshold == NO_HISTORY_S
    since = progress.since_ns
    with caplog.at_level(logging.WARNING, logger="dcp_otel"):
        for age_s in (threshold - 1, threshold + 1, 1.5 * threshold, 2 * threshold + 1, 3 * threshold, 4 * threshold + 1):
            ticks.check(now_ns=since + int(age_s * 1e9))
    assert instrumentor.watchdog.reporter is not None and instrumentor.watchdog.reporter.wait_exported(30)
    assert instrumentor.watchdog.reporter.reported == 3 and "stall_report_error" not in dcp_otel.diagnostics()
    stalls = sorted(named(traced.spans(), semconv.SPAN_STALL), key=lambda s: s.attributes[semconv.ATTR_STALL_REPORT])
    assert [s.attributes[semconv.ATTR_STALL_REPORT] for s in stalls] == [1, 2, 3]
    assert [round(s.attributes[semconv.ATTR_STALL_SECONDS]) for s in stalls] == [
        round(threshold + 1), round(2 * threshold + 1), round(4 * threshold + 1)]  # fmt: skip
    first = stalls[0]
    assert first.attributes[semconv.ATTR_STEP] == "write_data"
    assert first.attributes[semconv.ATTR_STALL_THRESHOLD] == threshold
    assert first.attributes[semconv.ATTR_THREAD_NAME] == "trainer"
    assert "self.release.wait(timeout=120)" in first.attributes[semconv.ATTR_CODE_STACKTRACE]
    assert first.attributes[semconv.ATTR_CHECKPOINT_ID].endswith("blocked")
    # Under the open write_data, whose span does not exist yet: its id was chosen when it started.
    assert first.parent_id == format(progress.call.span_id, "016x")
    # Counted once per stall; one warning per report, naming the rank, step, seconds and the top frames.
    assert traced.registry.get_sample_value(f"{semconv.METRIC_STALLS}_total",
                                            {"operation": "save", "step": "write_data", "rank": "0"}) == 1  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if "without progress" in r.getMessage()]
    assert len(lines) == 3
    assert lines[0].startswith(f"dcp_otel: rank 0 has been in write_data of save {blocked_save.path}")
    assert f"for {threshold + 1:.1f} s without progress" in lines[0] and "write_data (test_live.py:" in lines[0]


def test_progress_resets_the_stall_clock(traced: Traced, blocked_save: BlockedWriter) -> None:
    live = dcp_otel.DCPInstrumentor().watchdog.live  # type: ignore[union-attr]
    ticks = Watchdog(live, dcp_otel.DCPInstrumentor().watchdog.reporter)  # type: ignore[union-attr]
    (progress,) = live.progress()
    ticks.check(now_ns=progress.since_ns + int((NO_HISTORY_S - 1) * 1e9))
    assert ticks.reporter is not None and ticks.reporter.wait_exported(30)
    assert not named(traced.spans(), semconv.SPAN_STALL)


def test_stall_thresholds_come_from_the_operations_own_history_with_a_floor() -> None:
    history = DurationHistory()
    auto = StallPolicy(None, history)
    assert auto.threshold("save") == NO_HISTORY_S  # nothing finished yet
    history.add("save", 2.0)
    assert auto.threshold("save") == FLOOR_S  # 3 x 2 s is under the floor
    history.add("save", 100.0)
    history.add("load", 500.0)
    assert auto.threshold("save") == 300.0  # 3 x the slowest of its own recent runs
    assert auto.threshold("async_save") == NO_HISTORY_S  # each operation its own history
    for _ in range(20):
        history.add("save", 1.0)  # the slow run falls out of the last 20
    assert auto.threshold("save") == FLOOR_S
    assert StallPolicy(7.5, history).threshold("save") == 7.5
    off = StallPolicy(0.0, history)
    assert off.threshold("save") is None and not off.enabled


@pytest.mark.parametrize("value, expected", [("auto", None), ("", None), ("off", 0.0), ("0", 0.0), ("2.5", 2.5),
                                             ("-1", None), ("soon", None)])  # fmt: skip
def test_the_stall_threshold_variable_is_auto_off_or_seconds(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: float | None
) -> None:
    from dcp_otel.config import InstrumentOptions

    monkeypatch.setenv(semconv.ENV_STALL_AFTER_S, value)
    assert InstrumentOptions.from_kwargs({}).stall_after_s == expected
    with pytest.raises(ValueError, match="stall_after_s"):
        InstrumentOptions.from_kwargs({"stall_after_s": -3})


# --- the process ending with calls open -------------------------------------------------------------
def run_script(tmp: Path, mode: str, *, send: signal.Signals | None = None, plain: bool = False,
               env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], dict, list[FileSpan]]:  # fmt: skip
    """Run signal_script.py in ``mode``; with ``send``, signal it once its save is blocked."""
    out = tmp / ("plain" if plain else "traced") / mode
    out.mkdir(parents=True)
    command = [sys.executable, str(WORKERS / "signal_script.py"), str(out), mode, *(["--plain"] if plain else [])]
    proc = subprocess.Popen(command, env=rank_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)  # fmt: skip
    try:
        if send is not None:
            waited = threading.Event()
            for _ in range(600):  # the script writes "ready" once its save is blocked (polled, bounded: 60 s)
                if (out / "ready").exists() or proc.poll() is not None:
                    break
                waited.wait(0.1)
            assert (out / "ready").exists(), proc.communicate(timeout=30)
            proc.send_signal(send)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    done = subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
    result = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else {}
    spans_file = out / "spans.jsonl"
    spans = read_spans([spans_file]) if spans_file.exists() and spans_file.stat().st_size else []
    return done, result, spans


def test_sigint_interrupts_the_save_and_the_next_save_is_a_checkpoint_of_its_own(tmp_path: Path) -> None:
    _, plain, _ = run_script(tmp_path, "int", send=signal.SIGINT, plain=True)
    done, result, spans = run_script(tmp_path, "int", send=signal.SIGINT)
    assert done.returncode == 0, done.stderr[-3000:]
    # What the caller gets is torch's own: the step's KeyboardInterrupt, wrapped as it always is.
    assert (result["raised"], result["cause"]) == (plain["raised"], plain["cause"]) == (
        "CheckpointException", ["KeyboardInterrupt"])
    assert result["after"] == plain["after"] == "saved"
    saves = {s.attributes[semconv.ATTR_CHECKPOINT_ID].rsplit("/", 1)[-1]: s for s in named(spans, "dcp.save")}
    # The save ends by the exception that unwound it, as the caller saw it: not by the signal, and not later.
    hung = saves["hung"]
    assert hung.status_message == "CheckpointException: ranks [0] failed; rank 0: KeyboardInterrupt"
    assert semconv.ATTR_INTERRUPTED not in hung.attributes
    (write,) = [s for s in named(spans, "dcp.write_data") if s.trace_id == hung.trace_id]
    assert write.error and "KeyboardInterrupt" in write.status_message
    after = saves["after"]
    assert not after.error and after.trace_id != hung.trace_id
    roots = {s.trace_id: s for s in named(spans, semconv.SPAN_CHECKPOINT)}
    assert after.parent_id == roots[after.trace_id].span_id  # a trace of its own, not a step of the interrupted one
    assert "unmatched_event" not in result["diagnostics"] and result["diagnostics"]["open_spans"] == 0


def test_an_applications_own_sigterm_handler_stays_in_charge(tmp_path: Path) -> None:
    done, result, _ = run_script(tmp_path, "user", send=signal.SIGTERM)
    assert done.returncode == 0, done.stderr[-3000:]
    assert result["user_handler_saw"] == [signal.SIGTERM]
    assert result["handlers_changed"] == [] and result["wakeup_fd_taken"] is False  # dcp-otel takes neither


def test_calls_still_open_at_exit_end_as_interrupted_at_exit(tmp_path: Path) -> None:
    done, _, spans = run_script(tmp_path, "exit")
    assert done.returncode == 0, done.stderr[-3000:]
    (save,) = named(spans, "dcp.save")
    assert save.status_message == "interrupted at exit during write_data"
    assert save.attributes[semconv.ATTR_INTERRUPTED] == semconv.INTERRUPTED_AT_EXIT


# --- the report -------------------------------------------------------------------------------------
def test_a_rank_killed_with_nothing_but_its_stall_reports_is_unfinished_with_no_end_recorded() -> None:
    """SIGKILL leaves no end: the stall spans a rank exported while it hung are all that says where it was."""
    def span(name: str, rank: int, span_id: str, parent: str, start: int, end: int, **attributes: object) -> FileSpan:
        return FileSpan("t" * 32, span_id, parent, name, start, end, False, "",
                        {semconv.ATTR_OPERATION: "save", semconv.ATTR_RANK: rank, **attributes})  # fmt: skip

    stack = "Stack (most recent call last):\n  File \"train.py\", line 7, in write_data\n    mount.read()\n"
    spans = [
        span("dcp.stall", 1, "a" * 16, "b" * 16, 10, 10, **{semconv.ATTR_STEP: "write_data",
             semconv.ATTR_STALL_SECONDS: 300.0, semconv.ATTR_CODE_STACKTRACE: stack}),
        span("dcp.stall", 0, "c" * 16, "d" * 16, 11, 11, **{semconv.ATTR_STEP: semconv.STEP_NONE,
             semconv.ATTR_STALL_SECONDS: 299.0, semconv.ATTR_STALL_COLLECTIVE: "gather_object",
             semconv.ATTR_STALL_COLLECTIVE_CALLER: "_DistWrapper.all_reduce"}),
    ]  # fmt: skip
    (ckpt,) = checkpoints(spans)
    assert [(u.rank, u.step, u.cause, u.waiting_in) for u in ckpt.unfinished] == [
        (1, "write_data", None, None), (0, semconv.STEP_NONE, None, "gather_object (_DistWrapper.all_reduce)")]
    assert ckpt.unfinished[0].description == "no end recorded; last reported stalled in write_data after 300.0 s"
    assert ckpt.unfinished[0].stack == stack


def test_the_state_dict_api_is_in_progress_too(traced: Traced) -> None:
    """``get_model_state_dict`` (which torch does not log; dcp-otel records it): a module whose state dict
    takes for ever shows the call and its worker step as where the rank is."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    entered, release = threading.Event(), threading.Event()

    class Slow(torch.nn.Linear):
        def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            entered.set()
            release.wait(timeout=120)
            return super().state_dict(*args, **kwargs)

    thread = threading.Thread(target=get_model_state_dict, args=(Slow(4, 4),))
    thread.start()
    try:
        assert entered.wait(60)
        assert list(in_progress(traced.registry)) == [("get_model_state_dict", "_get_model_state_dict", "0")]
    finally:
        release.set()
        thread.join(60)
    assert dcp_otel.flush(timeout_s=30)
    assert in_progress(traced.registry) == {}
