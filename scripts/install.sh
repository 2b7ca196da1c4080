#!/bin/sh
# Install the Tesseract's pinned requirements (tesseract_requirements.txt) and
# this package into the environment of PYTHON. One script for every install, so
# that `make setup` runs the same steps as the Docker image:
#
#   scripts/install.sh PYTHON requirements    the pinned requirements alone (the
#                                             image's first layer: cached until
#                                             they change)
#   scripts/install.sh PYTHON runtime         the image: requirements + qarray
#   scripts/install.sh PYTHON dev --cpu       local: the same pins without jax's
#                                             CUDA extra, qarray editable, plus
#                                             the client and test tools
set -eu
if [ $# -lt 2 ]; then
    echo "usage: scripts/install.sh PYTHON requirements|runtime|dev [--cpu]" >&2
    exit 2
fi
python=$1
mode=$2
case "$mode" in
    requirements | runtime | dev) ;;
    *) echo "install.sh: unknown mode '$mode' (requirements, runtime or dev)" >&2; exit 2 ;;
esac
cpu=${3:-}
cd "$(dirname "$0")/.."

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# uv installs the same pins as pip in a fraction of its time (parallel
# downloads and bytecode compiles; `make setup` measured ~200 s -> ~60 s, half
# of it the kernels' compile): fetched from PyPI into the scratch folder, not
# into PYTHON's environment, and trusting the system's certificates as pip
# does. pip where uv cannot be had or fails. Bytecode compiled at install as
# pip does: where PYTHONDONTWRITEBYTECODE is set (these machines) nothing
# else would, and every server a test starts compiled jax again (2.2x slower
# server tests, measured).
UV_VERSION=0.13.9
uv=
if "$python" -m pip install --disable-pip-version-check --no-input -q \
    --target "$scratch/uv" "uv==$UV_VERSION" >/dev/null 2>&1 && [ -x "$scratch/uv/bin/uv" ]; then
    uv=$scratch/uv/bin/uv
fi
pip() {
    if [ -n "$uv" ]; then
        "$uv" pip install --python "$python" --system-certs --compile-bytecode -q "$@" && return 0
        echo "install.sh: uv failed (above): pip instead" >&2
    fi
    "$python" -m pip install --disable-pip-version-check --no-input -q "$@"
}

requirements=tesseract_requirements.txt
if [ "$cpu" = "--cpu" ]; then
    # same pins, CPU-only jax: drop the extra from `jax[...]==VERSION`
    requirements=$scratch/requirements.txt
    sed 's/^jax\[[a-z0-9,_-]*\]==/jax==/' tesseract_requirements.txt >"$requirements"
elif [ -n "$cpu" ]; then
    echo "install.sh: unknown option '$cpu' (only --cpu)" >&2
    exit 2
fi

pip -r "$requirements"
[ "$mode" = requirements ] && exit 0
# the CPU kernels, against the jax just installed (its FFI headers); without a
# compiler this says so and qarray uses its XLA formulations
scripts/build_kernels.sh "$python"
case "$mode" in
    runtime) pip --no-deps . ;;
    dev) pip -e ".[tesseract,dev]" ;;
esac
