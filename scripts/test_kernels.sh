#!/bin/sh
# The C++ test program of qarray's CPU kernels (qarray/_cpu/tests/kernels_test.cc:
# every handler against a plain C++ reference, odd shapes), built without XLA.
#
#   scripts/test_kernels.sh all      native and arm side by side (their logs
#                                    printed in turn): what `make test` runs
#   scripts/test_kernels.sh native   this machine's tiles, run once for each
#                                    instruction set this CPU has
#                                    (QARRAY_CPU_ISA forces each in turn)
#   scripts/test_kernels.sh arm      the aarch64 tiles, cross-built with
#                                    aarch64-linux-gnu-g++ and run under
#                                    qemu-aarch64 -cpu max (dotprod, then i8mm)
#   scripts/test_kernels.sh amx-emulated
#                                    the AMX tiles over a scalar emulation of
#                                    their intrinsics (tests/amx_emulation.h,
#                                    -DQARRAY_EMULATE_AMX);
#                                    native runs this itself where the CPU has
#                                    no AMX
#   scripts/test_kernels.sh avx512-emulated
#                                    the AVX-512 tiles on an x86-64 CPU without
#                                    AVX-512: their intrinsics from SIMDe over AVX2
#                                    (-DQARRAY_EMULATE_AVX512); native runs this
#                                    itself where the CPU has no AVX-512
#
# arm installs Debian's g++-aarch64-linux-gnu and qemu-user when they are
# missing and this runs as root with apt-get; otherwise it says what to
# install and exits 0 (the x86 run is the one every machine can do).
set -eu
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/test_kernels.sh all|native|arm|avx512-emulated}
src=qarray/_cpu
mkdir -p build
common="-O2 -std=c++17 -pthread -I$src $src/tests/kernels_test.cc $src/dispatch.cc"
armcxx=aarch64-linux-gnu-g++

# apt-get install PACKAGES where this runs as root with apt-get (else nothing)
apt_install() {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test_kernels: installing $* (apt-get)"
        apt-get install -y -q "$@" >/dev/null 2>&1 ||
            { apt-get update -q >/dev/null 2>&1 &&
              apt-get install -y -q "$@" >/dev/null 2>&1; } || true
    fi
}
has_simde() {
    echo '#include <simde/x86/avx512.h>' |
        "${CXX:-g++}" -x c++ -std=c++17 -mavx2 -fsyntax-only - >/dev/null 2>&1
}
has_arm_tools() {
    command -v $armcxx >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1
}
case "$mode" in
all)
    # each part is mostly one compiler or one emulated thread: two cores run
    # both at once, after one apt-get for what either lacks (two would race
    # for dpkg's lock)
    case $("${CXX:-g++}" -dumpmachine) in
    x86_64*) has_simde || apt_install libsimde-dev ;;
    esac
    has_arm_tools || apt_install g++-aarch64-linux-gnu qemu-user
    sh scripts/test_kernels.sh native >build/test_kernels.native.log 2>&1 &
    native=$!
    sh scripts/test_kernels.sh arm >build/test_kernels.arm.log 2>&1 &
    arm=$!
    failed=0
    wait $native || failed=1
    wait $arm || failed=1
    cat build/test_kernels.native.log build/test_kernels.arm.log
    [ "$failed" = 0 ] || { echo "test_kernels: FAILED (above)"; exit 1; }
    ;;
native)
    cxx=${CXX:-g++}
    case $("$cxx" -dumpmachine) in
    x86_64*) tiles="$src/tiles_amx.cc $src/tiles_avx512.cc $src/tiles_avx2.cc" ;;
    aarch64*) tiles="$src/tiles_neon.cc" ;;
    *) echo "test_kernels: no tiles for $("$cxx" -dumpmachine)"; exit 0 ;;
    esac
    # shellcheck disable=SC2086
    "$cxx" $common $tiles -o build/kernels_test
    isas=$(build/kernels_test --list)
    if [ -z "$isas" ]; then
        echo "test_kernels: this CPU runs none of the tiles (x86-64 needs AVX2 and FMA)"
        exit 1
    fi
    for isa in $isas; do
        echo "test_kernels: QARRAY_CPU_ISA=$isa build/kernels_test"
        QARRAY_CPU_ISA=$isa build/kernels_test
    done
    # x86-64 without AVX-512: its tiles through SIMDe instead (with it they ran
    # above); without AMX (most machines): its tiles through the emulation
    case "$tiles $isas" in
    *tiles_avx512.cc*avx512*) ;;
    *tiles_avx512.cc*) sh scripts/test_kernels.sh avx512-emulated ;;
    esac
    case "$tiles $isas" in
    *tiles_amx.cc*amx*) ;;
    *tiles_amx.cc*) sh scripts/test_kernels.sh amx-emulated ;;
    esac
    ;;
amx-emulated)
    cxx=${CXX:-g++}
    case $("$cxx" -dumpmachine) in
    x86_64*) ;;
    *) echo "test_kernels: the AMX tiles are x86-64's, not $("$cxx" -dumpmachine)'s"; exit 0 ;;
    esac
    # shellcheck disable=SC2086
    "$cxx" $common -I. -DQARRAY_EMULATE_AMX $src/tiles_amx.cc $src/tiles_avx512.cc \
        $src/tiles_avx2.cc -o build/kernels_test_amx_emulated
    if ! build/kernels_test_amx_emulated --list | grep -qx amx; then
        echo "test_kernels: SKIPPED the emulated AMX tiles: they take gemm.h's AVX2 paths, and this CPU lacks AVX2"
        exit 0
    fi
    echo "test_kernels: QARRAY_CPU_ISA=amx build/kernels_test_amx_emulated (tests/amx_emulation.h; what the tiles leave: $(build/kernels_test_amx_emulated --list | sed -n 2p))"
    QARRAY_CPU_ISA=amx build/kernels_test_amx_emulated
    ;;
avx512-emulated)
    cxx=${CXX:-g++}
    case $("$cxx" -dumpmachine) in
    x86_64*) ;;
    *) echo "test_kernels: the AVX-512 tiles are x86-64's, not $("$cxx" -dumpmachine)'s"; exit 0 ;;
    esac
    has_simde || apt_install libsimde-dev
    if ! has_simde; then
        echo "test_kernels: SKIPPED the emulated AVX-512 tiles: no SIMDe (Debian: apt-get install libsimde-dev)"
        exit 0
    fi
    # shellcheck disable=SC2086
    "$cxx" $common -mavx2 -mfma -Wno-psabi -DQARRAY_EMULATE_AVX512 \
        $src/tiles_amx.cc $src/tiles_avx512.cc $src/tiles_avx2.cc -o build/kernels_test_avx512_emulated
    if ! build/kernels_test_avx512_emulated --list 2>/dev/null | grep -qx avx512; then
        echo "test_kernels: SKIPPED the emulated AVX-512 tiles: SIMDe's build needs AVX2 and FMA"
        exit 0
    fi
    echo "test_kernels: QARRAY_CPU_ISA=avx512 build/kernels_test_avx512_emulated (SIMDe)"
    QARRAY_CPU_ISA=avx512 build/kernels_test_avx512_emulated
    ;;
arm)
    cxx=$armcxx
    has_arm_tools || apt_install g++-aarch64-linux-gnu qemu-user
    if ! has_arm_tools; then
        echo "test_kernels: SKIPPED the aarch64 tiles: no $cxx or qemu-aarch64"
        echo "test_kernels: (Debian: apt-get install g++-aarch64-linux-gnu qemu-user)"
        exit 0
    fi
    # shellcheck disable=SC2086
    $cxx -march=armv8-a $common $src/tiles_neon.cc -static -o build/kernels_test_arm
    run="qemu-aarch64 -cpu max -L /usr/aarch64-linux-gnu build/kernels_test_arm"
    isas=$($run --list)
    # the instruction sets side by side (each run is one emulated thread of work)
    pids=""
    for isa in $isas; do
        QARRAY_CPU_ISA=$isa $run >"build/kernels_test_arm.$isa.log" 2>&1 &
        pids="$pids $!"
    done
    failed=0
    for pid in $pids; do
        wait "$pid" || failed=1
    done
    for isa in $isas; do
        echo "test_kernels: QARRAY_CPU_ISA=$isa $run"
        cat "build/kernels_test_arm.$isa.log"
    done
    [ "$failed" = 0 ] || exit 1
    # a CPU with dotprod and no i8mm (Neoverse N1: Graviton 2, Ampere Altra)
    # must get the dotprod tiles by itself
    picked=$(qemu-aarch64 -cpu neoverse-n1 build/kernels_test_arm --list | head -n 1)
    if [ "$picked" != dotprod ]; then
        echo "test_kernels: a Neoverse N1 should run dotprod, this build offers '$picked'"
        exit 1
    fi
    echo "test_kernels: a Neoverse N1 (no i8mm) runs dotprod"
    ;;
*)
    echo "usage: scripts/test_kernels.sh all|native|arm|avx512-emulated" >&2
    exit 2
    ;;
esac
