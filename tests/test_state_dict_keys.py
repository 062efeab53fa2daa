"""A state dict with many top-level keys gives a summary, not a span per key."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from dcp_otel import semconv
from dcp_otel.tracing.failures import Failure
from dcp_otel.tracing.records import KIND_STEP, MAX_KEY_TEXT, Call, KeyCall, KeyStats, key_of
from tests.spans_io import named


class HeavyStateful:
    """A Stateful whose ``state_dict`` does real work, so it is the slowest key."""

    def state_dict(self) -> dict:
        a = torch.ones(600, 600)
        for _ in range(60):  # ~0.2-0.3 s of real work
            a = a @ a / 600.0
        return {"heavy": a[:2, :2].clone()}

    def load_state_dict(self, state: dict) -> None:  # pragma: no cover - Stateful protocol
        pass


def test_ten_thousand_keys_collapse_into_their_parent(traced, tmp_path: Path) -> None:
    state = {f"k{i:05d}": torch.ones(1) for i in range(10_000)}
    state["zz_heavy"] = HeavyStateful()

    # A full garbage collection over a long test session can pause any key for
    # longer than the heavy one; the ranking, not the collector, is under test.
    gc.disable()
    try:
        dcp.save(state, checkpoint_id=str(tmp_path / "c"))
    finally:
        gc.enable()

    spans = traced.spans()
    assert len(spans) < 20, sorted({s.name for s in spans})
    assert not [s for s in spans if s.name.startswith("dcp." + semconv.STATEFUL_KEY_PREFIX)]
    (convert,) = named(spans, "dcp._stateful_to_state_dict")
    attrs = convert.attributes
    assert attrs[semconv.ATTR_STATE_DICT_KEYS] == 10_001
    slowest = attrs[semconv.ATTR_STATE_DICT_SLOWEST_KEYS]
    seconds = attrs[semconv.ATTR_STATE_DICT_SLOWEST_SECONDS]
    assert len(slowest) == len(seconds) == 5
    assert slowest[0] == "zz_heavy"
    assert list(seconds) == sorted(seconds, reverse=True)
    assert sum(seconds) <= attrs[semconv.ATTR_STATE_DICT_KEYS_SECONDS] <= (convert.end_ns - convert.start_ns) / 1e9
    recorder = traced.recorder()
    assert (recorder.open_count(), recorder.stack_depth()) == (0, 0)


def test_the_summary_names_the_slowest_keys_the_later_first_on_a_tie_and_bounds_their_text() -> None:
    stats = KeyStats(limit=3)
    for key, took in (("a", 5), ("b", 9), ("c", 1), ("d", 9), ("e", 7), ("f", 5), ("x" * 300, 2)):
        stats.add(semconv.STATEFUL_KEY_PREFIX + key, took)
    attrs = stats.to_attributes()
    assert attrs[semconv.ATTR_STATE_DICT_SLOWEST_KEYS] == ["d", "b", "e"]
    assert attrs[semconv.ATTR_STATE_DICT_SLOWEST_SECONDS] == [9e-9, 9e-9, 7e-9]
    assert attrs[semconv.ATTR_STATE_DICT_KEYS] == 7 and attrs[semconv.ATTR_STATE_DICT_KEYS_SECONDS] == 38e-9
    assert key_of(semconv.STATEFUL_KEY_PREFIX + "x" * 300) == "x" * MAX_KEY_TEXT

    counted_only = KeyStats(limit=0)
    counted_only.add(semconv.STATEFUL_KEY_PREFIX + "a", 5)
    assert counted_only.to_attributes()[semconv.ATTR_STATE_DICT_SLOWEST_KEYS] == []
    assert counted_only.to_attributes()[semconv.ATTR_STATE_DICT_KEYS] == 1


def test_a_per_key_call_answers_what_a_call_is_asked_as_a_call_with_no_span() -> None:
    one, other = KeyCall("k1", semconv.STATEFUL_KEY_PREFIX + "model", 10), KeyCall("k2", "x", 20)
    assert isinstance(one, Call) and not one.span_id and one.op is None and one.parent is None
    assert (one.uuid, one.start_ns, one.end_ns, one.keys, one.failure, one.token) == ("k1", 10, 0, None, None, None)
    assert one.kind == KIND_STEP and one.parent_context is None and one.name == "dcp._stateful_to_state_dict.model"
    one.end_ns, one.failure = 15, Failure(None, "raised")  # set on the instance, as on a call
    assert (one.end_ns, one.duration_s, other.end_ns, other.failure) == (15, 5e-9, 0, None)
