"""A process that records its last value just before exiting (run by test_exposition)."""

from __future__ import annotations

import logging
import sys

from prometheus_client import Counter

import dcp_otel

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
endpoint = dcp_otel.start_metrics_server(0, "127.0.0.1", per_rank=False)
assert endpoint is not None
print(endpoint.url, flush=True)
Counter("last_checkpoint", "the value only a final scrape can see").inc()
# Exiting now: the endpoint's exit hook waits for one more scrape.
