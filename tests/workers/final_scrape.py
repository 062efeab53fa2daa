"""A process that records its last value just before exiting (run by test_exposition).

``python -m tests.workers.final_scrape N``: also N more series, registered after
dcp-otel's scrape watch, so its exposition takes a while after the watch saw it.
"""

from __future__ import annotations

import logging
import sys

from prometheus_client import Counter, Gauge

import dcp_otel

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
endpoint = dcp_otel.start_metrics_server(0, "127.0.0.1", per_rank=False)
assert endpoint is not None
print(endpoint.url, flush=True)
Counter("last_checkpoint", "the value only a final scrape can see").inc()
many = Gauge("many_series", "series that take a while to expose", ["index"])
for index in range(int(sys.argv[1]) if len(sys.argv) > 1 else 0):
    many.labels(str(index)).set(index)
# Exiting now: the endpoint's exit hook waits for one more scrape.
