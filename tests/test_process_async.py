"""async_save in torch's checkpoint daemon process (AsyncCheckpointerType.PROCESS), traced end to end.

Each test runs a real rank (``workers/process_async.py``) whose daemon torch
spawns; spans from both processes go through the real OTLP/HTTP exporter to a
receiver on 127.0.0.1 that decodes the protobuf.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from dcp_otel import semconv
from dcp_otel.otlp_file import read_spans
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.ports import free_port_range
from tests.ranks import REPO, WORKERS, rank_env

#: How the daemon learns where its spans go: from the inherited OTEL_* variables,
#: or from the DCP_OTEL_PROCESS_SETUP hook when the rank configured its exporter in code.
MODES = {
    "env": lambda endpoint: {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint},
    "setup": lambda endpoint: {"TEST_DAEMON_OTLP": endpoint,
                               "DCP_OTEL_PROCESS_SETUP": "tests.workers.daemon_setup:provider"},  # fmt: skip
}


def run_rank(mode: str, receiver: OtlpReceiver) -> dict[str, Any]:
    env = rank_env(**MODES[mode](receiver.endpoint))
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "DCP_OTEL_METRICS_PORT"):
        env.pop(name, None)
    if mode == "setup":
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    run = subprocess.run(
        [sys.executable, str(WORKERS / "process_async.py"), str(free_port_range(1)), mode, receiver.endpoint],
        capture_output=True, text=True, timeout=240, cwd=REPO, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    seen: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return seen


def sample(seen: dict[str, Any], name: str, **labels: str) -> float | None:
    for sample_name, sample_labels, value in seen["samples"]:
        if sample_name == name and sample_labels == labels:
            return float(value)
    return None


def named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_daemon_save_and_its_steps_join_the_trace_of_the_async_save(mode: str) -> None:
    with OtlpReceiver() as receiver:
        seen = run_rank(mode, receiver)
    spans = receiver.spans
    assert seen["results"] == ["Metadata", "Metadata"]  # what torch returns, untouched
    assert seen["loaded"] == [2.0 * i for i in range(10)]
    assert seen["flushed"] is True and seen["diagnostics"] == {"open_spans": 0}

    uploads = named(spans, semconv.SPAN_ASYNC_UPLOAD)
    saves = named(spans, "dcp.save")  # with a daemon, only the daemon runs save
    assert len(uploads) == 2 and len(saves) == 2, sorted(s.name for s in spans)
    assert len({u.trace_id for u in uploads}) == 2  # the first save (starting the daemon) and the second (reusing it)
    for upload in uploads:
        (save,) = [s for s in saves if s.trace_id == upload.trace_id]
        assert save.parent_id == upload.span_id  # across the process boundary
        assert save.attributes[semconv.ATTR_OPERATION] == "async_save" and save.attributes[semconv.ATTR_RANK] == 0
        steps = [s for s in spans if s.parent_id == save.span_id]
        assert {"dcp.local_step", "dcp.write_data", "dcp.finish_checkpoint"} <= {s.name for s in steps}
        roots = [s for s in spans if s.trace_id == upload.trace_id and s.name == semconv.SPAN_CHECKPOINT]
        assert len(roots) == 1  # still one checkpoint, one root
        # The rank staged the state dict for the daemon: what, from where, how fast.
        (stage,) = [s for s in spans if s.trace_id == upload.trace_id and s.name == "dcp.stage_state_dict"]
        assert stage.attributes[semconv.ATTR_STAGING_BYTES] > 0 and stage.attributes[semconv.ATTR_STAGING_DEVICE] == "cpu"
        assert stage.attributes[semconv.ATTR_STAGING_RATE] > 0
    if mode == "env":  # the daemon built its SDK from OTEL_*, with the rank's resource and its own pid
        assert {s.resource["service.name"] for s in saves} == {"process-async-test"}
        assert {s.resource["process.pid"] for s in saves} == {seen["daemon_pid"]}
    else:  # the hook's provider
        assert {s.resource["service.name"] for s in saves} == {"process-async-daemon"}

    # The daemon's metrics are on the rank's endpoint, labelled with its rank.
    assert sample(seen, "dcp_step_duration_seconds_count", operation="async_save", step="write_data", rank="0") == 2
    written = sample(seen, "dcp_written_bytes_total", rank="0")
    assert written is not None and written > 0
    assert sample(seen, "dcp_async_saves_in_flight", rank="0") == 0
    # Training was blocked by the async saves' calls on the rank, not by the daemon's saves.
    assert (sample(seen, "dcp_training_blocked_seconds_total", operation="async_save", rank="0") or 0) > 0
    assert sample(seen, "dcp_training_blocked_seconds_total", operation="save", rank="0") is None

    # Nothing left behind: no dcp-otel thread after uninstrument, no daemon after exit.
    assert not [t for t in seen["threads"] if t.startswith("dcp-otel")]
    with pytest.raises(ProcessLookupError):
        os.kill(seen["daemon_pid"], 0)


def test_a_daemon_that_cannot_start_ends_its_span_as_an_error(tmp_path) -> None:
    """torch logs neither an end nor an exception when the daemon fails to start; the span still ends."""
    spans_file = tmp_path / "spans.jsonl"
    done = subprocess.run(
        [sys.executable, str(WORKERS / "daemon_start_fails.py"), str(free_port_range(1)), str(spans_file)],
        env=rank_env(), cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["raised"] == "TypeError"  # the caller gets torch's own exception, unchanged
    assert seen["diagnostics"]["open_spans"] == 0
    spans = {s.name: s for s in read_spans([spans_file])}
    start = spans["dcp.create_checkpoint_daemon_process"]
    assert start.error and start.status_message.startswith("TypeError")
    assert spans["dcp.async_upload"].error and spans["dcp.checkpoint"].error
    assert start.parent_id == spans["dcp.async_upload"].span_id


def test_a_hung_collector_never_delays_the_daemons_save() -> None:
    """The daemon answers the rank as soon as the save is written, not after flushing its spans."""
    import socket

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(128)  # the kernel completes connections; nobody ever reads or answers
        env = rank_env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{hung.getsockname()[1]}",
                       OTEL_EXPORTER_OTLP_TIMEOUT="60", DCP_OTEL_FLUSH_TIMEOUT_S="60")  # fmt: skip
        for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "DCP_OTEL_PROCESS_SETUP"):
            env.pop(name, None)
        done = subprocess.run(
            [sys.executable, str(WORKERS / "daemon_hung_exporter.py"), str(free_port_range(1))],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    first, second = seen["outcomes"]
    assert first["result"] == "Metadata"
    # Before: every save waited for the daemon's span flush, up to the 60 s exporter timeout.
    assert second["result"] == "Metadata", seen
    assert seen["loaded"] == [2.0 * i for i in range(10)]
    assert "dcp.async_upload" in seen["spans"]  # the rank's own spans are unaffected


def test_a_second_save_before_the_daemon_is_up_keeps_every_save_and_its_metrics() -> None:
    """Each new daemon gets its own metrics pipe; none is closed while a daemon may still use it."""
    done = subprocess.run(
        [sys.executable, str(WORKERS / "daemon_two_saves.py"), str(free_port_range(1))],
        env=rank_env(), cwd=REPO, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["results"] == ["Metadata"] * 3  # before: "OSError: handle is closed", or metrics lost
    # The daemons' metrics reached the rank: one write_data per save, every byte written.
    assert sample(seen, "dcp_step_duration_seconds_count", operation="async_save", step="write_data", rank="0") == 3
    assert sample(seen, "dcp_async_saves_in_flight", rank="0") == 0
    assert (sample(seen, "dcp_written_bytes_total", rank="0") or 0) > 3 * 10 * 4
