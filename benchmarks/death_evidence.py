"""A rank killed mid-save, plain and instrumented: how soon the job ends, and how soon its evidence arrives.

    .venv/bin/python benchmarks/death_evidence.py [--runs 5] [--death SIGKILL]

Runs ``tests/workers/death_rank.py`` under a real ``torchrun`` (2 gloo ranks, ``--monitor-interval 0.1``):
rank 1 dies in the ``write_data`` of its second save (SIGKILL by default: the OOM killer), rank 0 waits for
it. Each round runs it once plain (``torchrun``) and once instrumented with no code change
(``opentelemetry-instrument torchrun``, spans over OTLP/HTTP to a receiver on loopback), interleaved, each
arm first in turn. It times, from the death (the moment rank 1 wrote that it is about to die):

* the job's end (torchrun's exit), in both arms: what dcp-otel adds to how a job ends (its agent sends the
  dead rank's spans before it exits);
* the arrival at the receiver of the dead rank's interrupted ``write_data``, sent by torchrun's agent from
  the rank's record (instrumented only): how long after a death its evidence is in the backend.

Prints the medians, their difference, and the slowest arrival. What it leaves out: the dying rank's own
cost (none: it runs nothing as it dies); a slow collector (the agent's send is bounded by
``flush_timeout_s``); start-up (not timed).
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from ab import Measures, interleave, median  # noqa: E402

from tests.otlp_receiver import OtlpReceiver  # noqa: E402
from tests.ranks import WORKERS, rank_env  # noqa: E402

BIN = Path(sys.executable).parent


class TimedReceiver(OtlpReceiver):
    """The loopback OTLP/HTTP receiver, noting when the dead rank's interrupted write arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.write_at: float | None = None

    def _add(self, request) -> None:  # type: ignore[no-untyped-def]
        super()._add(request)
        if self.write_at is None and any(s.name == "dcp.write_data" and s.error and s.attributes.get("dcp.rank") == 1
                                         for s in self.spans):  # fmt: skip
            self.write_at = time.time()


def once(out: Path, instrumented: bool, death: str) -> tuple[float, float | None, int]:
    """(seconds from the death to torchrun's end, to the evidence's arrival, torchrun's exit status)."""
    out.mkdir(parents=True)
    launcher = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1"]
    with TimedReceiver() as receiver:
        env = rank_env(DCP_OTEL_SPOOL_DIR=str(out / "spool"), OTEL_TRACES_EXPORTER="otlp", OTEL_METRICS_EXPORTER="none",
                       OTEL_LOGS_EXPORTER="none", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                       OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)  # fmt: skip
        command = [*([str(BIN / "opentelemetry-instrument")] if instrumented else []), *launcher,
                   str(WORKERS / "death_rank.py"), str(out), "--death", death]  # fmt: skip
        done = subprocess.run(command, env=env, cwd=out, capture_output=True, timeout=300)
        ended = time.time()
        died = (out / "dying-1").stat().st_mtime
        arrived = receiver.write_at - died if receiver.write_at is not None else None
    return ended - died, arrived, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--death", default="SIGKILL", choices=["SIGKILL", "SIGABRT", "SEGV", "SIGTERM"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = itertools.count()

        def arm(instrumented: bool) -> Measures:
            run = next(runs)
            took, arrived, code = once(Path(tmp) / str(run), instrumented, args.death)
            if not instrumented:
                return {"end": took, "exit": code}
            if arrived is None:
                raise SystemExit(f"death_evidence: run {run}: no interrupted write_data of rank 1 arrived")
            return {"end": took, "exit": code, "arrival": arrived}

        found = interleave({"plain": lambda: arm(False), "instrumented": lambda: arm(True)}, args.runs)
    plain, traced = median(found, "plain", "end"), median(found, "instrumented", "end")
    codes = {name: sorted({int(r["exit"]) for r in samples}) for name, samples in found.items()}
    print(f"rank 1 killed by {args.death} in write_data, torchrun with 2 gloo ranks, medians of {args.runs} "
          "interleaved runs:")  # fmt: skip
    print(f"  {'death to the job end, plain':<50} {plain:6.2f} s   exit {codes['plain']}")
    print(f"  {'death to the job end, opentelemetry-instrument':<50} {traced:6.2f} s   exit {codes['instrumented']}   "
          f"added {traced - plain:+.2f} s")  # fmt: skip
    arrived, slowest = median(found, "instrumented", "arrival"), max(r["arrival"] for r in found["instrumented"])
    print(f"  {'death to its interrupted write_data at the receiver':<50} {arrived:6.2f} s   (slowest {slowest:.2f} s)")


if __name__ == "__main__":
    main()
