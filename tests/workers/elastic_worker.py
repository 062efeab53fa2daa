"""A worker started by dcp-otel-run: rank 0 scrapes its own agent's metrics endpoint.

The agent has finished rendezvous before any worker runs, so its @prof metrics
for it must already be served. The scrape is written to ``$SCRAPE_OUT``.
"""

from __future__ import annotations

import os
import urllib.request

if __name__ == "__main__":
    if os.environ["RANK"] == "0":
        with urllib.request.urlopen(os.environ["AGENT_METRICS_URL"], timeout=30) as response:  # noqa: S310
            text = response.read().decode()
        with open(os.environ["SCRAPE_OUT"], "w") as out:
            out.write(text)
