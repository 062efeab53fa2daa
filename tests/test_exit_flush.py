"""Spans are flushed at interpreter exit, and a hung exporter cannot hold the exit (real processes)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from dcp_otel import semconv
from dcp_otel.spool.delivery import Delivery
from dcp_otel.tracing.flushing import BoundedFlush
from tests.exporters import GatedExporter
from tests.ranks import REPO, WORKERS, rank_env
from tests.spans_io import load_spans


def run_script(mode: str, out: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    run = subprocess.run(
        [sys.executable, str(WORKERS / "exit_flush.py"), mode, str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=rank_env(**env),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads(run.stdout.strip().splitlines()[-1])


def test_a_script_that_never_flushes_still_exports_its_last_checkpoint(tmp_path: Path) -> None:
    _, diagnostics = run_script("file", tmp_path)
    names = [s.name for s in load_spans([tmp_path / "spans.jsonl"])]
    assert {"dcp.async_save", "dcp.async_upload", "dcp.write_data", "dcp.checkpoint"} <= set(names)
    assert names.count("dcp.async_upload") == 1
    assert "flush_timeout" not in diagnostics


def test_a_hung_exporter_delays_exit_by_at_most_the_flush_timeout(tmp_path: Path) -> None:
    # The subprocess timeout (120 s) is the failure: without a bound the exit would hang forever.
    _, diagnostics = run_script("hung", tmp_path, DCP_OTEL_FLUSH_TIMEOUT_S="1")
    assert diagnostics["flush_timeout"] == 1


def test_an_exporter_that_never_returns_on_the_thread_that_ends_a_span_delays_exit_by_at_most_the_flush_timeout(
        tmp_path: Path) -> None:  # fmt: skip
    """Through a ``SimpleSpanProcessor`` a span's end runs the exporter: the ``dcp.process`` span that dcp-otel ends
    at exit is ended on a thread of its own, so a hung exporter holds the exit no longer than the flush timeout (it
    held it for good before; the subprocess timeout, 120 s, is the failure)."""
    run, _ = run_script("hung-simple", tmp_path, DCP_OTEL_FLUSH_TIMEOUT_S="1")
    plain, _ = run_script("hung-simple-plain", tmp_path, DCP_OTEL_FLUSH_TIMEOUT_S="1")
    assert run.returncode == plain.returncode == 0 and run.stdout.count("\n") == plain.stdout.count("\n")


def test_a_job_whose_collector_never_answers_ends_as_plain_its_agent_not_waiting_for_the_exporter_again(
        tmp_path: Path) -> None:  # fmt: skip
    """Under ``opentelemetry-instrument torchrun``, each rank's exit flush gives up after the flush timeout and leaves
    its spans in its record; torchelastic's agent then hands them to its own provider, whose exporter is stuck on
    the same collector. The agent's exit waits for that delivery until its deadline (the flush timeout) and leaves
    that provider's shutdown to a daemon thread: the SDK's exit hook would wait for the exporter again, as long as
    the exporter's timeout (30 s here, its batch processor's bound, the exporter's being longer). The job may take
    about twice the flush timeout (1 s) longer than plain; 15 s is far from both that and the hook's 30 s."""
    bin_dir = Path(sys.executable).parent
    torchrun = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "1", "--monitor-interval", "0.1",
                str(WORKERS / "plain_train.py")]  # fmt: skip
    with socket.socket() as collector:
        collector.bind(("127.0.0.1", 0))
        collector.listen(128)  # the kernel completes connections; nobody ever reads or answers
        otel = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TIMEOUT": "300",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.getsockname()[1]}",
                "DCP_OTEL_FLUSH_TIMEOUT_S": "1", semconv.ENV_SPOOL_DIR: str(tmp_path / "spool")}  # fmt: skip
        runs, took = {}, {}
        for name, command in (("plain", torchrun), ("traced", [str(bin_dir / "opentelemetry-instrument"), *torchrun])):
            started = time.monotonic()
            runs[name] = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                                        env=rank_env(**otel, CKPT=str(tmp_path / name)))  # fmt: skip
            took[name] = time.monotonic() - started
    assert runs["plain"].returncode == runs["traced"].returncode == 0, runs["traced"].stderr[-3000:]
    assert took["traced"] < took["plain"] + 15, took
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == sorted(p.name for p in (tmp_path / "traced").iterdir())
    # (The rank's exit flush gave up, its spans left in its record: what the agent then sends through its provider.)
    assert "the span exporter did not finish flushing in time" in runs["traced"].stderr


@pytest.mark.parametrize("collector", ["comes back", "stuck", "refuses"])
def test_at_the_agents_exit_a_delivery_under_way_is_waited_for_until_its_deadline_then_left_to_a_daemon(
        collector: str, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A dead worker's spans still on their way at the agent's exit: its settle waits for that flush until the
    delivery's own deadline, so an exporter that gets through meanwhile (a collector back within the flush
    timeout) delivers them, and only one still stuck then leaves its provider to be shut down in the background
    (a review found the first version of this giving up at half the timeout: the spans were lost); one that
    answered, if only to refuse, leaves the SDK's exit hook in place. The exporter here gets through once the
    settle waits for it (its ``finish``), so the order is fixed, not timed."""
    comes_back = collector == "comes back"
    exporter = GatedExporter(refuses=collector == "refuses")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    delivery = Delivery(lambda: provider, timeout_s=30 if comes_back else 0.5)
    finish, waiting = BoundedFlush.finish, threading.Event()

    def settling(flush: BoundedFlush) -> bool | None:
        if threading.current_thread().name == "survivor":
            waiting.set()  # the delivery's flush is started, and waited for
        elif threading.current_thread().name == "settle" and comes_back:
            exporter.gate.set()
        return finish(flush)

    monkeypatch.setattr(BoundedFlush, "finish", settling)
    span = TracerProvider().get_tracer("t").start_span("dead worker's")
    span.end()
    sent: list[bool] = []
    under_way = threading.Thread(target=lambda: sent.append(delivery([span])), name="survivor")  # type: ignore[list-item]
    under_way.start()
    assert waiting.wait(30) and exporter.entered.wait(30)  # the flush is under way, in the exporter
    settled: list[object] = []
    settle = threading.Thread(target=lambda: settled.append(delivery.settle()), name="settle")
    settle.start()
    settle.join(60)
    under_way.join(60)
    try:
        if comes_back:
            assert settled == [None] and len(exporter.got) == 1 and sent == [True]
        elif collector == "stuck":
            assert settled == [provider] and not exporter.got and sent == [False]
        else:  # (the SDK's flush says True: it ended in time; what the exporter answered, it does not say)
            assert settled == [None] and not exporter.got
        assert delivery.settle() is None  # once: a second settle (dcp-otel-run's, then atexit's) has nothing
    finally:
        exporter.gate.set()
        provider.shutdown()
