"""The typed public API type-checks (mypy --strict) and the code passes ruff."""

from __future__ import annotations

import subprocess
import sys

from tests.ranks import REPO


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600, cwd=REPO)


def test_the_package_type_checks_strictly() -> None:
    checked = run("mypy")  # settings in pyproject.toml: strict, files = dcp_otel, mixin
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_ruff_finds_nothing() -> None:
    checked = run("ruff", "check", "dcp_otel", "mixin", "tests", "examples", "benchmarks")
    assert checked.returncode == 0, checked.stdout + checked.stderr
