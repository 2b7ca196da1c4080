"""qarray's C++ CPU kernels (qarray/_cpu/, registered by qarray/_ffi.py) from
Python: which instruction set runs, QARRAY_CPU_ISA and QARRAY_KERNELS, and
each handler forced ("kernel") against the NumPy references in
support/reference.py and against the XLA formulations. The handlers' own C++
test program (qarray/_cpu/tests/kernels_test.cc, `make test-kernels`) checks
every instruction set's tiles without XLA; this file checks what users reach.

On a CPU whose best tiles are not AVX2's (AVX-512), the last test runs this
file again with QARRAY_CPU_ISA=avx2.

Covers: qarray/_ffi.py, qarray/_rules.py
"""

import ctypes
import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray as qa
from qarray import _ffi, _formulations, _numerics, _rules
from qarray._conv import ConvQ
from support import reference as ref
from support.cpu_kernels import best_isa, cpu_flags, needs_kernels

pytestmark = pytest.mark.cpu_only("qarray's C++ kernels and QARRAY_CPU_ISA")

RTOL = ATOL = 2e-4


def status_in(env: dict[str, str]) -> str:
    code = "from qarray import _ffi; print(_ffi.status())"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def rel_err(got, want):
    scale = max(np.linalg.norm(want), 1e-30)
    return np.linalg.norm(np.asarray(got, np.float64) - want) / scale


# --- which instruction set runs


def test_status_names_the_instruction_set():
    needs_kernels()
    forced = os.environ.get(_ffi.ISA_ENV) or best_isa()
    assert _ffi.status() == f"available ({forced})"
    assert _ffi.isa() == forced


def test_avx_vnni_is_named_apart_from_avx2():
    """status tells AVX-VNNI's tiles from AVX2's, and each name forces its own
    (AVX2's tiles run, and are tested, on a CPU with AVX-VNNI too)."""
    needs_kernels()
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        pytest.skip("not an x86-64 CPU with AVX2")
    assert status_in({_ffi.ISA_ENV: "avx2"}) == "available (avx2)"
    vnni = status_in({_ffi.ISA_ENV: "avxvnni"})
    if "avx_vnni" in flags:
        assert vnni == "available (avxvnni)"
    else:
        assert vnni.startswith("QARRAY_CPU_ISA=avxvnni is not among"), vnni


def test_qarray_cpu_isa_forces_a_lower_one_and_refuses_a_missing_one():
    needs_kernels()
    x86 = best_isa() in ("amx", "avx512", "avxvnni", "avx2")
    if x86:
        # plain AVX2 even where AVX-VNNI is there: each is forced by its name
        assert status_in({_ffi.ISA_ENV: "avx2"}) == "available (avx2)"
    else:
        assert status_in({_ffi.ISA_ENV: "dotprod"}) == "available (dotprod)"
    other = "i8mm" if x86 else "avx512"
    refused = status_in({_ffi.ISA_ENV: other})
    assert refused.startswith(f"QARRAY_CPU_ISA={other} is not among"), refused
    assert status_in({_ffi.ISA_ENV: "sse2"}).startswith("QARRAY_CPU_ISA=sse2")


def test_kernels_switch_off_with_qarray_kernels_xla():
    assert status_in({"QARRAY_KERNELS": "xla"}) == "QARRAY_KERNELS=xla"


def test_thresholds_come_from_the_rule():
    """One owner (_rules): the kernels are passed every threshold of the rule
    choose_strategy uses, whichever handler runs."""
    rule = _ffi.rule()
    assert rule == _rules.for_isa(_ffi.isa())
    for activations in ("float32", "int8"):
        assert _ffi.thresholds(activations) == {
            "split": rule.split_levels,
            "gemm_rows": rule.gemm_rows,
            "kn_dot_rows": rule.kn_dot_int8_rows,
            "int4_gemm_rows": rule.int4_gemm_rows[activations],
        }


def test_each_instruction_set_has_its_rule(monkeypatch):
    monkeypatch.setattr(_ffi, "isa", lambda: "amx")
    assert _ffi.rule() is _rules.AMX
    assert _ffi.thresholds()["gemm_rows"] == _rules.AMX.gemm_rows
    monkeypatch.setattr(_ffi, "isa", lambda: "avx512")
    assert _ffi.rule() is _rules.AVX512
    want = _rules.AVX512.int4_gemm_rows["int8"]
    assert _ffi.thresholds("int8")["int4_gemm_rows"] == want
    for isa in ("avxvnni", "avx2", "i8mm", "dotprod", None):  # no rule of their own
        monkeypatch.setattr(_ffi, "isa", lambda isa=isa: isa)
        assert _ffi.rule() is _rules.OTHER


def test_rules_are_frozen_and_overridden_inside_a_block_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _rules.OTHER.gemm_rows = 1
    with _rules.overriding(gemm_rows=1):
        assert _rules.for_isa("amx").gemm_rows == 1
        assert _rules.for_isa(None).gemm_rows == 1
        assert _rules.for_isa("amx").split_levels == _rules.AMX.split_levels
    assert _rules.for_isa("amx") is _rules.AMX
    with pytest.raises(TypeError, match="no field"):
        with _rules.overriding(gemm_row=1):
            pass


def common_h_limit(name: str) -> int:
    """A limit as qarray/_cpu/common.h declares it."""
    source = (pathlib.Path(_ffi.LIBRARY).parent / "common.h").read_text()
    return int(re.search(rf"constexpr int\w* {name} = (\d+);", source)[1])


def test_the_library_exports_its_limits_and_every_rule_keeps_to_them():
    needs_kernels()
    limits = _ffi.library_limits(ctypes.CDLL(str(_ffi.LIBRARY)))
    assert limits == {
        "split_levels": common_h_limit("kMaxSplit"),
        "kn_dot_int8_rows": common_h_limit("kMaxKnDotRows"),
    }
    assert _ffi.limits_refusal(limits, _rules.CPU_RULES) is None


def test_the_library_refuses_to_load_beside_a_rule_past_its_limits(monkeypatch):
    """Python's rule and C++'s limits disagreeing: the library is refused
    when it loads (status says why), not loaded to fail every kn call."""
    needs_kernels()
    limits = _ffi.library_limits(ctypes.CDLL(str(_ffi.LIBRARY)))
    rows = limits["kn_dot_int8_rows"] + 1
    wide = dataclasses.replace(_rules.OTHER, name="wide", kn_dot_int8_rows=rows)
    monkeypatch.setattr(_rules, "CPU_RULES", {**_rules.CPU_RULES, "wide": wide})
    refused = _ffi.status.__wrapped__()  # the load again, uncached
    assert refused.startswith("refused: libqarray_cpu.so holds at most"), refused
    assert f"kn_dot_int8_rows={rows - 1}" in refused
    assert f"'wide' rule asks {rows}" in refused
    # a library whose limit is below the rules' (its split_levels)
    fake = {**limits, "split_levels": _rules.OTHER.split_levels - 1}
    refused = _ffi.limits_refusal(fake, _rules.CPU_RULES)
    assert refused is not None and "split_levels=" in refused


def test_a_refused_library_leaves_the_products_to_xla():
    """The whole load, in a fresh process: status says why, the kernels are
    off, and the products run XLA's formulations."""
    needs_kernels()
    code = (
        "import dataclasses, jax.numpy as jnp, qarray as qa\n"
        "from qarray import _ffi, _rules\n"
        "_rules.CPU_RULES['deep'] = dataclasses.replace("
        "_rules.OTHER, name='deep', split_levels=99)\n"
        "y = qa.linear_q(jnp.ones((2, 64)), qa.quantize(jnp.ones((8, 64))))\n"
        "print(_ffi.available(), y.shape)\n"
        "print(_ffi.status())\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    first, status = out.stdout.strip().splitlines()
    assert first == "False (2, 8)"
    assert status.startswith("refused:") and "'deep' rule asks 99" in status


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("gemm_rows", [1, 64])
def test_int4_kernel_paths_both_match_numpy(rng, activations, gemm_rows):
    """The threshold Python passes decides the path (1: the GEMM at every
    row count, 64: the dot tiles), and both paths give the same answer."""
    needs_kernels()
    switch = _rules.ByActivations(float32=gemm_rows, int8=gemm_rows)
    m, k, n, group = 5, 128, 40, 64
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed, scale = qa.unpack(qa.quantize(jnp.asarray(w), bits=4, group_size=group))
    v = ref.roundtrip(x) if activations == "int8" else x
    want = v.astype(np.float64) @ ref.roundtrip4(w, group).astype(np.float64).T
    with _rules.overriding(int4_gemm_rows=switch):
        got = _ffi.product_int4(
            jnp.asarray(x), packed, scale, int8=activations == "int8"
        )
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * np.abs(want).max())


# --- the products


KERNEL_SHAPES = [
    (1, 4096, 512),
    (4, 2048, 33),
    (7, 17, 1000),
    (64, 256, 256),
    # layout kn's few-row path on both threads (4M multiply-adds and more),
    # K not a multiple of 8 at the end of a thread's range
    (2, 1030, 2050),
    # the GEMM (8 int8 rows and more): K not a multiple of 4, N not one of 16
    (11, 5, 17),
    (37, 70, 33),
    # layout kn's GEMM over two blocks of K (the second 4 rows long)
    (12, 4100, 70),
]


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=str)
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_kernel_agrees_with_the_xla_formulations(rng, shape, layout, activations):
    needs_kernels()
    m, k, n = shape
    x = rng.standard_normal((m, k)).astype(np.float32)
    stored = (k, n) if layout == "kn" else (n, k)
    qvalue, scale = ref.quantize(rng.standard_normal(stored).astype(np.float32))
    fn = _formulations.matmul if layout == "kn" else _formulations.linear
    kernel = jax.jit(lambda x, q, s: fn(x, q, s, activations, "kernel"))(
        x, qvalue, scale
    )
    other = jax.jit(lambda x, q, s: fn(x, q, s, activations, "chunked"))(
        x, qvalue, scale
    )
    assert rel_err(kernel, np.asarray(other, np.float64)) <= 2e-6
    product = ref.matmul_q if layout == "kn" else ref.linear_q
    assert rel_err(kernel, product(x, qvalue, scale, activations)) <= 1e-6


def test_kernel_weights_of_minus_128(rng):
    """pack() takes any int8: -128 (which quantize never gives) must multiply
    right through the sign tricks of the AVX2 tiles."""
    needs_kernels()
    m, k, n = 3, 96, 40
    x = rng.standard_normal((m, k)).astype(np.float32)
    qvalue = rng.integers(-128, 128, (n, k)).astype(np.int8)
    qvalue[:, ::7] = -128
    scale = rng.uniform(0.01, 0.02, n).astype(np.float32)
    for activations in ("float32", "int8"):
        got = jax.jit(
            lambda x, q, s, a=activations: _formulations.linear(x, q, s, a, "kernel")
        )(x, qvalue, scale)
        want = ref.linear_q(x, qvalue, scale, activations)
        assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("m", [1, 11, 40])
def test_int4_kernel_matches_numpy(rng, m, activations):
    """int4 through the kernel: K not a multiple of 64, N not one of 16, rows
    not one of 4 (three parts a row weight-only, one for W4A8)."""
    needs_kernels()
    k, n, group = 96, 33, 32
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed, scale = qa.unpack(qa.quantize(jnp.asarray(w), bits=4, group_size=group))
    v = ref.roundtrip(x) if activations == "int8" else x
    want = v.astype(np.float64) @ ref.roundtrip4(w, group).astype(np.float64).T
    product = lambda *a: _formulations.linear_int4(*a, activations, "kernel")  # noqa: E731
    got = jax.jit(product)(x, packed, scale)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * np.abs(want).max())


# (x shape, out channels, kernel, conv_q keywords, low/high paddings)
CONV_GEOMETRIES = [
    ((4, 16, 32, 32), 32, (3, 3), {"padding": "SAME"}, ((1, 1), (1, 1))),
    (
        (2, 8, 33, 31),
        16,
        (5, 3),
        {"padding": ((2, 2), (0, 1)), "window_strides": (2, 3)},
        ((2, 2), (0, 1)),
    ),
    (
        (3, 12, 64),
        12,
        (3,),
        {"padding": "VALID", "rhs_dilation": (2,), "feature_group_count": 3},
        ((0, 0),),
    ),
    ((2, 4, 8, 8, 8), 6, (3, 3, 3), {"padding": 1}, ((1, 1),) * 3),
    # more than 16 channels in and 32 out, neither a multiple of 8 (the tiles'
    # blocks of channels and 8 x 8 output transposes)
    ((2, 20, 11, 21), 44, (3, 3), {"padding": "SAME"}, ((1, 1), (1, 1))),
    # PointNet's pointwise convolutions: a 1-wide kernel over many points
    ((2, 64, 500), 128, (1,), {}, ((0, 0),)),
]
CONV_IDS = ["2d-same", "2d-strided", "1d-grouped-dilated", "3d", "2d-wide", "pointwise"]


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize(
    "x_shape, out, kernel, conv, pads", CONV_GEOMETRIES, ids=CONV_IDS
)
def test_conv_kernel_matches_the_reference(
    rng, x_shape, out, kernel, conv, pads, activations
):
    """The CPU kernel forced, weight-only (parts of each example) as well as
    W8A8, every geometry."""
    needs_kernels()
    groups = conv.get("feature_group_count", 1)
    x = rng.standard_normal(x_shape).astype(np.float32)
    per_out = x_shape[1] // groups * int(np.prod(kernel))
    w = rng.standard_normal((out, per_out)).astype(np.float32) * 0.2
    qw = qa.quantize(jnp.asarray(w))
    strides = conv.get("window_strides", (1,) * len(kernel))
    dilation = conv.get("rhs_dilation", (1,) * len(kernel))
    want = ref.conv_q(
        x, *ref.quantize(w), kernel, strides, pads, dilation, groups, activations
    )
    prim = ConvQ(jax.typeof(x), jax.typeof(qw), kernel, activations=activations, **conv)
    got = jax.jit(lambda x, q, s: prim.forward(x, q, s, "kernel"))(
        x, qw.qvalue, qw.scale
    )
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


# --- quantize


def test_quantize_kernel_rounds_near_ties_like_division(rng):
    """The kernel multiplies by 1 / scale and divides only near a half-integer:
    rows built of exact half-integer multiples of their scale and their float32
    neighbours (where x * (1 / s) and x / s can round apart), rows whose scale
    would be subnormal (flushed to zero, as XLA's), and one input large enough
    for the streamed stores: scales bit for bit the XLA formulation's, values
    NumPy's correctly rounded division by them."""
    needs_kernels()
    k = 4096
    scales = rng.uniform(0.01, 3.0, 48).astype(np.float32)
    half = rng.integers(-127, 127, (48, k)).astype(np.float32) + np.float32(0.5)
    rows = half * scales[:, None]
    step = rng.integers(-2, 3, rows.shape)  # up to two ulps either way
    rows = np.nextafter(rows, np.where(step > 0, np.inf, -np.inf).astype(np.float32))
    rows = np.where(step == 0, half * scales[:, None], rows).astype(np.float32)
    rows[:, 0] = 127 * scales  # each row's absmax sets its scale near `scales`
    rows[-2:] *= np.float32(1e-38)  # absmax normal, absmax / 127 not
    large = (rng.standard_normal((2048, k)) * 3).astype(np.float32)
    for x in (rows, np.concatenate([rows, large])):
        qvalue, scale = jax.jit(_ffi.quantize_rows)(x)
        np.testing.assert_array_equal(scale, jax.jit(_numerics.quantize_rows)(x)[1])
        divisor = np.where(scale > 0, scale, np.float32(1))[:, None]
        # XLA's threads treat subnormal inputs as zero, the XLA formulation too
        normal = np.where(np.abs(x) < np.finfo(np.float32).tiny, 0, x)
        want = np.clip(np.round(normal / divisor), -127, 127)
        np.testing.assert_array_equal(np.asarray(qvalue), want)


@pytest.mark.parametrize("shape", [(1, 1), (5, 17), (64, 300), (3, 2, 33), (0, 5)])
def test_quantize_kernel_matches_numpy_and_xla(rng, shape):
    """quantize's CPU kernel: the XLA formulation's scales bit for bit (the
    reciprocal of 127), the NumPy reference's values, zero and inf rows; a row
    with a NaN gets a NaN scale (jnp.max's rule, which XLA's vectorised max
    keeps at some widths only) and 0 for the NaN entry."""
    needs_kernels()
    x = (rng.standard_normal(shape) * 5).astype(np.float32)
    rows = x.reshape(-1, shape[-1])  # a view: the edits below land in x
    rows[:1] = 0.0  # an all-zero row: scale 0, values 0
    rows[1:2, 0] = np.nan  # NaN scale, the NaN entry 0
    rows[2:3, -1] = np.inf
    qvalue, scale = jax.jit(_ffi.quantize_rows)(rows)
    want_q, want_s = jax.jit(_numerics.quantize_rows)(rows)
    has_nan = np.isnan(rows).any(axis=-1)
    np.testing.assert_array_equal(np.asarray(scale)[~has_nan], want_s[~has_nan])
    np.testing.assert_array_equal(np.asarray(qvalue)[~has_nan], want_q[~has_nan])
    assert np.isnan(np.asarray(scale)[has_nan]).all()
    assert (np.asarray(qvalue)[np.isnan(rows)] == 0).all()
    finite = np.isfinite(rows).all(axis=-1)
    ref_q, _ = ref.quantize(rows[finite])
    np.testing.assert_array_equal(np.asarray(qvalue)[finite], ref_q)
    # and through the primitive, any leading axes
    q = jax.jit(qa.quantize)(x)
    np.testing.assert_array_equal(qa.unpack(q)[0], np.asarray(qvalue).reshape(shape))


def test_nan_rows_in_products_give_nan_rows(rng):
    """W8A8 quantizes x with the same row quantizer: a row holding a NaN gives
    a NaN row of y (its scale is NaN), the other rows stay exact."""
    needs_kernels()
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[1, 5] = np.nan
    qvalue, scale = ref.quantize(rng.standard_normal((64, 40)).astype(np.float32))
    got = np.asarray(
        jax.jit(lambda x, q, s: _formulations.matmul(x, q, s, "int8", "kernel"))(
            x, qvalue, scale
        )
    )
    assert np.isnan(got[1]).all()
    keep = [0, 2]
    assert rel_err(got[keep], ref.matmul_q(x[keep], qvalue, scale, "int8")) <= 1e-6


# --- every check above on the AVX2 tiles too


def test_on_every_isa_avx2_runs_these_checks_too():
    """Where the CPU's best tiles are above AVX2's (AMX, AVX-512, AVX-VNNI),
    this file again with QARRAY_CPU_ISA=avx2 (where they are AVX2's, the run
    above was)."""
    if os.environ.get(_ffi.ISA_ENV) or best_isa() not in ("amx", "avx512", "avxvnni"):
        pytest.skip(f"this run is the AVX2 one or none runs here ({_ffi.status()})")
    env = {**os.environ, _ffi.ISA_ENV: "avx2"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", __file__, "-k", "not on_every_isa"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " skipped" not in out.stdout, out.stdout[-2000:]
