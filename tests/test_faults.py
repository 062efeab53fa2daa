"""Telemetry faults never reach the checkpoint: a dead or hung OTLP endpoint, a full
export queue, a raising exporter or span processor. (A taken metrics port: test_exposition.py; a full disk on one
rank: test_multiprocess.py.)"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry

import dcp_otel
from dcp_otel import _selftelemetry
from dcp_otel.otlp_file import read_spans
from dcp_otel.tracing import export_queue
from tests.exporters import GatedExporter
from tests.ranks import REPO, WORKERS, rank_env, run_ranks

FLUSH_TIMEOUT_S = 2
SAVES = 3000


@pytest.fixture(params=["down", "hung"])
def endpoint(request: pytest.FixtureRequest) -> Iterator[str]:
    """An OTLP endpoint that refuses connections, or accepts them and never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        if request.param == "hung":
            server.listen(128)  # the kernel completes connections; nobody ever reads or answers
            yield f"http://127.0.0.1:{port}"
            return
    yield f"http://127.0.0.1:{port}"  # closed: connection refused


def test_a_dead_or_hung_otlp_endpoint_costs_neither_the_saves_nor_memory_nor_the_exit(endpoint: str) -> None:
    """Spans and metrics both go to the endpoint; the metric reader tries to push every 100 ms."""
    env = rank_env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, DCP_OTEL_FLUSH_TIMEOUT_S=str(FLUSH_TIMEOUT_S),
                   OTEL_METRIC_EXPORT_INTERVAL="100")  # fmt: skip
    run = subprocess.run([sys.executable, str(WORKERS / "otlp_fault.py"), str(SAVES)], capture_output=True,
                         text=True, timeout=300, env=env, cwd=REPO)  # fmt: skip
    exited = time.time()
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["saves"] == SAVES
    # The SDK's queue is bounded and drops when full: the spans alive are at most its queue (2048)
    # and the batch its exporter holds (512), whatever the number of saves...
    assert result["live_spans"] <= 2048 + 512, result
    # ...and memory stays bounded. (Not to the KiB: with the package versions of 2026-11 the resident set
    # creeps by about 2 MiB per 1,000 saves with a dead endpoint and spans only, dcp-otel's metrics off,
    # while the spans alive stay constant; the 16,000 spans dropped meanwhile would weigh far more.)
    assert (result["rss_end_kib"] - result["rss_warm_kib"]) / 1024 < 16, result
    # The exit waits for the exporter at most DCP_OTEL_FLUSH_TIMEOUT_S (plus interpreter teardown),
    # not the SDK's 30 s shutdown and the exporter's retries.
    assert exited - result["done_at"] < FLUSH_TIMEOUT_S + 3, exited - result["done_at"]
    assert "Traceback" not in run.stderr
    # ...and counts what it drops, in one rate-limited line instead of one line per span. Every span that
    # ended is dropped, handed to the exporter, in the SDK's queue (2048) or in the batch being taken from
    # it (512): the count is exact to those.
    dropped, handed = result["diagnostics"]["span_queue_full"], result["handed"]
    assert result["ended_before"] - handed - 2048 - 512 <= dropped <= result["ended_after"] - handed, result
    assert dropped > 2048, result  # thousands of saves, a few spans each: most of them dropped
    assert "Queue full, dropping" not in run.stderr
    assert run.stderr.count("span queue is full") == 1, run.stderr[-3000:]


class EndedSpans(SpanProcessor):
    def __init__(self) -> None:
        self.count = 0

    def on_end(self, span: ReadableSpan) -> None:
        self.count += 1


def test_spans_the_sdks_full_queue_drops_are_counted_exactly_exported_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _selftelemetry.reset()
    exporter, ended = GatedExporter(), EndedSpans()
    provider = TracerProvider()
    provider.add_span_processor(ended)
    # Room for 4 queued spans and a batch of 2 in the stuck export: a save emits more.
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=4, max_export_batch_size=2))
    registry = CollectorRegistry()
    dcp_otel.instrument(tracer_provider=provider, registry=registry)
    try:
        with caplog.at_level(logging.WARNING):
            for i in range(3):
                dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / f"c{i}"))
        # Spans are dropped as they end: all are counted when the saves return.
        scraped = registry.get_sample_value(
            "dcp_otel_telemetry_problems_total", {"reason": "span_queue_full", "rank": "0"}
        )
    finally:
        dcp_otel.uninstrument()
        exporter.gate.set()
        provider.shutdown()  # exports what the queue kept
    dropped = ended.count - len(exporter.got)
    assert dropped >= 3 * 7 - 6  # 3 saves of 7 spans each, at most 6 of them kept
    assert dcp_otel.diagnostics()["span_queue_full"] == dropped
    assert scraped == dropped  # and Prometheus sees the same count
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if m.startswith("Queue full")]  # not one SDK line per dropped span...
    assert len([m for m in messages if "span queue is full" in m]) == 1  # ...but one of ours


def test_uninstrument_gives_the_sdks_queue_warnings_back(caplog: pytest.LogCaptureFixture) -> None:
    dcp_otel.instrument(tracer_provider=TracerProvider(), registry=CollectorRegistry())
    dcp_otel.uninstrument()
    sdk = logging.getLogger(export_queue.SDK_LOGGERS[0])
    with caplog.at_level(logging.WARNING):
        sdk.warning("Queue full, dropping %s.", "Span")
    assert [r.getMessage() for r in caplog.records] == ["Queue full, dropping Span."]


class RaisingExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        raise RuntimeError("exporter bug")


class RaisingProcessor(SpanProcessor):
    def on_start(self, span: Span, parent_context: object = None) -> None:
        raise RuntimeError("processor bug at start")

    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("processor bug at end")


@pytest.mark.parametrize("broken", [RaisingExporter, RaisingProcessor])
def test_a_raising_exporter_or_span_processor_changes_nothing_for_the_checkpoint(
    tmp_path: Path, broken: type
) -> None:
    _selftelemetry.reset()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(broken()) if broken is RaisingExporter else broken())
    dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry())
    try:
        state = {"w": torch.arange(8.0)}
        assert dcp.save(state, checkpoint_id=str(tmp_path / "c")) is not None  # torch's Metadata, as always
        restored = {"w": torch.zeros(8)}
        dcp.load(restored, checkpoint_id=str(tmp_path / "c"))
        assert torch.equal(restored["w"], state["w"])

        class FullDisk(dcp.FileSystemWriter):
            def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
                raise OSError(28, "No space left on device")

        with pytest.raises(BaseException) as raised:  # noqa: B017 - CheckpointException is a BaseException
            dcp.save(state, storage_writer=FullDisk(str(tmp_path / "full")))
        assert "No space left on device" in str(raised.value)
        assert dcp_otel.DCPInstrumentor().recorder.open_count() == 0
    finally:
        dcp_otel.uninstrument()


def test_a_rank_killed_mid_save_leaves_the_survivors_spans_ended_as_errors(tmp_path: Path) -> None:
    job = run_ranks("kill_rank", 2, tmp_path, exit_codes={1: -9}, timeout_s=120)
    result = json.loads((job.out / "result-0.json").read_text())
    assert result["caught"]["type"] == "RuntimeError" and "Connection" in result["caught"]["message"]  # torch's own
    assert result["open_spans"] == 0
    spans = read_spans([job.out / "rank-0.jsonl"])
    (save,) = [s for s in spans if s.name == "dcp.save"]
    assert save.error and save.end_ns > save.start_ns and "Connection" in save.status_message
    (root,) = [s for s in spans if s.name == "dcp.checkpoint"]
    assert root.error  # the trace says the checkpoint failed
    # Rank 1 died mid-save: what it exported before is whole lines of OTLP JSON, and no save ended.
    dead = job.out / "rank-1.jsonl"
    if dead.stat().st_size:
        assert "dcp.save" not in {s.name for s in read_spans([dead])}
