#!/usr/bin/env bash
# The demo, from a fresh clone: a 2-rank torchrun job that checkpoints with
# save, async_save and load; its spans go to out/quickstart/ (or to
# $OTEL_EXPORTER_OTLP_ENDPOINT if set), then one summary per checkpoint trace.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=out/quickstart
rm -rf "$out" && mkdir -p "$out"
OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 examples/quickstart.py --out "$out"
.venv/bin/python examples/show_traces.py "$out"
