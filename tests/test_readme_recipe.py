"""The README's zero-code recipe, run as printed in a fresh virtualenv: a 2-rank job's spans reach a Collector.

The training environment is a new virtualenv holding only torch (the CPU build) and numpy, as a user's
would. Then, in bash with that environment first on ``PATH`` (an activated virtualenv), the README's
install command and its ``opentelemetry-instrument`` block run exactly as printed, with three things
replaced: the path to dcp-otel (this checkout), the Collector's address (an OTLP/HTTP receiver on
loopback) and the job (``--nproc-per-node 2`` of a script that only checkpoints with DCP and knows
nothing of dcp-otel), plus a free metrics port so that the test never collides with another.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from dcp_otel import semconv
from tests.otlp_receiver import OtlpReceiver
from tests.ports import free_port_range
from tests.ranks import REPO, WORKERS

README = (REPO / "README.md").read_text()
COLLECTOR, SCRIPT = "http://otel-collector:4318", "torchrun --nproc-per-node 8 train.py"


def readme_recipe() -> tuple[str, str]:
    """(the install command, the zero-code block), as the README prints them."""
    install = re.search(r"`(pip install '/path/to/dcp-otel\[otlp\]')`", README)
    block = next(b for b in re.findall(r"```bash\n(.*?)```", README, re.S) if "opentelemetry-instrument" in b)
    assert install is not None and COLLECTOR in block and SCRIPT in block, "the README's recipe changed"
    return install.group(1), block


def test_the_readmes_zero_code_recipe_as_printed_delivers_a_2_rank_jobs_spans(tmp_path: Path) -> None:
    install, block = readme_recipe()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    torch_version = torch.__version__.split("+")[0]
    setup = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            f"torch=={torch_version}", "numpy"], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert setup.returncode == 0, setup.stderr[-3000:]
    metrics_port, master_port = free_port_range(2), free_port_range(1)
    with OtlpReceiver() as receiver:
        script = "\n".join([
            "set -euo pipefail",
            install.replace("/path/to/dcp-otel", str(REPO)) + " --quiet --disable-pip-version-check",
            block.replace(COLLECTOR, receiver.endpoint).replace("9710", str(metrics_port))
                 .replace(SCRIPT, f"torchrun --nproc-per-node 2 {WORKERS / 'plain_train.py'}"),
        ])  # fmt: skip
        # A user's shell: their training environment first on PATH, none of this test run's settings.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DCP_OTEL_", "PYTHON"))}
        env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", VIRTUAL_ENV=str(venv), CKPT=str(tmp_path / "ckpt"),
                   PET_MASTER_PORT=str(master_port))  # torchrun's --master-port, away from other tests' 29500
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=900, env=env,
                              cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "Failed to auto initialize" not in done.stderr, done.stderr[-3000:]
    saves = [s for s in receiver.spans if s.name == "dcp.save"]
    assert sorted(s.attributes[semconv.ATTR_RANK] for s in saves) == [0, 1], done.stderr[-3000:]
    (root,) = [s for s in receiver.spans if s.name == semconv.SPAN_CHECKPOINT and s.trace_id == saves[0].trace_id]
    assert all(s.trace_id == root.trace_id and s.parent_id == root.span_id for s in saves)  # one trace, both ranks
    assert {s.resource.get("service.name") for s in saves} == {"llm-pretrain"}  # the printed OTEL_SERVICE_NAME
