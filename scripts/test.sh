#!/usr/bin/env bash
# The test suite, from a fresh clone: sets itself up, then runs pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -k multiprocess).
#
# A full run (no arguments) then runs the core suites (spans, async, failures, the async save
# process, metrics, multi-rank, the state-dict API, safetensors, the _experimental checkpointer, hung
# checkpoints, DCP's collectives, how jobs end, a restart, the sequence tables, the named straggler, the
# spool and its survivors, the optimizer hook) again on torch 2.15.0 and 2.11.0, the other tested releases
# (2.11.0: what the GPU machines run). Their environments are cached outside the checkout (first time: about
# 3 and 4 minutes to download and install, 5.7 and 4.7 GB, CUDA builds run on CPU), in $DCP_OTEL_CACHE
# (default ~/.cache/dcp-otel). Each is made by installing that torch first and this package after it:
# setup.sh fails if installing dcp-otel moved torch.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --prometheus --browser --valgrind
.venv/bin/python -m pytest "$@"
[ "$#" -gt 0 ] && exit 0

for COMPAT_TORCH in 2.15.0 2.11.0; do
    compat="${DCP_OTEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dcp-otel}/venv-torch-$COMPAT_TORCH"
    mkdir -p "$(dirname "$compat")"
    echo "test: the core suites on torch $COMPAT_TORCH ($compat)" >&2
    VENV="$compat" TORCH_VERSION="$COMPAT_TORCH" bash scripts/setup.sh
    "$compat/bin/python" -m pytest -p no:cacheprovider tests/test_spans.py tests/test_async_save.py \
        tests/test_failures.py tests/test_process_async.py tests/test_metrics.py tests/test_multiprocess.py \
        tests/test_state_dict_api.py tests/test_hf_storage.py tests/test_checkpointer.py tests/test_instrumentor.py \
        tests/test_otel_metrics.py tests/test_live.py tests/test_hung_checkpoints.py tests/test_dcp_collectives.py \
        tests/test_releases.py tests/test_endings.py tests/test_checkpoint_life.py tests/test_sequence_tables.py \
        tests/test_straggler_named.py tests/test_spool.py tests/test_survivors.py tests/test_interference.py
done
