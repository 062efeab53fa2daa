"""The torch a job pins stays as it is: dcp-otel does not depend on torch, warns once about an untested newer
release, instruments what a release has, and its command line runs where torch is not installed."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcp_otel
from dcp_otel.attach import releases
from tests.ranks import REPO, rank_env


def python(code: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout_s,
                          env=rank_env(), cwd=REPO)  # fmt: skip


def test_installing_dcp_otel_brings_no_torch(tmp_path: Path) -> None:
    """What pip would install for dcp-otel on a machine that has nothing: no torch, so never another torch."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--disable-pip-version-check", "--report", str(report), ".[otlp]"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "dcp-otel" in names and "opentelemetry-sdk" in names
    assert not {name for name in names if name == "torch" or name.startswith(("nvidia-", "triton"))}, names


def test_only_a_torch_newer_than_the_newest_tested_is_warned_about() -> None:
    assert [releases.untested_release_warning(v) for v in ("2.11.0+cu130", "2.13.0+cpu", "2.15.0")] == [None] * 3
    newer = releases.untested_release_warning("2.16.0a0+git1234")
    assert newer is not None and "torch 2.16.0a0+git1234 is newer" in newer and "2.11.0, 2.13.0, 2.15.0" in newer
    assert releases.release(torch.__version__) is not None  # this one reads


def test_instrument_warns_once_on_an_untested_newer_torch(provider: tuple, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    monkeypatch.setattr(torch, "__version__", "2.17.0")
    with caplog.at_level(logging.WARNING, logger="dcp_otel"):
        dcp_otel.instrument(tracer_provider=provider[0])
        dcp_otel.uninstrument()
    assert [r.getMessage() for r in caplog.records if "is newer than" in r.getMessage()] == [
        releases.untested_release_warning("2.17.0")]  # fmt: skip


def test_a_release_without_experimental_is_instrumented_and_says_nothing_of_it(
    tmp_path: Path,
) -> None:
    """torch's main branch removed ``torch.distributed.checkpoint._experimental`` after 2.15 (simulated here): its
    checkpointer lives on as ``torch_checkpointing``, so its absence is expected, not a warning."""
    done = python(
        "import sys, logging\n"
        "sys.modules['torch.distributed.checkpoint._experimental'] = None  # as if this torch had none\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "import torch, torch.distributed.checkpoint as dcp\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from opentelemetry.sdk.trace.export import SimpleSpanProcessor\n"
        "from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter\n"
        "import dcp_otel\n"
        "provider, spans = TracerProvider(), InMemorySpanExporter()\n"
        "provider.add_span_processor(SimpleSpanProcessor(spans))\n"
        "dcp_otel.instrument(tracer_provider=provider)\n"
        "dcp.save({'w': torch.ones(4)}, checkpoint_id=sys.argv[1])\n"
        "dcp.load({'w': torch.zeros(4)}, checkpoint_id=sys.argv[1])\n"
        "dcp_otel.flush()\n"
        "print(sorted({s.name for s in spans.get_finished_spans()}))\n",
        str(tmp_path / "c"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    names = set(eval(done.stdout.strip().splitlines()[-1]))  # noqa: S307 - our own script's printed list
    assert {"dcp.save", "dcp.load", "dcp.write_data", "dcp.read_data", "dcp.checkpoint"} <= names
    assert "Missing:" not in done.stderr and "_experimental" not in done.stderr, done.stderr


def test_the_command_line_and_the_mixin_run_where_torch_is_not_installed() -> None:
    done = python(
        "import sys\n"
        "sys.modules['torch'] = None  # any 'import torch' fails, as on a laptop without it\n"
        "from dcp_otel.cli import main\n"
        "for argv in (['--version'], ['report', 'tests/data/demo-3-ranks']):\n"
        "    try:\n"
        "        code = main(argv)\n"
        "    except SystemExit as exc:\n"
        "        code = exc.code\n"
        "    print('exit', code)\n"
        "import mixin.__main__, dcp_otel\n"
        "print('torch modules:', sorted(m for m in sys.modules if m.startswith('torch.')))\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("exit 0") == 2 and "dcp-otel 0." in done.stdout
    assert "straggler: rank 2" in done.stdout  # the report itself
    assert "torch modules: []" in done.stdout
