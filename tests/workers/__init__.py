"""Real multi-process jobs the tests run: each file is one rank (or one process) of a job.

Ranks started by :func:`tests.ranks.run_ranks` share one command line, read by
:func:`rank_parser`.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def rank_parser() -> argparse.ArgumentParser:
    """``--rank --world`` (ints) and ``--store --out --ckpt`` (paths), as tests/ranks.py passes them;
    add a worker's own options to it."""
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world"):
        parser.add_argument(name, type=int, required=True)
    for name in ("--store", "--out", "--ckpt"):
        parser.add_argument(name, type=Path, required=True)
    return parser


def rss_kib() -> int:
    """This process's resident memory, in KiB (Linux)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
