"""The pipe carrying the async save process's metrics to its rank (real OS pipes)."""

from __future__ import annotations

import multiprocessing

from prometheus_client import CollectorRegistry

import dcp_otel
from dcp_otel import _selftelemetry
from dcp_otel.metrics.prometheus import CheckpointMetrics
from dcp_otel.metrics.relay import MAX_MESSAGE_BYTES, MetricsRelay, _pack, drain


def pipe():  # type: ignore[no-untyped-def]
    return multiprocessing.get_context("spawn").Pipe(duplex=False)


def test_what_the_daemon_observes_lands_in_the_rank_metrics() -> None:
    reader, writer = pipe()
    registry = CollectorRegistry()
    metrics = CheckpointMetrics(registry)
    relay = MetricsRelay(writer)
    relay.step_done("async_save", "write_data", "3", 0.25, {"trace_id": "ab" * 16, "rank": "3"})
    relay.bytes_written("3", 4096)
    relay.send()
    assert drain(reader, metrics) == 2
    labels = {"operation": "async_save", "step": "write_data", "rank": "3"}
    assert registry.get_sample_value("dcp_step_duration_seconds_count", labels) == 1
    assert registry.get_sample_value("dcp_step_duration_seconds_sum", labels) == 0.25
    assert registry.get_sample_value("dcp_written_bytes_total", {"rank": "3"}) == 4096
    assert drain(reader, metrics) == 0  # nothing twice


def test_messages_stay_below_the_atomic_pipe_write_size() -> None:
    observations = [["step_done", "async_save", f"step_{i}", "0", 0.1, None] for i in range(500)]
    messages = _pack(observations)
    assert len(messages) > 1
    assert max(len(m) for m in messages) <= MAX_MESSAGE_BYTES
    assert sum(m.count(b'"step_done"') for m in messages) == 500


def test_a_rank_that_stops_reading_never_blocks_the_daemon() -> None:
    _selftelemetry.reset()
    reader, writer = pipe()
    relay = MetricsRelay(writer)
    for _ in range(100):  # far more than a pipe buffer holds; each send must return
        for i in range(40):
            relay.step_done("async_save", "write_data", "0", float(i), None)
        relay.send()
    assert dcp_otel.diagnostics().get("relay_dropped", 0) > 0
    registry = CollectorRegistry()
    applied = drain(reader, CheckpointMetrics(registry))  # what did get through is intact
    assert applied > 0 and applied % 40 == 0
    assert registry.get_sample_value(
        "dcp_step_duration_seconds_count", {"operation": "async_save", "step": "write_data", "rank": "0"}
    ) == applied


def test_unknown_observations_are_dropped_and_counted() -> None:
    _selftelemetry.reset()
    reader, writer = pipe()
    writer.send_bytes(b'[["unregister"],["bytes_read","0",10]]')
    registry = CollectorRegistry()
    assert drain(reader, CheckpointMetrics(registry)) == 1
    assert registry.get_sample_value("dcp_read_bytes_total", {"rank": "0"}) == 10
    assert dcp_otel.diagnostics()["relay_dropped"] == 1


def test_the_daemons_progress_and_stalls_reach_the_rank_and_its_end_clears_the_progress() -> None:
    reader, writer = pipe()
    registry = CollectorRegistry()
    relay = MetricsRelay(writer)
    relay.progress("async save process", [("async_save", "write_data", "1", 1_790_000_000.5, 300.0)])
    relay.stalled("async_save", "write_data", "1")
    relay.send()
    seen: list[tuple[str, list[tuple]]] = []
    assert drain(reader, CheckpointMetrics(registry), lambda where, entries: seen.append((where, entries))) == 1
    assert seen == [("async save process", [("async_save", "write_data", "1", 1_790_000_000.5, 300.0)])]
    assert registry.get_sample_value("dcp_stalls_total", {"operation": "async_save", "step": "write_data",
                                                          "rank": "1"}) == 1  # fmt: skip
    writer.close()  # the daemon is gone: nothing of it is open any more
    drain(reader, None, lambda where, entries: seen.append((where, entries)))
    assert seen[-1] == ("", [])
