#!/bin/sh
# Build qarray's CPU kernels (qarray/_cpu/kernels.cc, against XLA's FFI headers
# from jax.ffi.include_dir()) into qarray/_cpu/libqarray_cpu.so, which
# qarray/_ffi.py registers with jax.ffi. Run by `make setup` and by the
# image's build stage.
#
#   scripts/build_kernels.sh PYTHON
#
# Without a C++17 compiler (CXX, default g++) this says why and exits 0: qarray
# then runs every product through its XLA formulations.
set -eu
python=${1:?usage: scripts/build_kernels.sh PYTHON}
cd "$(dirname "$0")/.."
cxx=${CXX:-g++}
out=qarray/_cpu/libqarray_cpu.so
if ! command -v "$cxx" >/dev/null 2>&1; then
    echo "build_kernels: no C++ compiler ('$cxx'): qarray will use its XLA formulations" >&2
    echo "build_kernels: install g++ (Debian: apt-get install g++) and run make setup again" >&2
    rm -f "$out" "${out%.so}.jaxlib"
    exit 0
fi
include=$("$python" -c 'import jax; print(jax.ffi.include_dir())')
# the FFI API version is jaxlib's: the library records which jaxlib built it,
# and qarray/_ffi.py uses it only under that jaxlib
built_for=$("$python" -c 'import jaxlib; print(jaxlib.__version__)')
tmp="$out.tmp.$$"
if "$cxx" -O3 -std=c++17 -shared -fPIC \
    -I"$include" qarray/_cpu/kernels.cc -o "$tmp"; then
    mv "$tmp" "$out"
    echo "$built_for" >"${out%.so}.jaxlib"
    echo "build_kernels: built $out (jaxlib $built_for)"
else
    rm -f "$tmp" "$out" "${out%.so}.jaxlib"
    echo "build_kernels: the kernels did not compile (above): qarray will use its XLA formulations" >&2
fi
