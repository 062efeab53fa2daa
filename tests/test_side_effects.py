"""Instrumentation changes nothing the user sees besides its own telemetry."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.ranks import REPO, rank_env

SCRIPT = textwrap.dedent(
    """
    import warnings
    import torch
    import torch.distributed.checkpoint as dcp
    from opentelemetry.sdk.trace import TracerProvider
    import dcp_otel

    def warn():
        warnings.warn("shown once per place, as Python's default filter says", UserWarning)

    warn()
    dcp_otel.instrument(tracer_provider=TracerProvider())
    dcp.save({"w": torch.ones(4)}, checkpoint_id={ckpt!r})  # the first operation gets our tracer
    warn()
    dcp_otel.uninstrument()
    """
)


def test_a_warning_shown_before_instrument_is_not_shown_again_after_a_checkpoint(tmp_path: Path) -> None:
    # A fresh interpreter: pytest manages warnings itself, a user's script does not.
    script = SCRIPT.replace("{ckpt!r}", repr(str(tmp_path / "ckpt")))
    done = subprocess.run([sys.executable, "-c", script], env=rank_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("shown once per place") == 1, done.stderr
