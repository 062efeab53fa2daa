"""Launch a real multi-process job of ``tests/workers/*.py`` ranks, bounded in time.

Each rank is its own Python process joined through a gloo ``FileStore``; the
job is killed as a whole if any rank fails or the time limit passes, so a test
never hangs CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).parent.parent


@dataclass
class Job:
    out: Path
    ckpt: Path
    world: int


def rank_env(**extra: str) -> dict[str, str]:
    """The environment of a test rank: this repository importable, one thread, plus ``extra``."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def rank_command(worker: str, rank: int, world: int, tmp: Path, out: Path, ckpt: Path) -> list[str]:
    """The command line of one rank of ``workers/<worker>.py`` (joined through a FileStore in ``tmp``)."""
    return [
        sys.executable, str(WORKERS / f"{worker}.py"),
        "--rank", str(rank), "--world", str(world), "--store", str(tmp / "store"),
        "--out", str(out), "--ckpt", str(ckpt),
    ]  # fmt: skip


def run_ranks(
    worker: str,
    world: int,
    tmp: Path,
    *,
    env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    ckpt: Path | None = None,
    timeout_s: float = 180.0,
    exit_codes: dict[int, int] | None = None,
) -> Job:
    """Run ``world`` ranks of ``workers/<worker>.py``; raise with their stderr on failure.

    ``ckpt`` (default: a folder in ``tmp``) lets two jobs write the same checkpoint ids.
    ``exit_codes`` gives the ranks expected to end otherwise than with 0 (say, -9 when killed).
    """
    out, ckpt = tmp / "out", ckpt or tmp / "ckpt"
    out.mkdir(parents=True, exist_ok=True)
    ckpt.mkdir(parents=True, exist_ok=True)
    child_env = rank_env(**(env or {}))
    procs = []
    logs = []
    for rank in range(world):
        log = open(out / f"stderr-{rank}.txt", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [*rank_command(worker, rank, world, tmp, out, ckpt), *(extra_args or [])]
        procs.append(subprocess.Popen(cmd, env=child_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    deadline = time.monotonic() + timeout_s
    failed = None
    try:
        for rank, proc in enumerate(procs):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                code = proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                failed = f"rank {rank} did not finish within {timeout_s:.0f}s"
                break
            if code != (exit_codes or {}).get(rank, 0):
                failed = f"rank {rank} exited with {code}"
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    if failed:
        details = "\n".join(f"--- rank {r}\n{(out / f'stderr-{r}.txt').read_text()[-4000:]}" for r in range(world))
        raise AssertionError(f"{failed}\n{details}")
    return Job(out=out, ckpt=ckpt, world=world)
