"""A state dict with many top-level keys gives a summary, not a span per key."""

from __future__ import annotations

import gc
import sys
import threading
from collections import Counter
from collections.abc import Callable
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


def _dcp_otel_calls_during(fn: Callable[[], None]) -> Counter[str]:
    """The calls of dcp-otel's own functions on this thread while ``fn`` runs, by name (the tap's ``debug``
    stands under logging's file name: ``dcp_otel_logger_tap_debug``)."""
    calls: Counter[str] = Counter()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            code = frame.f_code
            if "/dcp_otel/" in code.co_filename or code.co_name == "dcp_otel_logger_tap_debug":
                calls[code.co_name] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_a_key_of_a_state_dict_runs_nothing_of_dcp_otel_but_the_taps_two_frames(traced, tmp_path: Path) -> None:
    """A 10,000-key state dict logs 20,000 records on the caller's thread; each took the recorder's hot path, a
    call record and a summary update (281 Python instructions a key, benchmarks/own_share.py). The conversion's
    lane reads them in the tap's own frame: per key, the two records' ``debug``, and the heap of the slowest only
    for the few keys that reach its floor."""
    small = {f"k{i}": torch.ones(1) for i in range(10)}
    large = {f"k{i}": torch.ones(1) for i in range(1_010)}
    dcp.save(small, checkpoint_id=str(tmp_path / "first"))  # (what happens once: a thread's stack, the builder)
    few = _dcp_otel_calls_during(lambda: dcp.save(small, checkpoint_id=str(tmp_path / "few")))
    many = _dcp_otel_calls_during(lambda: dcp.save(large, checkpoint_id=str(tmp_path / "many")))
    extra = {name: many[name] - few[name] for name in many if many[name] != few[name]}
    assert extra.pop("slow", 0) < 100  # a key at least as slow as the 5 slowest so far (about 5 ln(1000 / 5))
    # The call's end wakes the survivor when its periodic look fell inside the call (the longer save is likelier to
    # hold one back): one release a checkpoint at most, never one a key.
    assert extra.pop("set", 0) in (-1, 0, 1)
    assert extra == {"dcp_otel_logger_tap_debug": 2 * 1_000}
    keys = sorted(s.attributes[semconv.ATTR_STATE_DICT_KEYS] for s in named(traced.spans(), "dcp._stateful_to_state_dict"))
    assert keys == [10, 10, 1_010]


class SavesInside:
    """A Stateful whose ``state_dict`` saves another state dict: a conversion inside one of the lane's keys."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def state_dict(self) -> dict:
        dcp.save({"i1": torch.ones(1), "i2": torch.ones(1), "i3": torch.ones(1)}, checkpoint_id=str(self.path))
        return {"x": torch.ones(2)}

    def load_state_dict(self, state: dict) -> None:  # pragma: no cover - Stateful protocol
        pass


def test_a_conversion_inside_a_key_and_one_on_another_thread_each_count_their_own_keys(traced, tmp_path: Path) -> None:
    """One lane at a time: a conversion nested in a key of the lane's (a Stateful that saves) holds the lane back
    until it ends, a conversion on another thread meanwhile takes the general path; each summary is its own."""
    other_inside, other_go, results = threading.Event(), threading.Event(), []

    class Waits:
        def state_dict(self) -> dict:
            other_inside.set()
            assert other_go.wait(30)
            return {"w": torch.ones(1)}

        def load_state_dict(self, state: dict) -> None:  # pragma: no cover
            pass

    def other() -> None:  # a conversion on another thread, open all through the nested one
        dcp.save({"o1": torch.ones(1), "o2": torch.ones(1), "wait": Waits()}, checkpoint_id=str(tmp_path / "o"))
        results.append("done")

    thread = threading.Thread(target=other)
    thread.start()
    assert other_inside.wait(30)
    state = {"a": torch.ones(1), "s": SavesInside(tmp_path / "inner"), "b": torch.ones(1), "c": torch.ones(1)}
    dcp.save(state, checkpoint_id=str(tmp_path / "outer"))
    other_go.set()
    thread.join(30)
    assert results == ["done"]
    counts = sorted((s.attributes[semconv.ATTR_STATE_DICT_KEYS], tuple(sorted(s.attributes[semconv.ATTR_STATE_DICT_SLOWEST_KEYS])))
                    for s in named(traced.spans(), "dcp._stateful_to_state_dict"))  # fmt: skip
    assert counts == [(3, ("i1", "i2", "i3")), (3, ("o1", "o2", "wait")), (4, ("a", "b", "c", "s"))]
    recorder = traced.recorder()
    assert (recorder.open_count(), recorder.stack_depth(), recorder.lane) == (0, 0, None)
    assert problems_counted() == {}


def problems_counted() -> dict[str, int]:
    import dcp_otel

    return {name: n for name, n in dcp_otel.diagnostics().items() if name != "open_spans"}


def test_the_taps_per_key_reader_stands_as_debug_only_while_its_conversion_is_open(traced, tmp_path: Path) -> None:
    """While a conversion holds the lane, the tap's ``debug`` is a reader of that lane's records (one frame a
    record), on whichever thread the conversion runs; before and after, the method; uninstrumenting puts torch's
    logger back with nothing of dcp-otel's on it."""
    import torch.distributed.checkpoint.logger as dcp_logging

    tap = dcp_logging._dcp_logger
    torch_logger = tap.logger
    seen: list[tuple[bool, str]] = []

    class Looks:
        def state_dict(self) -> dict:
            debug = dcp_logging._dcp_logger.debug
            seen.append(("debug" in tap.__dict__, getattr(debug, "__func__", debug).__code__.co_name))
            return {"x": torch.ones(1)}

        def load_state_dict(self, state: dict) -> None:  # pragma: no cover - Stateful protocol
            pass

    assert "debug" not in tap.__dict__
    dcp.save({"a": torch.ones(1), "look": Looks()}, checkpoint_id=str(tmp_path / "a"))
    assert seen == [(True, "dcp_otel_logger_tap_debug")]
    assert "debug" not in tap.__dict__  # (the method again)
    held = threading.Thread(target=lambda: dcp.save({"look": Looks()}, checkpoint_id=str(tmp_path / "b")))
    held.start()
    held.join(60)
    assert seen[-1] == (True, "dcp_otel_logger_tap_debug") and "debug" not in tap.__dict__
    keys = sorted(s.attributes[semconv.ATTR_STATE_DICT_KEYS] for s in named(traced.spans(), "dcp._stateful_to_state_dict"))
    assert keys == [1, 2]
    import dcp_otel

    dcp_otel.uninstrument()
    assert dcp_logging._dcp_logger is torch_logger and "debug" not in torch_logger.__dict__
    dcp_otel.instrument(tracer_provider=traced.provider, registry=traced.registry)  # (the fixture uninstruments)


def test_a_wrapper_someone_put_over_the_taps_debug_sees_every_key_and_stays_until_they_remove_it(traced, tmp_path: Path) -> None:
    """A tool (or a benchmark counting calls) that sets the tap's ``debug`` on the instance keeps it through a
    conversion: the lane's reader does not stand over it, nor takes it away when the lane is released."""
    import torch.distributed.checkpoint.logger as dcp_logging

    tap = dcp_logging._dcp_logger
    seen: list[str] = []
    method = tap.debug

    def counting(msg: dict, *args: object, **kwargs: object) -> None:
        seen.append(msg["func_name"])
        method(msg, *args, **kwargs)

    tap.debug = counting
    try:
        dcp.save({"a": torch.ones(1), "b": torch.ones(1)}, checkpoint_id=str(tmp_path / "a"))
        assert tap.__dict__["debug"] is counting
    finally:
        del tap.debug
    assert seen.count("_stateful_to_state_dict.a") == 2 and seen.count("_stateful_to_state_dict.b") == 2
    (conversion,) = named(traced.spans(), "dcp._stateful_to_state_dict")
    assert conversion.attributes[semconv.ATTR_STATE_DICT_KEYS] == 2
