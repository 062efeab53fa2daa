#!/usr/bin/env bash
# dcp-otel on one NVIDIA GPU: CUDA state dicts through dcp.save, dcp.load, dcp.async_save (pinned staging) and
# the process-based async save, over NCCL (a world of one) and 2 gloo ranks sharing the GPU; span names against
# CPU tensors, the staging's GB/s, device synchronisations plain vs instrumented, and timings plain vs
# instrumented (interleaved medians); then a training loop that async-saves (benchmarks/training_loop.py), its steps
# and time-to-return plain vs instrumented. About 2 minutes on an H100, plus the loop's. Options go to benchmarks/gpu_check.py
# (--gib 2 --reps 3 --dir /dev/shm/dcp-otel-gpu; --cpu runs the GPU-independent parts anywhere).
#
# Needs python3 (3.10+) with a CUDA build of torch (2.11 or newer) already installed; no network. The packages
# dcp-otel needs beyond what such a machine has come as wheels in .whl/, made beforehand where pip reaches PyPI
# with `bash scripts/gpu-check.sh --fetch-wheels` (for Python 3.12; PYTHON_VERSION=3.11 etc. for another).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--fetch-wheels" ]; then
    # Pure-Python, so one set serves any Linux machine of that Python version.
    rm -rf .whl && mkdir -p .whl
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
        --implementation cp --platform manylinux2014_x86_64 -d .whl \
        opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
        opentelemetry-instrumentation==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
        opentelemetry-proto==1.45.2 importlib-metadata==8.7.1
    ls .whl
    exit 0
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    site=${TMPDIR:-/tmp}/dcp-otel-gpu-site
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DCP_OTEL_RUN_ID=${DCP_OTEL_RUN_ID:-gpu-check}
"$PY" benchmarks/gpu_check.py "$@"
# Then what dcp-otel costs a training loop there: steps beside an upload and async_save's time-to-return, plain vs
# instrumented, with the noise row and the rounds it needs to resolve 1% (LOOP_ROUNDS; --cpu: a short one).
if [[ " $* " == *" --cpu "* ]]; then
    "$PY" benchmarks/training_loop.py --device cpu --cases 10:16 --steps 20 --every 5 --rounds "${LOOP_ROUNDS:-1}" --reps 2
else
    "$PY" benchmarks/training_loop.py --device cuda --dim 4096 --reps 20 --cases 10:1024,10000:256 --steps 60 \
        --rounds "${LOOP_ROUNDS:-4}"
fi
