#!/usr/bin/env bash
# Redraw the documentation's pictures (docs/img):
#   - docs/img/dcp-otel-*.png: the dashboards' main panels, from a live run of the stack
#     (a real Prometheus with our config and rules, scraping a 3-rank dcp-otel-run job);
#   - docs/img/report.png: the HTML report of the recorded demo run, in headless Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --prometheus --browser
.venv/bin/python -m tests.stack docs/img
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
.venv/bin/dcp-otel report tests/data/demo-3-ranks --html "$scratch/report.html" > /dev/null
chromium --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
    --no-first-run --hide-scrollbars --user-data-dir="$scratch/profile" --window-size=1180,1250 \
    --screenshot=docs/img/report.png "file://$scratch/report.html" 2> /dev/null
echo "pictures in docs/img"
