#!/bin/sh
# Build qarray's CPU kernels (qarray/_cpu/: the four handlers against XLA's FFI
# headers from jax.ffi.include_dir(), the dispatch point and every instruction
# set's tiles this architecture has) into qarray/_cpu/libqarray_cpu.so, which
# qarray/_ffi.py registers with jax.ffi. Run by `make setup` and by the
# image's build stage.
#
#   scripts/build_kernels.sh PYTHON
#
# x86-64: tiles_amx.cc, tiles_avx512.cc and tiles_avx2.cc; aarch64: tiles_neon.cc (dotprod
# and i8mm). Each tile file sets its own instruction set with a target pragma
# placed after the shared headers, rather than -m flags on the command line:
# -mavx512f on a whole file would also compile the inline functions and
# templates it shares with the others (std::vector's, common.h's) for AVX-512,
# and the linker keeps one copy of each, possibly that one, so the library
# would not load-and-run on a CPU without it. Built this way it runs on any
# CPU of the architecture; dispatch.cc picks the tiles at load time.
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
case $("$cxx" -dumpmachine) in
x86_64*) tiles="tiles_amx.cc tiles_avx512.cc tiles_avx2.cc" ;;
aarch64*) tiles="tiles_neon.cc" ;;
*)
    echo "build_kernels: no tiles for $("$cxx" -dumpmachine): qarray will use its XLA formulations" >&2
    rm -f "$out" "${out%.so}.jaxlib"
    exit 0
    ;;
esac
include=$("$python" -c 'import jax; print(jax.ffi.include_dir())')
# the FFI API version is jaxlib's: the library records which jaxlib built it,
# and qarray/_ffi.py uses it only under that jaxlib
built_for=$("$python" -c 'import jaxlib; print(jaxlib.__version__)')
tmp="$out.tmp.$$"
objects=$(mktemp -d)
trap 'rm -rf "$objects" "$tmp"' EXIT
# one compiler per source file, side by side (the tile files take longest),
# then one link
pids=""
for f in product.cc product_int4.cc conv.cc quantize.cc dispatch.cc $tiles; do
    "$cxx" -O3 -std=c++17 -fPIC -isystem "$include" -Iqarray/_cpu \
        -c "qarray/_cpu/$f" -o "$objects/${f%.cc}.o" &
    pids="$pids $!"
done
compiled=1
for pid in $pids; do
    wait "$pid" || compiled=0
done
if [ "$compiled" = 1 ] && "$cxx" -shared -pthread "$objects"/*.o -o "$tmp"; then
    mv "$tmp" "$out"
    echo "$built_for" >"${out%.so}.jaxlib"
    echo "build_kernels: built $out (jaxlib $built_for; tiles: $tiles)"
else
    rm -f "$out" "${out%.so}.jaxlib"
    echo "build_kernels: the kernels did not compile (above): qarray will use its XLA formulations" >&2
fi
