"""Every operation says the training step its checkpoint is of: said by the loop, or read from the checkpoint id."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client import CollectorRegistry

import dcp_otel
from dcp_otel import semconv
from dcp_otel.config import InstrumentOptions
from dcp_otel.otlp_file import OTLPJsonFileExporter, read_spans
from dcp_otel.report import build
from dcp_otel.tracing.training_step import DEFAULT_STEP_PATTERN, explicit_step, step_from_id


@pytest.mark.parametrize(("checkpoint_id", "step"), [
    ("/ckpt/step-1000", 1000),               # torchtitan
    ("/ckpt/step_1000", 1000),
    ("/ckpt/iter_0001000", 1000),            # Megatron-LM
    ("/ckpt/global_step1000", 1000),         # DeepSpeed
    ("/out/checkpoint-500", 500),            # Hugging Face Trainer
    ("/ckpt/epoch=0-step=100.ckpt", 100),    # Lightning
    ("s3://bucket/run-7/1000/", 1000),       # a number alone, trailing slash
    ("/ckpt/step-0", 0),
    ("/ckpt/latest", None),
    ("/ckpt/model_v2", None),                # a number that is not a step
    ("/runs/step-5/final", None),            # only the last component counts
    ("", None),
    (None, None),
])  # fmt: skip
def test_the_default_pattern_reads_the_common_layouts(checkpoint_id: str | None, step: int | None) -> None:
    assert step_from_id(checkpoint_id, DEFAULT_STEP_PATTERN) == step


def test_a_pattern_of_ones_own_reads_its_group_and_off_reads_none() -> None:
    assert step_from_id("/ckpt/ckpt-e3-s1200", r"-s(\d+)$") == 1200
    assert step_from_id("/ckpt/ckpt-e3-s1200", r"e(?P<epoch>\d+)-s(?P<step>\d+)") == 1200  # the group named step
    assert step_from_id("/ckpt/step-1000", "off") is None


def test_a_bad_pattern_is_a_clear_error_as_an_option_and_a_warning_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match="not a regular expression"):
        InstrumentOptions.from_kwargs({"step_pattern": "step-(\\d+"})
    with pytest.raises(ValueError, match="needs a group"):
        InstrumentOptions.from_kwargs({"step_pattern": r"step-\d+"})
    monkeypatch.setenv(semconv.ENV_STEP_PATTERN, "(((")
    with caplog.at_level(logging.WARNING, logger="dcp_otel"):
        assert InstrumentOptions.from_kwargs({}).step_pattern == DEFAULT_STEP_PATTERN
    assert semconv.ENV_STEP_PATTERN in caplog.text
    monkeypatch.setenv(semconv.ENV_STEP_PATTERN, r"s(\d+)$")
    assert InstrumentOptions.from_kwargs({}).step_pattern == r"s(\d+)$"


def test_the_loop_says_the_step_and_a_context_manager_puts_the_one_before_back() -> None:
    try:
        dcp_otel.set_training_step(10)
        with dcp_otel.training_step(20):
            assert explicit_step() == 20
        assert explicit_step() == 10
        for bad in (-1, 1.5, True, "7"):
            with pytest.raises(ValueError, match="whole number"):
                dcp_otel.set_training_step(bad)  # type: ignore[arg-type]
        assert explicit_step() == 10
    finally:
        dcp_otel.set_training_step(None)
    assert explicit_step() is None


def _saves(tmp_path: Path, **options: object) -> list[tuple[str, object]]:
    """Save three times (step-20, "latest", then "final" with the loop's step); each operation span's
    checkpoint id and ``dcp.training.step``. The spans also go to a file the report reads."""
    provider = TracerProvider()
    exporter = OTLPJsonFileExporter(tmp_path / "spans.jsonl")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    dcp_otel.instrument(tracer_provider=provider, registry=CollectorRegistry(), **options)
    state = {"w": torch.zeros(4)}
    try:
        dcp.save(state, checkpoint_id=str(tmp_path / "step-20"))
        dcp.save(state, checkpoint_id=str(tmp_path / "latest"))
        with dcp_otel.training_step(30):
            dcp.save(state, checkpoint_id=str(tmp_path / "final"))
        dcp_otel.flush(timeout_s=30)
    finally:
        dcp_otel.uninstrument()
        provider.shutdown()
    saves = [s for s in read_spans([tmp_path / "spans.jsonl"]) if s.name == "dcp.save"]
    return [(Path(str(s.attributes[semconv.ATTR_CHECKPOINT_ID])).name, s.attributes.get(semconv.ATTR_TRAINING_STEP))
            for s in sorted(saves, key=lambda s: s.start_ns)]  # fmt: skip


def test_every_operation_span_says_its_step_and_the_report_names_it(tmp_path: Path) -> None:
    assert _saves(tmp_path) == [("step-20", 20), ("latest", None), ("final", 30)]
    text = build([tmp_path / "spans.jsonl"]).text(limit=None)
    assert "save " + str(tmp_path / "step-20") + " (step 20)" in text
    assert "(step 30)" in text


def test_with_the_pattern_off_only_the_loop_says_a_step(tmp_path: Path) -> None:
    assert _saves(tmp_path, step_pattern="off") == [("step-20", None), ("latest", None), ("final", 30)]
