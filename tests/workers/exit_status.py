"""Run a worker as this process's child and record how it ended: ``$HANG_OUT/exit-$RANK``.

torchrun reports no worker's exit status when it is itself stopped with SIGTERM (it
raises and exits 1); a test comparing how workers end with and without dcp-otel
puts this between torchrun and each worker. It passes every signal's default on to
the worker (torchrun signals the whole process group, this one included), waits for
it, writes its ``returncode`` (``-15``: killed by SIGTERM), and ends the same way.

Usage: ``torchrun ... tests/workers/exit_status.py tests/workers/hang_rank.py --mode save``
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def main() -> None:
    # A Python handler (not SIG_IGN, which a child would inherit): the worker starts with the defaults.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    out = Path(os.environ["HANG_OUT"])
    # torchrun makes each worker the leader of its own process group: this one's, which the worker
    # and its checkpoint processes join. A test that must clean up kills the group.
    (out / f"pgid-{os.environ['RANK']}").write_text(str(os.getpgid(0)))
    code = subprocess.Popen([sys.executable, *sys.argv[1:]]).wait()
    (out / f"exit-{os.environ['RANK']}").write_text(str(code))
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
