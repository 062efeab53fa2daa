"""Whatever torch logs, the handler neither raises nor grows without bound."""

from __future__ import annotations

import pytest
import torch.distributed.checkpoint.logger as dcp_log

import dcp_otel
from dcp_otel import _selftelemetry

T0 = 1_700_000_000_000_000_000


def record(event: str, uuid: str, func: str = "save", t: int = T0) -> dict:
    return {"event": event, "uuid": uuid, "func_name": func, "time": t, "checkpoint_id": "/c"}


@pytest.mark.parametrize(
    ("msg", "reason"),
    [
        ("a plain string", "malformed_event"),
        ({"event": "start", "func_name": "save", "time": T0}, "malformed_event"),  # no uuid
        ({"event": "begin", "uuid": "1", "func_name": "save", "time": T0}, "malformed_event"),
        ({"event": "start", "uuid": "1", "func_name": "save", "time": "now"}, "malformed_event"),
        (record("end", "never-started"), "unmatched_event"),
        (record("exception", "never-started"), "unmatched_event"),
        (record("start", "k", "_stateful_to_state_dict.model"), "orphan_key_event"),
    ],
)
def test_malformed_records_are_dropped_and_counted(traced, msg: object, reason: str) -> None:
    dcp_log._dcp_logger.debug(msg)  # through torch's real logger, as torch would
    assert dcp_otel.diagnostics().get(reason) == 1
    assert traced.recorder().open_count() == 0 and traced.recorder().stack_depth() == 0


def test_a_duplicate_start_is_dropped(traced) -> None:
    dcp_log._dcp_logger.debug(record("start", "dup"))
    dcp_log._dcp_logger.debug(record("start", "dup"))
    dcp_log._dcp_logger.debug(record("end", "dup", t=T0 + 10))
    assert dcp_otel.diagnostics().get("span_limit") == 1
    assert traced.recorder().open_count() == 0
    assert [s.name for s in traced.spans()].count("dcp.save") == 1


def test_starts_that_never_end_are_bounded(provider) -> None:
    _selftelemetry.reset()
    dcp_otel.instrument(tracer_provider=provider[0], max_open_spans=16)
    try:
        for i in range(100):
            dcp_log._dcp_logger.debug(record("start", f"s{i}", "local_step"))
        assert dcp_otel.DCPInstrumentor().recorder.open_count() == 16
        assert dcp_otel.diagnostics()["span_limit"] == 84
        # the outermost call finally ends: everything it left open is closed
        dcp_log._dcp_logger.debug(record("end", "s0", "local_step", t=T0 + 5))
        assert dcp_otel.DCPInstrumentor().recorder.open_count() == 0
    finally:
        dcp_otel.uninstrument()


def test_an_end_before_its_children_closes_them_as_errors(traced) -> None:
    dcp_log._dcp_logger.debug(record("start", "p"))
    dcp_log._dcp_logger.debug(record("start", "c", "write_data", t=T0 + 1))
    dcp_log._dcp_logger.debug(record("end", "p", t=T0 + 9))
    spans = {s.name: s for s in traced.spans()}
    assert spans["dcp.write_data"].status == "ERROR" and spans["dcp.write_data"].end_ns == T0 + 9
    assert spans["dcp.save"].status == "UNSET"
    assert traced.recorder().open_count() == 0


def test_repeated_problems_are_logged_once_but_all_counted(traced, caplog) -> None:
    for _ in range(50):
        dcp_log._dcp_logger.debug("not a dict")
    assert dcp_otel.diagnostics()["malformed_event"] == 50
    assert sum("dropped a DCP log record" in r.getMessage() for r in caplog.records) == 1
