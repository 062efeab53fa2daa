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


def problems() -> dict[str, int]:
    """The counted problems (``diagnostics()`` also says how many spans are open)."""
    return {name: count for name, count in dcp_otel.diagnostics().items() if name != "open_spans"}


def _conversion_with_keys(keys: list[tuple[str, str, int]], end: str = "end") -> None:
    """A save whose ``_stateful_to_state_dict`` logs (uuid, key, duration ns) per key, as torch does."""
    log = dcp_log._dcp_logger.debug
    log(record("start", "op"))
    log(record("start", "conv", "_stateful_to_state_dict", t=T0 + 1))
    t = T0 + 2
    for uuid, key, took in keys:
        log(record("start", uuid, f"_stateful_to_state_dict.{key}", t=t))
        if end == "end" or uuid != keys[-1][0]:
            log(record("end", uuid, f"_stateful_to_state_dict.{key}", t=t + took))
        else:  # the last key raised: torch logs its exception through the logger's error
            dcp_log._dcp_logger.error(record("exception", uuid, f"_stateful_to_state_dict.{key}", t=t + took))
        t += took + 1
    log(record(end, "conv", "_stateful_to_state_dict", t=t))
    log(record(end, "op", t=t + 1))


def test_per_key_records_become_their_conversions_summary_and_leave_nothing_open(traced) -> None:
    _conversion_with_keys([("k1", "model", 50), ("k2", "optim", 700), ("k3", "step", 5)])
    (convert,) = [s for s in traced.spans() if s.name == "dcp._stateful_to_state_dict"]
    assert convert.attributes["dcp.state_dict.keys"] == 3
    assert convert.attributes["dcp.state_dict.keys_seconds"] == pytest.approx(755 / 1e9)
    assert list(convert.attributes["dcp.state_dict.slowest_keys"])[:2] == ["optim", "model"]
    assert not [s for s in traced.spans() if s.name.startswith("dcp._stateful_to_state_dict.")]
    assert traced.recorder().open_count() == 0 and traced.recorder().stack_depth() == 0
    assert problems() == {}


def test_a_key_that_raised_is_named_on_its_conversion(traced) -> None:
    _conversion_with_keys([("k1", "model", 50), ("k2", "optim", 70)], end="exception")
    (convert,) = [s for s in traced.spans() if s.name == "dcp._stateful_to_state_dict"]
    assert convert.attributes["dcp.state_dict.failed_key"] == "optim"
    assert convert.attributes["dcp.state_dict.keys"] == 1  # the key that returned
    assert traced.recorder().stack_depth() == 0


def test_a_per_key_end_that_matches_no_open_key_is_dropped_and_counted(traced) -> None:
    log = dcp_log._dcp_logger.debug
    log(record("start", "op"))
    log(record("start", "conv", "_stateful_to_state_dict", t=T0 + 1))
    log(record("start", "k1", "_stateful_to_state_dict.model", t=T0 + 2))
    log(record("end", "k9", "_stateful_to_state_dict.model", t=T0 + 3))  # not the key that is open
    log(record("end", "k1", "_stateful_to_state_dict.model", t=T0 + 4))
    log(record("end", "conv", "_stateful_to_state_dict", t=T0 + 5))
    log(record("end", "op", t=T0 + 6))
    assert problems() == {"unmatched_event": 1}
    (convert,) = [s for s in traced.spans() if s.name == "dcp._stateful_to_state_dict"]
    assert convert.attributes["dcp.state_dict.keys"] == 1
    assert traced.recorder().stack_depth() == 0


def test_a_per_key_start_inside_another_step_is_an_orphan(traced) -> None:
    log = dcp_log._dcp_logger.debug
    log(record("start", "op"))
    log(record("start", "w", "write_data", t=T0 + 1))
    log(record("start", "k1", "_stateful_to_state_dict.model", t=T0 + 2))
    log(record("end", "w", "write_data", t=T0 + 3))
    log(record("end", "op", t=T0 + 4))
    assert problems() == {"orphan_key_event": 1}
    assert traced.recorder().stack_depth() == 0


def test_a_key_whose_end_reads_earlier_than_its_start_counts_as_taking_no_time(traced) -> None:
    """torch stamps records with the wall clock, which a time step can set back while a key converts."""
    _conversion_with_keys([("k1", "model", 50), ("k2", "optim", -30), ("k3", "step", 5)])
    (convert,) = [s for s in traced.spans() if s.name == "dcp._stateful_to_state_dict"]
    assert convert.attributes["dcp.state_dict.keys"] == 3
    assert convert.attributes["dcp.state_dict.keys_seconds"] == pytest.approx(55 / 1e9)
    assert problems() == {} and traced.recorder().stack_depth() == 0
