"""Configuration: every variable documented, new options checked early, launchers and helpers not ranks."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

from dcp_otel import config, semconv
from dcp_otel.config import InstrumentOptions, is_rank_process
from dcp_otel.resource import TorchDistributedResourceDetector

CONFIGURATION = Path(__file__).parent.parent / "docs" / "configuration.md"


def test_every_environment_variable_we_read_is_in_the_configuration_table() -> None:
    variables = {value for name, value in vars(semconv).items() if name.startswith("ENV_")}
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", CONFIGURATION.read_text()))
    assert variables - documented == set()


def test_process_setup_must_name_an_importable_callable() -> None:
    assert InstrumentOptions(process_setup="tests.workers.daemon_setup:provider").process_setup
    for bad, message in (("no_colon", "expected 'module:function'"), ("no_such_module_x:f", "cannot import"),
                         ("tests.workers.daemon_setup:nothing", "does not name a callable")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            InstrumentOptions(process_setup=bad)


def test_bad_new_environment_variables_warn_and_use_the_default(monkeypatch: pytest.MonkeyPatch, caplog) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(semconv.ENV_PROCESS_SETUP, "not a function")
    monkeypatch.setenv(semconv.ENV_FLUSH_TIMEOUT_S, "-3")
    monkeypatch.setenv(semconv.ENV_SPAN_EXPORT, "agent")
    with caplog.at_level(logging.WARNING, logger="dcp_otel"):
        options = InstrumentOptions.from_kwargs({})
    assert options.process_setup is None and options.flush_timeout_s == InstrumentOptions().flush_timeout_s
    assert options.span_export == semconv.SPAN_EXPORT_PROCESS
    assert f"ignoring {semconv.ENV_SPAN_EXPORT}='agent'" in caplog.text
    monkeypatch.setenv(semconv.ENV_SPAN_EXPORT, " Node ")
    assert InstrumentOptions.from_kwargs({}).span_export == semconv.SPAN_EXPORT_NODE
    assert f"ignoring {semconv.ENV_PROCESS_SETUP}='not a function'" in caplog.text
    assert f"ignoring {semconv.ENV_FLUSH_TIMEOUT_S}='-3'" in caplog.text
    with pytest.raises(ValueError, match="flush_timeout_s must be an integer from 0 to 600"):
        InstrumentOptions.from_kwargs({"flush_timeout_s": 601})


@pytest.mark.parametrize(
    ("argv", "is_rank"),
    [
        (["python", "train.py"], True),
        (["python", "-m", "mytrainer"], True),
        (["python", "/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"], False),
        (["python", "-m", "torch.distributed.run", "train.py"], False),
        (["python", "/venv/bin/dcp-otel-run", "train.py"], False),
        (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()", "--multiprocessing-fork"],
         False),
        (["python", "-B", "-c", "from multiprocessing.resource_tracker import main;main(14)"], False),
    ],
)
def test_only_a_rank_serves_the_metrics_port_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], is_rank: bool
) -> None:
    monkeypatch.setattr(sys, "orig_argv", argv)
    monkeypatch.setenv(semconv.ENV_METRICS_PORT, "9710")
    assert is_rank_process() is is_rank
    assert InstrumentOptions.from_kwargs({}).metrics_port == (9710 if is_rank else None)
    assert InstrumentOptions.from_kwargs({"metrics_port": 9800}).metrics_port == 9800  # a keyword always wins


def test_the_resource_says_host_rank_and_the_run_id_of_the_trace_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv(semconv.ENV_TORCHELASTIC_RUN_ID, "job-7")
    attributes = TorchDistributedResourceDetector().detect().attributes
    assert attributes[semconv.ATTR_RANK] == 3 and attributes[semconv.RESOURCE_LOCAL_RANK] == 1
    assert attributes[semconv.ATTR_WORLD_SIZE] == 8 and attributes[semconv.ATTR_RUN_ID] == "job-7"
    assert attributes["host.name"]


def test_the_resource_detector_is_found_by_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.resources import Resource

    monkeypatch.setenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", semconv.RESOURCE_DETECTOR)
    monkeypatch.setenv("RANK", "5")
    assert Resource.create().attributes[semconv.ATTR_RANK] == 5
    assert config.resolve_callable("dcp_otel.resource:TorchDistributedResourceDetector")
