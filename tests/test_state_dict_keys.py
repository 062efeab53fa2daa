"""A state dict with many top-level keys gives a summary, not a span per key."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from dcp_otel import semconv
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
