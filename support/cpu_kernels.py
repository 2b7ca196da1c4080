"""Which of qarray's CPU kernels should run on this machine, for the tests
that force them (tests/qarray/test_cpu_kernels.py, test_strategies.py)."""

import os
import platform

import pytest

from qarray import _ffi


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return set()
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return flags


def best_isa() -> str | None:
    """The tiles this CPU should get (qarray/_cpu/dispatch.cc's rule), from
    the kernel's own report of the CPU's features."""
    flags = cpu_flags()
    if platform.machine() in ("x86_64", "AMD64"):
        # AMX also needs Linux's permission (5.16 and later give it)
        if {"avx2", "fma", "amx_tile", "amx_int8"} <= flags:
            return "amx"
        if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
            return "avx512"
        if {"avx2", "fma", "avx_vnni"} <= flags:
            return "avxvnni"
        return "avx2" if {"avx2", "fma"} <= flags else None
    if platform.machine() == "aarch64" and "asimddp" in flags:
        return "i8mm" if "i8mm" in flags else "dotprod"
    return None


def needs_kernels():
    """The kernels must run wherever the CPU has tiles (a missing build fails
    here); with QARRAY_KERNELS=xla, a forced instruction set this CPU lacks,
    or under another jaxlib than the one that built them (make test-compat),
    there is nothing to test."""
    if _ffi.available():
        return
    if os.environ.get("QARRAY_TEST_PLATFORM", "cpu") != "cpu":
        pytest.skip("the CPU kernels are make test's: this run is on another device")
    status = _ffi.status()
    other_jaxlib = status.startswith("built for jaxlib")
    forced = bool(os.environ.get(_ffi.ISA_ENV))
    if status == "QARRAY_KERNELS=xla" or best_isa() is None or other_jaxlib or forced:
        pytest.skip(f"qarray's CPU kernels do not run here: {status}")
    pytest.fail(f"the CPU has {best_isa()} but the kernels do not run: {status}")
