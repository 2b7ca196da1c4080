#!/usr/bin/env bash
# The accelerator suite: tests/qarray, the JAX recipes and every in-process
# Tesseract test on the machine's accelerator, in ONE process (one program at
# a time holds a TPU: no -n), the tests marked cpu_only skipped with their
# reason (tests/conftest.py). Tests that start a server process are left out:
# that process would need the chip this one holds.
#
#   scripts/test_accelerator.sh PYTHON [PLATFORM] [pytest args...]
#
# PLATFORM: tpu (default) or gpu. On a lent TPU host, with the runtime
# staged (shared/tools/tpu): bash .tpu/run/run.sh bash scripts/test_accelerator.sh python
set -euo pipefail
python=${1:?usage: scripts/test_accelerator.sh PYTHON [tpu|gpu] [pytest args...]}
platform=${2:-tpu}
shift $(( $# >= 2 ? 2 : 1 ))
cd "$(dirname "$0")/.."
files=(
  tests/qarray
  tests/test_recipes.py
  tests/tesseract/test_inprocess.py
  tests/tesseract/test_endpoints.py
  tests/tesseract/test_cache.py
  tests/tesseract/test_precision.py
  tests/tesseract/test_lora_served.py
  tests/tesseract/test_network.py
  tests/tesseract/test_request.py
  tests/tesseract/test_cache_device.py
)
# the host's transparent-hugepages warning at JAX's start is no test failure
exec env QARRAY_TEST_PLATFORM="$platform" "$python" -m pytest -p no:xdist \
  -W "ignore:Transparent hugepages" "${files[@]}" "$@"
