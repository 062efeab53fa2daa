"""The instrumentor contract: on, off, twice, zero-code, options, a different torch."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint._async_process_executor as process_executor
import torch.distributed.checkpoint._async_thread_executor as thread_executor
import torch.distributed.checkpoint._consolidate_hf_safetensors as dcp_consolidate
import torch.distributed.checkpoint._experimental.barriers as exp_barriers
import torch.distributed.checkpoint._experimental.checkpoint_process as exp_process
import torch.distributed.checkpoint._experimental.checkpoint_reader as exp_reader
import torch.distributed.checkpoint._experimental.checkpoint_writer as exp_writer
import torch.distributed.checkpoint._experimental.checkpointer as exp_checkpointer
import torch.distributed.checkpoint._experimental.staging as exp_staging
import torch.distributed.checkpoint.hf_storage as dcp_hf_storage
import torch.distributed.checkpoint.logger as dcp_logger_module
import torch.distributed.checkpoint.staging as dcp_staging
import torch.distributed.checkpoint.state_dict as dcp_state_dict
import torch.distributed.checkpoint.state_dict_loader as dcp_loader
import torch.distributed.checkpoint.state_dict_saver as dcp_saver
import torch.distributed.checkpoint.utils as dcp_utils
import torch.distributed.distributed_c10d as c10d
from opentelemetry.sdk.trace import TracerProvider

import dcp_otel
from dcp_otel import DCPInstrumentor, semconv
from dcp_otel.attach import torch_checkpointing
from dcp_otel.attach.logger_tap import DCPLoggerTap
from dcp_otel.config import InstrumentOptions
from tests.ranks import REPO
from tests.spans_io import from_readable, named


def originals() -> dict[str, object]:
    process = process_executor
    return {
        "wrap_exception": dcp_utils.__dict__["_wrap_exception"],
        **{f"dist_wrapper.{name}": dcp_utils._DistWrapper.__dict__[name]
           for name in ("gather_object", "scatter_object", "broadcast_object", "all_gather_object", "barrier",
                        "reduce_scatter", "all_reduce", "all_gather", "broadcast")},  # fmt: skip
        "object_to_tensor": c10d.__dict__["_object_to_tensor"],
        "tensor_to_object": c10d.__dict__["_tensor_to_object"],
        "execute_save": thread_executor._ThreadBasedAsyncCheckpointExecutor.__dict__["execute_save"],
        "save_wrapper": thread_executor.__dict__["save_wrapper"],
        "saver_storage_setup": dcp_saver.__dict__["_storage_setup"],
        "loader_storage_setup": dcp_loader.__dict__["_storage_setup"],
        **{f"staging.{cls.__name__}.stage": cls.__dict__["stage"]
           for cls in (dcp_staging.DefaultStager, dcp_staging.BlockingAsyncStager)},  # fmt: skip
        "process_execute_save": process._ProcessBasedAsyncCheckpointExecutor.__dict__["execute_save"],
        "process_execute_save_impl": process._ProcessBasedAsyncCheckpointExecutor.__dict__["_execute_save_impl"],
        "init_info": process._ProcessGroupInitInfo.__dict__["__init__"],
        "daemon_init": process._AsyncCheckpointProcess.__dict__["__init__"],
        "daemon_send": process._AsyncCheckpointProcess.__dict__["_send"],
        "daemon_save": process._AsyncCheckpointProcess.__dict__["save"],
        **{f"state_dict.{name}": dcp_state_dict.__dict__[name]
           for name in ("_gc_context", "_get_model_state_dict", "_get_optim_state_dict", "_load_model_state_dict",
                        "_load_optim_state_dict")},  # fmt: skip
        "hf_consolidate": dcp_hf_storage.__dict__["consolidate_safetensors_files"],
        "consolidate": dcp_consolidate.__dict__["consolidate_safetensors_files"],
        "consolidate_on_every_rank": dcp_consolidate.__dict__["consolidate_safetensors_files_on_every_rank"],
        **{f"checkpointer.{cls.__name__}.{name}": cls.__dict__[name]
           for cls in (exp_checkpointer.SyncCheckpointer, exp_checkpointer.AsyncCheckpointer) for name in ("save", "load")},
        "stager.stage": exp_staging.DefaultStager.__dict__["stage"],
        "writer.write": exp_writer.CheckpointWriter.__dict__["write"],
        "reader.read": exp_reader.CheckpointReader.__dict__["read"],
        "dist_barrier": exp_barriers.DistBarrier.__dict__["execute_barrier"],
        "tcp_store_barrier": exp_barriers.TCPStoreBarrier.__dict__["execute_barrier"],
        **{f"checkpoint_process.{name}": exp_process.CheckpointProcess.__dict__[name]
           for name in ("__init__", "_create_subprocess", "write", "_write", "_send")},
        # torch_checkpointing (installed by the test command), each of its points by name.
        **{f"{module}.{name}": _defined(module, name) for module, name, *_ in torch_checkpointing.POINTS},
    }  # fmt: skip


def _defined(module: str, name: str) -> object:
    owner: object = importlib.import_module(module)
    *path, attr = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    return vars(owner)[attr]


def daemon_entry() -> tuple[object, object]:  # replaced, not wrapped: torch pickles them by name into the process
    return (process_executor._AsyncCheckpointProcess.__dict__["_checkpointing_subprocess"],
            exp_process.CheckpointProcess.__dict__["_subprocess"],
            _defined(torch_checkpointing.PROCESS_MODULE, f"{torch_checkpointing.PROCESS_CLASS}._subprocess"))  # fmt: skip


def dcp_logger() -> object:  # what torch's _dcp_method_logger calls: a module global the tap replaces
    return dcp_logger_module.__dict__["_dcp_logger"]


def test_this_torch_has_every_attachment_point(provider) -> None:
    """Run on every tested torch release (2.13.0, and 2.15.0 by scripts/test.sh): nothing is missing."""
    dcp_otel.instrument(tracer_provider=provider[0])
    try:
        installed = DCPInstrumentor().installed
        assert installed is not None and installed.missing == [], torch.__version__
        assert installed.library_missing == []  # torch_checkpointing, which the test command installs
    finally:
        dcp_otel.uninstrument()


def test_every_patch_point_is_covered_by_the_identity_check() -> None:
    from dcp_otel.attach.patches import PATCHES

    assert len(originals()) == len(PATCHES)  # a new patch point must join originals()


def test_uninstrument_restores_every_original_object(provider) -> None:
    before, logger_before, entry_before = originals(), dcp_logger(), daemon_entry()
    handlers_before = list(logger_before.handlers)  # type: ignore[attr-defined]

    dcp_otel.instrument(tracer_provider=provider[0])
    during, entry_during, logger_during = originals(), daemon_entry(), dcp_logger()
    dcp_otel.uninstrument()

    assert all(during[name] is not before[name] for name in before)  # really patched
    assert all(during is not before for during, before in zip(entry_during, entry_before, strict=True))
    assert isinstance(logger_during, DCPLoggerTap) and logger_during.logger is logger_before
    after = originals()
    assert all(after[name] is before[name] for name in before), after
    assert all(after is before for after, before in zip(daemon_entry(), entry_before, strict=True))
    assert dcp_logger() is logger_before and logger_before.handlers == handlers_before  # type: ignore[attr-defined]


def test_uninstrument_leaves_a_wrapper_another_tool_put_over_ours(provider, tmp_path: Path) -> None:
    """Another tool wraps after instrument(): uninstrument() keeps its wrappers, and ours under them go quiet."""
    before_setup, before_logger = dcp_saver._storage_setup, dcp_logger()
    dcp_otel.instrument(tracer_provider=provider[0])
    calls: list[str] = []
    ours_setup, ours_logger = dcp_saver._storage_setup, dcp_logger()

    def theirs_setup(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("setup")
        return ours_setup(*args, **kwargs)

    class TheirLogger:  # a stand-in of their own over our tap, passing everything on
        def __getattr__(self, name: str) -> object:
            calls.append(name) if name in ("debug", "error") else None
            return getattr(ours_logger, name)

    dcp_saver._storage_setup, dcp_logger_module._dcp_logger = theirs_setup, TheirLogger()
    try:
        dcp_otel.uninstrument()
        assert dcp_saver._storage_setup is theirs_setup and isinstance(dcp_logger(), TheirLogger)
        provider[1].clear()
        state = {"w": torch.arange(4.0)}
        dcp.save(state, checkpoint_id=str(tmp_path / "after"))
        loaded = {"w": torch.zeros(4)}
        dcp.load(loaded, checkpoint_id=str(tmp_path / "after"))
        assert torch.equal(loaded["w"], state["w"]) and "setup" in calls and "debug" in calls  # still called
        dcp_otel.flush()
        assert provider[1].get_finished_spans() == ()  # ours, under theirs, record nothing
    finally:
        dcp_saver._storage_setup, dcp_logger_module._dcp_logger = before_setup, before_logger


def test_instrumenting_twice_only_warns_and_records_once(provider, tmp_path: Path, caplog) -> None:
    dcp_otel.instrument(tracer_provider=provider[0])
    try:
        with caplog.at_level(logging.WARNING):
            dcp_otel.instrument(tracer_provider=provider[0])
        assert "already instrumented" in caplog.text
        tap = dcp_logger()
        assert isinstance(tap, DCPLoggerTap) and not isinstance(tap.logger, DCPLoggerTap)
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "c"))
    finally:
        dcp_otel.uninstrument()
    spans = from_readable(provider[1].get_finished_spans())
    assert len(named(spans, "dcp.save")) == 1 and len(named(spans, "dcp.write_data")) == 1


def test_a_second_instrument_asking_for_other_options_says_which_stay_in_force(provider, caplog) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    dcp_otel.instrument(tracer_provider=provider[0], detail="full", slowest_keys=3)
    try:
        with caplog.at_level(logging.WARNING, logger="dcp_otel"):
            dcp_otel.instrument(tracer_provider=provider[0], detail="full", slowest_keys=3)  # the same: no word
            assert "In force" not in caplog.text
            other = TracerProvider()
            dcp_otel.instrument(tracer_provider=other, detail="auto", slowest_keys=3)
        (line,) = [r.getMessage() for r in caplog.records if "In force" in r.getMessage()]
        assert "detail='full'" in line and "detail='auto'" in line and "tracer_provider=" in line
        assert "slowest_keys" not in line  # only what differs
        assert DCPInstrumentor().recorder.options.detail == "full"  # nothing changed
        with pytest.raises(ValueError, match="detail"):  # a bad value is an error, instrumented or not
            dcp_otel.instrument(detail="everything")
    finally:
        dcp_otel.uninstrument()


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [("tracer_provider", "x", "tracer_provider must be an opentelemetry TracerProvider, got str"),
     ("tracer_provider", object(), "got object"),
     ("registry", "x", "registry must be a prometheus_client CollectorRegistry, got str"),
     ("meter_provider", "x", "meter_provider must be an opentelemetry MeterProvider, got str"),
     ("meter_provider", TracerProvider(), "got TracerProvider")],
)
def test_a_provider_or_registry_of_the_wrong_type_is_a_clear_error(option: str, value: object, expected: str) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        dcp_otel.instrument(**{option: value})
    assert DCPInstrumentor().recorder is None  # nothing attached


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
provider.force_flush()                    # spans are built off the training thread: flush to read them
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


def test_a_process_under_opentelemetry_instrument_that_never_imports_torch_loads_none_of_it(tmp_path: Path) -> None:
    """opentelemetry-instrument instruments every Python process it starts (a tokenizer, pip, a helper script):
    dcp-otel's instrumentor runs there, checks its options and waits for torch; it attaches once torch comes."""
    script = """
import sys
import dcp_otel
before = "torch" in sys.modules, dcp_otel.DCPInstrumentor().is_instrumented_by_opentelemetry
import torch.distributed.checkpoint
print(before, dcp_otel.DCPInstrumentor().recorder is not None)
"""
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}
    instrument = Path(sys.executable).with_name("opentelemetry-instrument")
    out = subprocess.run([str(instrument), sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["(False,", "True)", "True"], out.stdout  # no torch until the script's; then attached


def test_ranks_started_by_torch_multiprocessing_spawn_serve_their_metrics_and_a_spawned_helper_does_not(
    tmp_path: Path,
) -> None:
    """Ranks are ranks however they were started: a process ``multiprocessing`` spawned serves
    ``DCP_OTEL_METRICS_PORT`` once it makes a DCP call of its own (a DataLoader worker never does)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), semconv.ENV_METRICS_PORT: "0",
           semconv.ENV_METRICS_ADDR: "127.0.0.1"}  # fmt: skip
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "workers" / "spawned_ranks.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert all(r["before"] is None and r["after"].startswith("http://127.0.0.1:") for r in ranks), ranks
    assert ranks[0]["after"] != ranks[1]["after"]  # each its own
    assert json.loads((tmp_path / "helper.json").read_text()) == {"before": None, "after": None}


def test_opentelemetry_instrument_torchrun_needs_no_code_in_workers_or_their_checkpoint_daemons(
    tmp_path: Path,
) -> None:
    """Zero code, end to end: OTEL_* and DCP_OTEL_* reach every worker and daemon.

    Spans travel over real OTLP/HTTP to a loopback receiver; the per-rank
    metrics endpoints are read by the workers themselves at the end.
    """
    from tests.otlp_receiver import OtlpReceiver
    from tests.ports import free_port_range
    from tests.ranks import WORKERS

    bindir = Path(sys.executable).parent
    with OtlpReceiver() as receiver:
        env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_METRICS_EXPORTER": "none",
               "OTEL_LOGS_EXPORTER": "none", "OTEL_SERVICE_NAME": "zero-code-torchrun",
               "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "dcp_otel", "OMP_NUM_THREADS": "1",
               "DCP_OTEL_METRICS_PORT": str(free_port_range(2)), "CKPT": str(tmp_path / "c"),
               "ASYNC_PROCESS": "1", "SCRAPE_TO": str(tmp_path)}  # fmt: skip
        run = subprocess.run(
            [str(bindir / "opentelemetry-instrument"), str(bindir / "torchrun"), "--standalone", "--nproc-per-node",
             "2", str(WORKERS / "plain_train.py")],
            capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "cannot serve metrics" not in run.stderr  # no launcher, daemon or helper took a rank's port
    spans = receiver.spans

    # One trace per checkpoint, as received: the save, and the async save whose
    # upload each rank's daemon did.
    saves = [s for s in spans if s.name == "dcp.save" and s.attributes["dcp.operation"] == "save"]
    assert sorted(s.attributes["dcp.rank"] for s in saves) == [0, 1]
    async_saves = [s for s in spans if s.name == "dcp.async_save"]
    assert len(async_saves) == 2
    for trace_id in {saves[0].trace_id, async_saves[0].trace_id}:
        in_trace = [s for s in spans if s.trace_id == trace_id]
        assert [s.name for s in in_trace].count("dcp.checkpoint") == 1
        ids = {s.span_id for s in in_trace}
        assert all(s.parent_id in ids for s in in_trace if s.name != "dcp.checkpoint")  # no orphans
    assert len({s.trace_id for s in saves}) == 1 and len({s.trace_id for s in async_saves}) == 1
    uploads = {s.span_id: s for s in spans if s.name == "dcp.async_upload"}
    daemon_saves = [s for s in spans if s.name == "dcp.save" and s.attributes["dcp.operation"] == "async_save"]
    assert sorted(uploads[s.parent_id].attributes["dcp.rank"] for s in daemon_saves) == [0, 1]

    # Resource attributes: service, host, rank and run id, per process.
    for span in spans:
        resource = span.resource
        assert resource["service.name"] == "zero-code-torchrun" and resource["host.name"]
        assert resource["dcp.rank"] == span.attributes["dcp.rank"]
        assert resource["dcp.world_size"] == 2
    assert len({s.resource["dcp.run_id"] for s in spans}) == 1  # torchrun's run id, on every rank

    # Each rank's endpoint, on base port + LOCAL_RANK, serves that rank, daemon included.
    for rank in (0, 1):
        text = (tmp_path / f"metrics-{rank}.txt").read_text()
        assert f'dcp_operations_total{{operation="save",rank="{rank}",status="success"}} 1.0' in text
        assert (f'dcp_step_duration_seconds_count{{operation="async_save",rank="{rank}",step="write_data"}} 1.0'
                in text)  # fmt: skip


NOWHERE_SCRIPT = """
import json, sys, tempfile, warnings, torch, torch.distributed.checkpoint as dcp
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
import dcp_otel
warnings.simplefilter("ignore")
if sys.argv[1] == "provider-without-processor":
    trace.set_tracer_provider(TracerProvider())
dcp_otel.instrument()
for _ in range(3):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tempfile.mkdtemp())
dcp_otel.flush()
print(json.dumps(dcp_otel.diagnostics()))
"""


@pytest.mark.parametrize(
    ("setup", "environment", "expected"),
    [
        ("no-provider", {}, "no OpenTelemetry tracer provider is set in this process"),
        ("provider-without-processor", {}, "the tracer provider has no span processor"),
        ("no-provider", {"OTEL_TRACES_EXPORTER": "none"}, None),  # no traces asked for: nothing to say
    ],
)
def test_spans_that_go_nowhere_are_said_in_one_line_once(setup: str, environment: dict, expected: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    run = subprocess.run([sys.executable, "-c", NOWHERE_SCRIPT, setup], capture_output=True, text=True, timeout=120,
                         cwd=REPO, env={**env, **environment})  # fmt: skip
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stderr.splitlines() if "DCP spans go nowhere" in line]
    if expected is None:
        assert said == [], run.stderr
    else:
        assert len(said) == 1 and expected in said[0], run.stderr  # three saves, one line
    problems = json.loads(run.stdout.strip().splitlines()[-1])
    assert problems == {"open_spans": 0}  # a set-up, not a telemetry failure: the problems alert stays quiet


def test_opentelemetry_instrument_that_configured_nothing_is_named_by_dcp_otel(tmp_path: Path) -> None:
    """opentelemetry-instrument whose configurator did not run: the job trains, and dcp-otel says why no spans."""
    script = tmp_path / "train.py"
    script.write_text(ZERO_CODE_SCRIPT)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
           "OTEL_PYTHON_CONFIGURATOR": "not-installed", "OTEL_TRACES_EXPORTER": "otlp"}  # fmt: skip
    instrument = Path(sys.executable).with_name("opentelemetry-instrument")
    run = subprocess.run([str(instrument), sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stderr.splitlines() if "DCP spans go nowhere" in line]
    assert len(said) == 1 and "pip install opentelemetry-distro" in said[0], run.stderr


def test_a_hot_patch_takes_the_originals_place_or_goes_through_wrapt_when_it_cannot() -> None:
    """A hot patch's replacer gets the original and returns what is called instead, exactly as the original
    (on a class, the instance first): in the original's place for a plain function or method, through
    wrapt for anything else (a static method, a builtin), with the same arguments and results either way."""
    import math
    import types

    from dcp_otel.attach.wrapping import wrap

    seen: list[tuple[object, ...]] = []

    def replacer(original):
        def replacement(*args, **kwargs):
            seen.append(args)
            return original(*args, **kwargs)

        return replacement

    class Collectives:
        def gather_object(self, obj, *, dst=0):
            return (self, obj, dst)

        @staticmethod
        def barrier(tag):
            return f"barrier {tag}"

    module = types.ModuleType("fake_c10d")
    module.sqrt = math.sqrt  # a builtin: not a plain function

    def _object_to_tensor(obj, device, group=None):
        return (obj, device, group)

    module._object_to_tensor = _object_to_tensor
    plain_method = vars(Collectives)["gather_object"]
    for owner, attr in ((Collectives, "gather_object"), (Collectives, "barrier"), (module, "sqrt"),
                        (module, "_object_to_tensor")):  # fmt: skip
        wrap(owner, attr, replacer, hot=True)

    one = Collectives()
    assert one.gather_object("plan", dst=1) == (one, "plan", 1)
    assert Collectives.barrier("x") == one.barrier("x") == "barrier x"
    assert module.sqrt(9.0) == 3.0
    assert module._object_to_tensor("o", "cpu", group="g") == ("o", "cpu", "g")
    # In the original's place (one frame, named and documented as the original), or wrapt's proxy.
    assert type(vars(Collectives)["gather_object"]) is types.FunctionType
    assert vars(Collectives)["gather_object"].__wrapped__ is plain_method
    assert module._object_to_tensor.__wrapped__ is _object_to_tensor
    assert module._object_to_tensor.__name__ == "_object_to_tensor"
    assert type(module.sqrt) is not types.BuiltinFunctionType  # wrapt's FunctionWrapper
    # A replacement on a class takes the instance first: wrapt gives a static method's as None.
    assert seen == [(one, "plan"), (None, "x"), (None, "x"), (9.0,), ("o", "cpu")]
