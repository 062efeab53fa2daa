#!/usr/bin/env bash
# The test suite, from a fresh clone: sets itself up, then runs pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -k multiprocess).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --prometheus --browser
exec .venv/bin/python -m pytest "$@"
