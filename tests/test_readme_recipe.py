"""The zero-code recipes, run as printed in a fresh virtualenv: a 2-rank job's spans and metrics reach a Collector.

The training environment is a new virtualenv holding only torch (the CPU build) and numpy, as a user's
would. Then, in bash with that environment first on ``PATH`` (an activated virtualenv), each recipe runs
exactly as printed: the README's install command and its ``opentelemetry-instrument`` block, and
``docs/metrics.md``'s push recipe. Replaced are only the path to dcp-otel (this checkout), the
Collector's address (an OTLP/HTTP receiver on loopback), the job (``--nproc-per-node 2`` of a script
that only checkpoints with DCP and knows nothing of dcp-otel) and the metrics port (a free one, so that
the test never collides with another).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcp_otel import semconv
from tests.otlp_receiver import OtlpReceiver, value_of
from tests.ports import free_port_range
from tests.ranks import REPO, WORKERS

COLLECTOR, PATH = "http://otel-collector:4318", "/path/to/dcp-otel"
JOB = re.compile(r"(torchrun|dcp-otel-run) --nproc-per-node 8 train\.py")


def readme_recipe() -> str:
    """The README's install command, then its zero-code block, as printed."""
    readme = (REPO / "README.md").read_text()
    install = re.search(r"`(pip install '/path/to/dcp-otel\[otlp\]')`", readme)
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "opentelemetry-instrument" in b)
    assert install is not None, "the README's install command changed"
    return install.group(1) + "\n" + block


def push_recipe() -> str:
    """docs/metrics.md's recipe for pushing metrics over OTLP, as printed."""
    text = (REPO / "docs" / "metrics.md").read_text()
    return next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "OTEL_METRICS_EXPORTER=otlp" in b)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's training environment: a fresh virtualenv with torch and numpy, nothing else."""
    path = tmp_path_factory.mktemp("user") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    setup = subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            f"torch=={torch.__version__.split('+')[0]}", "numpy"], capture_output=True, text=True,
                           timeout=900)  # fmt: skip
    assert setup.returncode == 0, setup.stderr[-3000:]
    return path


def run_as_printed(recipe: str, venv: Path, tmp_path: Path, receiver: OtlpReceiver) -> subprocess.CompletedProcess[str]:
    assert COLLECTOR in recipe and PATH in recipe and JOB.search(recipe), "the recipe changed: " + recipe
    script = JOB.sub(lambda m: f"{m.group(1)} --nproc-per-node 2 {WORKERS / 'plain_train.py'}", recipe)
    script = script.replace(PATH, str(REPO)).replace(COLLECTOR, receiver.endpoint)
    script = script.replace("9710", str(free_port_range(2)))
    # A user's shell: their training environment first on PATH, none of this test run's settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DCP_OTEL_", "PYTHON"))}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", VIRTUAL_ENV=str(venv), CKPT=str(tmp_path / "ckpt"),
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_QUIET="1",
               PET_MASTER_PORT=str(free_port_range(1)))  # torchrun's --master-port, away from other tests' 29500
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True, timeout=900,
                          env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "Failed to auto initialize" not in done.stderr, done.stderr[-3000:]
    return done


def assert_one_trace_from_both_ranks(receiver: OtlpReceiver, log: str) -> None:
    saves = [s for s in receiver.spans if s.name == "dcp.save"]
    assert sorted(s.attributes[semconv.ATTR_RANK] for s in saves) == [0, 1], log[-3000:]
    (root,) = [s for s in receiver.spans if s.name == semconv.SPAN_CHECKPOINT and s.trace_id == saves[0].trace_id]
    assert all(s.trace_id == root.trace_id and s.parent_id == root.span_id for s in saves)  # one trace, both ranks
    assert {s.resource.get("service.name") for s in saves} == {"llm-pretrain"}  # the printed OTEL_SERVICE_NAME


def test_the_readmes_zero_code_recipe_as_printed_delivers_a_2_rank_jobs_spans(venv: Path, tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        done = run_as_printed(readme_recipe(), venv, tmp_path, receiver)
    assert_one_trace_from_both_ranks(receiver, done.stderr)


def test_the_push_recipe_as_printed_delivers_spans_and_every_ranks_metrics(venv: Path, tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        done = run_as_printed(push_recipe(), venv, tmp_path, receiver)
    assert_one_trace_from_both_ranks(receiver, done.stderr)
    ranks = {
        value_of(attribute.value)
        for item in receiver.metrics if item.metric.name == semconv.OPERATION_COUNT.otel
        for point in item.metric.sum.data_points
        for attribute in point.attributes if attribute.key == semconv.LABEL_RANK
    }  # fmt: skip
    assert ranks == {"0", "1"}, (ranks, done.stderr[-3000:])  # pushed by both ranks, no scrape
