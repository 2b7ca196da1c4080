#!/bin/sh
# Install the Tesseract's pinned requirements and this package into the
# environment of PYTHON. One script for both installs, so that `make setup`
# runs the same steps as the Docker image:
#   scripts/install.sh PYTHON runtime   the image: requirements + qarray
#   scripts/install.sh PYTHON dev       local: the same, qarray editable, plus
#                                       the client and test tools
# JAX_EXTRA=cuda13 (or cuda12) adds jax's CUDA plugin at the pinned version.
set -eu
python=$1
mode=${2:-runtime}
cd "$(dirname "$0")/.."

pip() { "$python" -m pip install --disable-pip-version-check --no-input -q "$@"; }

pip -r tesseract_requirements.txt
if [ -n "${JAX_EXTRA:-}" ]; then
    jax_pin=$(grep '^jax==' tesseract_requirements.txt)
    pip "jax[${JAX_EXTRA}]==${jax_pin#jax==}"
fi
case "$mode" in
    runtime) pip --no-deps . ;;
    dev) pip -e ".[tesseract,dev]" ;;
    *) echo "install.sh: unknown mode '$mode' (runtime or dev)" >&2; exit 2 ;;
esac
