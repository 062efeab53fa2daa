#!/usr/bin/env bash
# Set up everything dcp-otel needs on a fresh machine, idempotently:
#   - .venv with torch==2.13.0 (the CPU build; a bare "torch" could pull a multi-GB
#     CUDA build), numpy (torch's object collectives need it) and dcp-otel itself;
#   - with --prometheus / --browser / --valgrind, Prometheus and promtool / Chromium and its driver /
#     valgrind (benchmarks/instructions.py counts a save's instructions with it) (Debian).
# Re-running is cheap: packages are reinstalled only when pyproject.toml (or the checkout) changes.
# VENV and TORCH_VERSION choose another environment: scripts/test.sh makes a cached one with
# torch 2.15.0, the other tested release (a CUDA build, about 5.7 GB, run on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.dcp-otel-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) torch==$TORCH_VERSION $(pwd)"  # editable: this checkout
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing packages into $VENV" >&2
    # The release asked for by name wins over a machine-wide pip constraint (some images cap torch
    # at what they carry on disk, which would refuse or downgrade the other tested release).
    export PIP_CONSTRAINT=/dev/null
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$TORCH_VERSION" numpy 2>&1 \
        | grep -v "^WARNING: Location" >&2 || true
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[test]" 2>&1 \
        | grep -v "^WARNING: Location" >&2 || true
    # dcp-otel does not depend on torch: installing it must leave the torch installed first as it was.
    "$VENV/bin/python" -c "import torch, numpy, dcp_otel; v = torch.__version__; assert v.startswith('$TORCH_VERSION'), f'installing dcp-otel moved torch from $TORCH_VERSION to {v}'"
    echo "$want" > "$stamp"
fi

# System tools the tests use (Debian packages), each installed only when missing:
#   --prometheus  prometheus and promtool
#   --browser     chromium and chromium-driver (the HTML report's browser test)
#   --valgrind    valgrind (benchmarks/instructions.py and its test)
debs=()
for flag in "$@"; do
    case "$flag" in
        --prometheus) command -v promtool >/dev/null 2>&1 || debs+=(prometheus) ;;
        --browser) command -v chromedriver >/dev/null 2>&1 || debs+=(chromium chromium-driver) ;;
        --valgrind) command -v valgrind >/dev/null 2>&1 || debs+=(valgrind) ;;
        *) echo "setup: unknown option $flag" >&2; exit 2 ;;
    esac
done
if [ "${#debs[@]}" -gt 0 ]; then
    echo "setup: installing ${debs[*]} (Debian packages)" >&2
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${debs[@]}" >&2
    else
        echo "setup: not root; install these packages yourself: ${debs[*]}" >&2
        exit 1
    fi
fi
