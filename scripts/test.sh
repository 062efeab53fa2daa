#!/usr/bin/env bash
# The test suite, from a fresh clone: sets itself up, then runs pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -k multiprocess).
#
# A full run (no arguments) then runs the core suites (spans, async, failures, the async save
# process, metrics, multi-rank, the state-dict API, safetensors, the _experimental checkpointer, hung
# checkpoints, DCP's collectives) again on torch 2.15.0, the other tested release. Its environment is cached outside the checkout
# (first time: about 3 minutes to download and install, 5.7 GB), in $DCP_OTEL_CACHE (default ~/.cache/dcp-otel).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --prometheus --browser --valgrind
.venv/bin/python -m pytest "$@"
[ "$#" -gt 0 ] && exit 0

COMPAT_TORCH=2.15.0
compat="${DCP_OTEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dcp-otel}/venv-torch-$COMPAT_TORCH"
mkdir -p "$(dirname "$compat")"
echo "test: the core suites on torch $COMPAT_TORCH ($compat)" >&2
VENV="$compat" TORCH_VERSION="$COMPAT_TORCH" bash scripts/setup.sh
exec "$compat/bin/python" -m pytest -p no:cacheprovider tests/test_spans.py tests/test_async_save.py \
    tests/test_failures.py tests/test_process_async.py tests/test_metrics.py tests/test_multiprocess.py \
    tests/test_state_dict_api.py tests/test_hf_storage.py tests/test_checkpointer.py tests/test_instrumentor.py \
    tests/test_otel_metrics.py tests/test_live.py tests/test_hung_checkpoints.py tests/test_dcp_collectives.py
