"""The instrumentor contract: on, off, twice, zero-code, options, a different torch."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint._async_thread_executor as thread_executor
import torch.distributed.checkpoint.state_dict_loader as dcp_loader
import torch.distributed.checkpoint.state_dict_saver as dcp_saver
import torch.distributed.checkpoint.utils as dcp_utils
from torch.distributed.checkpoint.logger import _dcp_logger

import dcp_otel
from dcp_otel import DCPInstrumentor, semconv
from dcp_otel.config import InstrumentOptions
from dcp_otel.handler import DCPLogHandler
from tests.ranks import REPO
from tests.spans_io import from_readable, named


def originals() -> dict[str, object]:
    return {
        "wrap_exception": dcp_utils.__dict__["_wrap_exception"],
        "gather_object": dcp_utils._DistWrapper.__dict__["gather_object"],
        "execute_save": thread_executor._ThreadBasedAsyncCheckpointExecutor.__dict__["execute_save"],
        "save_wrapper": thread_executor.__dict__["save_wrapper"],
        "saver_storage_setup": dcp_saver.__dict__["_storage_setup"],
        "loader_storage_setup": dcp_loader.__dict__["_storage_setup"],
    }


def our_handlers() -> list[logging.Handler]:
    return [h for h in _dcp_logger.handlers if isinstance(h, DCPLogHandler)]


def test_every_patch_point_is_covered_by_the_identity_check() -> None:
    from dcp_otel.torch_hooks import PATCHES

    assert len(originals()) == len(PATCHES)  # a new patch point must join originals()


def test_uninstrument_restores_every_original_object(provider) -> None:
    before, handlers_before = originals(), list(_dcp_logger.handlers)

    dcp_otel.instrument(tracer_provider=provider[0])
    during = originals()
    dcp_otel.uninstrument()

    assert all(during[name] is not before[name] for name in before)  # really patched
    after = originals()
    assert all(after[name] is before[name] for name in before), after
    assert _dcp_logger.handlers == handlers_before and not our_handlers()


def test_instrumenting_twice_only_warns_and_records_once(provider, tmp_path: Path, caplog) -> None:
    dcp_otel.instrument(tracer_provider=provider[0])
    try:
        with caplog.at_level(logging.WARNING):
            dcp_otel.instrument(tracer_provider=provider[0])
        assert "already instrumented" in caplog.text
        assert len(our_handlers()) == 1
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "c"))
    finally:
        dcp_otel.uninstrument()
    spans = from_readable(provider[1].get_finished_spans())
    assert len(named(spans, "dcp.save")) == 1 and len(named(spans, "dcp.write_data")) == 1


def test_nothing_is_recorded_after_uninstrument(provider, tmp_path: Path) -> None:
    dcp_otel.instrument(tracer_provider=provider[0])
    dcp_otel.uninstrument()
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "c"))
    assert provider[1].get_finished_spans() == ()


def test_registered_as_an_opentelemetry_instrumentor_entry_point() -> None:
    (entry,) = [e for e in importlib.metadata.entry_points(group="opentelemetry_instrumentor") if e.name == "torch_dcp"]
    assert entry.load() is DCPInstrumentor


def test_bad_options_fail_at_configuration_time() -> None:
    with pytest.raises(ValueError, match="unknown dcp_otel option"):
        dcp_otel.instrument(run_idd="typo")
    with pytest.raises(ValueError, match="slowest_keys must be an integer from 0 to 100"):
        dcp_otel.instrument(slowest_keys=-1)
    with pytest.raises(ValueError, match="run_id must be a non-empty string"):
        dcp_otel.instrument(run_id="  ")
    assert DCPInstrumentor().recorder is None  # nothing was half-installed


def test_keyword_beats_environment_beats_default(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setenv(semconv.ENV_RUN_ID, "from-env")
    monkeypatch.setenv(semconv.ENV_SLOWEST_KEYS, "7")
    assert InstrumentOptions.from_kwargs({}).run_id == "from-env"
    assert InstrumentOptions.from_kwargs({"run_id": "from-kwarg"}).run_id == "from-kwarg"
    assert InstrumentOptions.from_kwargs({}).slowest_keys == 7
    assert InstrumentOptions.from_kwargs({"slowest_keys": 2}).slowest_keys == 2
    monkeypatch.setenv(semconv.ENV_SLOWEST_KEYS, "many")
    with caplog.at_level(logging.WARNING, logger="dcp_otel"):
        assert InstrumentOptions.from_kwargs({}).slowest_keys == InstrumentOptions().slowest_keys
    assert f"ignoring {semconv.ENV_SLOWEST_KEYS}='many'" in caplog.text


def test_a_torch_with_different_internals_gets_one_warning_and_no_exception(
    provider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.delattr(thread_executor, "save_wrapper")
    monkeypatch.delattr(thread_executor._ThreadBasedAsyncCheckpointExecutor, "execute_save")
    with caplog.at_level(logging.WARNING, logger="dcp_otel"):
        dcp_otel.instrument(tracer_provider=provider[0])
    try:
        warnings = [r for r in caplog.records if r.name == "dcp_otel"]
        assert len(warnings) == 1
        assert "_async_thread_executor.save_wrapper" in warnings[0].getMessage()
        assert "_ThreadBasedAsyncCheckpointExecutor.execute_save" in warnings[0].getMessage()
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "c"))  # what exists still works
    finally:
        dcp_otel.uninstrument()
    assert named(from_readable(provider[1].get_finished_spans()), "dcp.write_data")


def test_a_torch_without_the_dcp_logger_is_named_in_the_warning(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    import torch.distributed.checkpoint.logger as dcp_logger_module

    monkeypatch.delattr(dcp_logger_module, "_dcp_logger")
    with caplog.at_level(logging.WARNING, logger="dcp_otel"):
        dcp_otel.instrument()
    try:
        assert "torch.distributed.checkpoint.logger._dcp_logger (no spans at all)" in caplog.text
    finally:
        dcp_otel.uninstrument()


GLOBAL_PROVIDER_SCRIPT = """
import tempfile, warnings, torch, torch.distributed.checkpoint as dcp
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
import dcp_otel
warnings.simplefilter("ignore")
dcp_otel.instrument()                      # before any SDK is configured ...
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)       # ... the global provider set later is used
dcp.save({"w": torch.ones(2)}, checkpoint_id=tempfile.mkdtemp())
print(sorted({s.name for s in exporter.get_finished_spans()}))
"""


def test_without_a_tracer_provider_the_global_one_is_used() -> None:
    out = subprocess.run(
        [sys.executable, "-c", GLOBAL_PROVIDER_SCRIPT], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert "'dcp.checkpoint'" in out.stdout and "'dcp.write_data'" in out.stdout, out.stdout


ZERO_CODE_SCRIPT = """
import tempfile, warnings, torch, torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")
dcp.save({"w": torch.ones(2)}, checkpoint_id=tempfile.mkdtemp())
"""


def test_opentelemetry_instrument_turns_it_on_with_no_code_change(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(ZERO_CODE_SCRIPT)
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "none",
           "OTEL_LOGS_EXPORTER": "none", "OTEL_SERVICE_NAME": "zero-code-test"}  # fmt: skip
    instrument = Path(sys.executable).with_name("opentelemetry-instrument")
    out = subprocess.run([str(instrument), sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    names = set(re.findall(r'"name": "(dcp\.[a-z_.]+)"', out.stdout))
    assert {"dcp.checkpoint", "dcp.save", "dcp.write_data", "dcp.finish_checkpoint"} <= names, out.stdout[-2000:]
    assert '"service.name": "zero-code-test"' in out.stdout


def test_opentelemetry_instrument_torchrun_traces_every_worker_in_one_trace(tmp_path: Path) -> None:
    from tests.ranks import WORKERS

    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "none",
           "OTEL_LOGS_EXPORTER": "none", "OMP_NUM_THREADS": "1", "CKPT": str(tmp_path / "c")}  # fmt: skip
    bindir = Path(sys.executable).parent
    run = subprocess.run(
        [str(bindir / "opentelemetry-instrument"), str(bindir / "torchrun"), "--standalone", "--nproc-per-node", "2",
         str(WORKERS / "plain_train.py")],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    spans = run.stdout + run.stderr  # the console exporter writes to the workers' stdout
    assert spans.count('"name": "dcp.save"') == 2  # one per worker, with no code in the script
    assert spans.count('"name": "dcp.checkpoint"') == 1  # one root, from the coordinator
    assert len(set(re.findall(r'"trace_id": "(0x[0-9a-f]{32})"', spans))) == 1  # one trace for the checkpoint
