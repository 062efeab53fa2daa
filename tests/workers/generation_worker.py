"""A worker started by dcp-otel-run that records its generation, and fails in the first round.

Writes ``$OUT_DIR/gen-<restart count>-<rank>.txt`` with ``$DCP_OTEL_GENERATION``;
rank 1 exits with 1 in round 0, so the agent starts a second round of workers.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    restart, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    with open(os.path.join(os.environ["OUT_DIR"], f"gen-{restart}-{rank}.txt"), "w") as out:
        out.write(os.environ.get("DCP_OTEL_GENERATION", ""))
    sys.exit(1 if restart == "0" and rank == "1" else 0)
