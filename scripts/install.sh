#!/bin/sh
# Install the Tesseract's pinned requirements (tesseract_requirements.txt) and
# this package into the environment of PYTHON. One script for every install, so
# that `make setup` runs the same steps as the Docker image:
#
#   scripts/install.sh PYTHON runtime         the image: requirements + qarray
#   scripts/install.sh PYTHON dev --cpu       local: the same pins without jax's
#                                             CUDA extra, qarray editable, plus
#                                             the client and test tools
set -eu
if [ $# -lt 2 ]; then
    echo "usage: scripts/install.sh PYTHON runtime|dev [--cpu]" >&2
    exit 2
fi
python=$1
mode=$2
cpu=${3:-}
cd "$(dirname "$0")/.."

pip() { "$python" -m pip install --disable-pip-version-check --no-input -q "$@"; }

requirements=tesseract_requirements.txt
if [ "$cpu" = "--cpu" ]; then
    # same pins, CPU-only jax: drop the extra from `jax[...]==VERSION`
    requirements=$(mktemp)
    trap 'rm -f "$requirements"' EXIT
    sed 's/^jax\[[a-z0-9,_-]*\]==/jax==/' tesseract_requirements.txt >"$requirements"
elif [ -n "$cpu" ]; then
    echo "install.sh: unknown option '$cpu' (only --cpu)" >&2
    exit 2
fi

pip -r "$requirements"
# the CPU kernels, against the jax just installed (its FFI headers); without a
# compiler this says so and qarray uses its XLA formulations
scripts/build_kernels.sh "$python"
case "$mode" in
    runtime) pip --no-deps . ;;
    dev) pip -e ".[tesseract,dev]" ;;
    *) echo "install.sh: unknown mode '$mode' (runtime or dev)" >&2; exit 2 ;;
esac
