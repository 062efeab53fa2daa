#!/usr/bin/env bash
# The demo, from a fresh clone: `dcp-otel demo` with 4 ranks (gloo on CPU) of a small
# training job that saves, async-saves and resumes with load; rank 2's storage is slow
# and rank 1's disk fills up once, so the report has something to find. Spans go to
# out/demo/traces (OTLP JSON; also to $OTEL_EXPORTER_OTLP_ENDPOINT if set); the report is
# printed and written to out/demo/report.html and out/demo/trace.perfetto.json.
# Extra arguments go to `dcp-otel demo` (e.g. --ranks 8 --steps 60; the slow and failing
# ranks need at least 3 ranks, or override them: --ranks 2 --slow-rank 1 --fail-rank 0).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dcp-otel demo --slow-rank 2 --fail-rank 1 "$@"
