#!/usr/bin/env bash
# Redraw the README's dashboard pictures (docs/img/*.png) from a live run of the stack:
# a real Prometheus with our config and rules, scraping a 3-rank dcp-otel-run job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --prometheus
exec .venv/bin/python -m tests.stack docs/img
