"""When OpenTelemetry's own set-up fails, dcp-otel is never loaded: `dcp-otel check` and `dcp-otel-run` say why, in one line.

Each case runs the real commands with a user's environment (no ``OTEL_*`` of this test run), the
set-up being the real one opentelemetry-instrument does (opentelemetry-distro is installed here, the
gRPC exporter is not, as with ``pip install 'dcp-otel[otlp]'``), against a real OTLP/HTTP receiver on
loopback or a port where nothing listens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.otlp_receiver import OtlpReceiver
from tests.ports import free_port_range
from tests.ranks import REPO

BIN = Path(sys.executable).parent
GRPC_FIX = "set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"
#: Spans to the console, nothing else: a set-up that works, so a problem said is the one under test.
QUIET = {"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}


def user_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DCP_OTEL_"))}
    return {**env, "PYTHONPATH": str(REPO), **settings}


def check(**settings: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "dcp-otel"), "check"], capture_output=True, text=True, timeout=120,
                          env=user_env(**settings))  # fmt: skip


def problems(run: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith("dcp-otel check: problem: ")]


def test_the_grpc_default_is_named_with_its_fix() -> None:
    run = check(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4318")
    assert run.returncode == 1
    (problem,) = problems(run)
    assert "OpenTelemetry's set-up fails" in problem and "otlp_proto_grpc" in problem and GRPC_FIX in problem
    assert "set-up: failed" in run.stdout


def test_spans_reach_a_receiver_and_the_check_says_so() -> None:
    with OtlpReceiver() as receiver:
        run = check(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                    OTEL_METRICS_EXPORTER="none", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert receiver.requests == 1 and receiver.spans == []  # the probe: one empty export, accepted
    assert problems(run) == [] and run.stdout.splitlines()[-1] == "dcp-otel check: ok"
    assert f"spans: OTLPSpanExporter -> {receiver.endpoint}/v1/traces: reached" in run.stdout
    assert "dcp-otel instrumentor (torch_dcp): installed" in run.stdout


def test_an_endpoint_where_nothing_listens_is_named() -> None:
    endpoint = f"http://127.0.0.1:{free_port_range(1)}"
    run = check(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                OTEL_METRICS_EXPORTER="none", OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_TIMEOUT="1")  # fmt: skip
    assert run.returncode == 1
    (problem,) = problems(run)
    assert f"could not export to {endpoint}/v1/traces" in problem and "Connection refused" in problem


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"OTEL_PYTHON_CONFIGURATOR": "not-installed"}, "no tracer provider is set up"),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
          "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "torch_dcp"}, "turns dcp-otel's instrumentor (torch_dcp) off"),
        ({**QUIET, "OTEL_SDK_DISABLED": "true"}, "OTEL_SDK_DISABLED=true: the SDK makes no spans"),
        ({**QUIET, "OTEL_TRACES_SAMPLER": "always_off"}, "the sampler drops every trace a job starts (AlwaysOffSampler)"),
        ({**QUIET, "OTEL_TRACES_SAMPLER": "parentbased_always_off"},
         "the sampler drops every trace a job starts (ParentBased{root:AlwaysOffSampler,...})"),
        ({**QUIET, "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
         "the sampler drops every trace a job starts (TraceIdRatioBased{0.0})"),
    ],
)  # fmt: skip
def test_a_set_up_that_configures_nothing_for_dcp_otel_is_named(settings: dict[str, str], expected: str) -> None:
    run = check(**settings)
    assert run.returncode == 1
    (problem,) = problems(run)
    assert expected in problem


def test_a_sampler_that_keeps_some_traces_is_not_a_problem() -> None:
    run = check(**QUIET, OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG="0.01")
    assert run.returncode == 0 and problems(run) == [], run.stderr


def test_no_traces_asked_for_is_not_a_problem() -> None:
    run = check(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    assert run.returncode == 0 and problems(run) == [], run.stderr
    assert "spans: not exported (OTEL_TRACES_EXPORTER=none)" in run.stdout


JOB = """
import tempfile, warnings, torch, torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")
dcp.save({"w": torch.ones(2)}, checkpoint_id=tempfile.mkdtemp())
print("checkpointed")
"""


@pytest.mark.parametrize("protocol", [None, "http/protobuf"])
def test_dcp_otel_run_says_once_that_its_workers_set_up_will_fail_and_starts_them(
    tmp_path: Path, protocol: str | None
) -> None:
    script = tmp_path / "train.py"
    script.write_text(JOB)
    with OtlpReceiver() as receiver:
        settings = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
                    "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "DCP_OTEL_AGENT_METRICS_PORT": "0",
                    "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(free_port_range(1))}  # fmt: skip
        if protocol:
            settings["OTEL_EXPORTER_OTLP_PROTOCOL"] = protocol
        env = user_env(**settings)
        env.pop("PYTHONPATH")  # opentelemetry-instrument sets it; dcp-otel is installed in this environment
        run = subprocess.run([str(BIN / "opentelemetry-instrument"), str(BIN / "dcp-otel-run"), "--standalone",
                              "--nproc-per-node", "1", str(script)], capture_output=True, text=True, timeout=180,
                             env=env, cwd=tmp_path)  # fmt: skip
        spans = list(receiver.spans)
    assert run.returncode == 0 and "checkpointed" in run.stdout, run.stderr[-3000:]
    said = [line for line in run.stderr.splitlines() if line.startswith("dcp-otel-run: warning: the workers")]
    if protocol is None:
        assert len(said) == 1 and "otlp_proto_grpc" in said[0] and GRPC_FIX in said[0], run.stderr[-3000:]
        assert spans == []  # the worker's set-up failed as said: nothing instrumented it
    else:
        assert said == [], run.stderr[-3000:]
        assert "dcp.save" in {s.name for s in spans}  # a working set-up: no word, and the spans arrive
