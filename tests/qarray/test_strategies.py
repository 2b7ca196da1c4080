"""Each matmul_q and linear_q formulation against the NumPy reference, and the
choice rules."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray as qa
from qarray import _ffi, _kernels, _numerics
from support import reference as ref

# rerun on XLA's formulations alone where the kernels ran (make test)
pytestmark = pytest.mark.formulations


def cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))


def needs(strategy):
    """The kernel strategy must run wherever the CPU has AVX-512 VNNI (a
    missing build fails here); elsewhere, with QARRAY_KERNELS=xla, or under
    another jaxlib than the one that built it (make test-compat), there is
    nothing to test."""
    if strategy != "kernel" or _ffi.available():
        return
    status = _ffi.status()
    other_jaxlib = status.startswith("built for jaxlib")  # make test-compat
    if status == "QARRAY_KERNELS=xla" or not cpu_has_vnni() or other_jaxlib:
        pytest.skip(f"qarray's CPU kernels do not run here: {status}")
    pytest.fail(f"the CPU has AVX-512 VNNI but the kernels do not run: {status}")


# relative error (Frobenius) each formulation may add to the exact product
TOLERANCE = {
    "kernel": 1e-6,  # float32 sums (weight-only); integer sums (int8, nk)
    "chunked": 1e-6,
    "dequantize": 1e-6,
    "split_int8": 1e-6,  # x * scale in three int8 parts: float32 precision
    "int8_dot": 1e-6,  # same quantized rows as the reference: integer sums
}

SHAPES = [
    (1, 64, 48),
    (3, 1000, 40),
    (2, 997, 9),
    (8, 96, 4096),
    (5, 300, 7),
    (0, 16, 8),
    (2, 0, 3),
    # layout kn's few-row kernel on both threads (4M multiply-adds and more),
    # each on a range of K that is not a multiple of 4 at its end
    (2, 1030, 2050),
    (7, 1030, 2050),  # W8A8: 7 int8 rows padded to the kernel's 8
    # the kernel's GEMM (32 int8 rows and more; weight-only: three a row):
    # K not a multiple of 4, N not one of 16, rows not one of 8
    (11, 5, 17),
    (37, 70, 33),
    (64, 96, 130),
    # layout kn's GEMM over two blocks of K (the second 4 rows long)
    (12, 4100, 70),
]


def data(rng, m, k, n):
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    qvalue, scale = (
        ref.quantize(w) if k else (np.zeros((0, n), np.int8), np.zeros(0, np.float32))
    )
    return x, qvalue, scale


def rel_err(got, want):
    scale = max(np.linalg.norm(want), 1e-30)
    return np.linalg.norm(np.asarray(got, np.float64) - want) / scale


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("strategy", _kernels.WEIGHT_ONLY_STRATEGIES)
def test_weight_only_strategies(rng, shape, strategy):
    needs(strategy)
    x, qvalue, scale = data(rng, *shape)
    f = jax.jit(lambda x, q, s: _kernels.matmul(x, q, s, "float32", strategy))
    got = f(x, qvalue, scale)
    want = ref.matmul_q(x, qvalue, scale)
    assert got.shape == want.shape and got.dtype == np.float32
    assert rel_err(got, want) <= TOLERANCE[strategy]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("strategy", _kernels.INT8_STRATEGIES)
def test_int8_activation_strategies(rng, shape, strategy):
    needs(strategy)
    x, qvalue, scale = data(rng, *shape)
    f = jax.jit(lambda x, q, s: _kernels.matmul(x, q, s, "int8", strategy))
    got = f(x, qvalue, scale)
    want = ref.matmul_q(x, qvalue, scale, activations="int8")
    assert rel_err(got, want) <= TOLERANCE[strategy]


def test_leading_axes_and_vectors(rng):
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    _, qvalue, scale = data(rng, 1, 64, 16)
    for strategy in _kernels.WEIGHT_ONLY_STRATEGIES:
        if strategy == "kernel" and not _ffi.available():
            continue
        got = _kernels.matmul(jnp.asarray(x), qvalue, scale, "float32", strategy)
        assert rel_err(got, ref.matmul_q(x, qvalue, scale)) <= TOLERANCE[strategy]
        got = _kernels.matmul(jnp.asarray(x[0, 0]), qvalue, scale, "float32", strategy)
        assert got.shape == (16,)


@pytest.mark.parametrize(
    ("m", "kn", "activations", "platform", "expected"),
    [
        (1, 4096, "float32", "cpu", "chunked"),
        (2, 4096, "float32", "cpu", "split_int8"),
        (512, 1024, "float32", "cpu", "split_int8"),
        (1, 4096, "int8", "cpu", "chunked"),
        (2, 4096, "int8", "cpu", "int8_dot"),
        (1, 4096, "float32", "gpu", "dequantize"),
        (512, 4096, "float32", "tpu", "dequantize"),
        (1, 4096, "int8", "gpu", "int8_dot"),
    ],
)
def test_choose_strategy(m, kn, activations, platform, expected):
    """Without qarray's CPU kernels (the XLA formulations)."""
    got = _kernels.choose_strategy(m, kn, kn, activations, platform, kernels=False)
    assert got == expected


@pytest.mark.parametrize(
    ("m", "layout", "activations", "platform", "expected"),
    [
        (1, "nk", "float32", "cpu", "kernel"),
        (2, "nk", "float32", "cpu", "kernel"),
        (3, "nk", "float32", "cpu", "kernel"),  # 9 int8 rows: the GEMM
        (8, "nk", "int8", "cpu", "kernel"),
        (9, "nk", "int8", "cpu", "kernel"),
        (64, "nk", "float32", "cpu", "kernel"),
        (65, "nk", "float32", "cpu", "split_int8"),
        (32, "nk", "int8", "cpu", "kernel"),
        (128, "nk", "int8", "cpu", "kernel"),
        (129, "nk", "int8", "cpu", "int8_dot"),
        (8, "kn", "float32", "cpu", "kernel"),
        (16, "kn", "float32", "cpu", "split_int8"),  # 4096 x 4096: packing costs
        (1, "kn", "float32", "cpu", "kernel"),
        (1, "kn", "int8", "cpu", "kernel"),
        (3, "kn", "float32", "cpu", "kernel"),  # 9 int8 rows: integer products
        (4, "kn", "float32", "cpu", "kernel"),  # 12 int8 rows: the GEMM
        (9, "kn", "int8", "cpu", "kernel"),
        (10, "kn", "int8", "cpu", "kernel"),  # the GEMM
        (129, "kn", "int8", "cpu", "int8_dot"),
        (1, "nk", "float32", "gpu", "dequantize"),
    ],
)
def test_choose_strategy_with_the_cpu_kernels(
    m, layout, activations, platform, expected
):
    got = _kernels.choose_strategy(
        m, 4096, 4096, activations, platform, layout, kernels=True
    )
    assert got == expected


def test_w8a8_with_a_short_k_takes_the_gemm_at_every_row_count():
    for layout in ("nk", "kn"):
        got = _kernels.choose_strategy(512, 1024, 1024, "int8", "cpu", layout, True)
        assert got == "kernel"
    assert _kernels.choose_strategy(512, 4096, 1024, "int8", "cpu", "nk", True) == (
        "int8_dot"
    )


def test_the_kn_gemm_takes_small_and_large_weights():
    for activations, size in (("float32", 1024), ("int8", 1024), ("int8", 4096)):
        got = _kernels.choose_strategy(
            64, size, size, activations, "cpu", "kn", kernels=True
        )
        assert got == "kernel"


@pytest.mark.parametrize(
    ("m", "activations"),
    [(1, "float32"), (8, "float32"), (256, "float32"), (1, "int8"), (8, "int8")],
)
def test_matmul_q_runs_the_chosen_strategy_on_cpu(rng, m, activations):
    x, qvalue, scale = data(rng, m, 64, 32)
    chosen = _kernels.choose_strategy(m, 64, 32, activations, "cpu", "kn")
    forced = jax.jit(lambda x, q, s: _kernels.matmul(x, q, s, activations, chosen))
    auto = jax.jit(lambda x, q, s: qa.matmul_q(x, qa.pack(q, s), activations))
    np.testing.assert_array_equal(auto(x, qvalue, scale), forced(x, qvalue, scale))


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="unknown weight-only strategy 'fast'"):
        _kernels.matmul(
            jnp.ones((2, 4)), jnp.ones((4, 3), jnp.int8), jnp.ones(4), "float32", "fast"
        )


# --- linear_q: weights stored (n, k), one scale per output channel


def linear_data(rng, m, k, n):
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    return x, *ref.quantize(w)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("strategy", _kernels.WEIGHT_ONLY_STRATEGIES)
def test_linear_weight_only_strategies(rng, shape, strategy):
    needs(strategy)
    x, qvalue, scale = linear_data(rng, *shape)
    f = jax.jit(lambda x, q, s: _kernels.linear(x, q, s, "float32", strategy))
    got = f(x, qvalue, scale)
    want = ref.linear_q(x, qvalue, scale)
    assert got.shape == want.shape and got.dtype == np.float32
    assert rel_err(got, want) <= TOLERANCE[strategy]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("strategy", _kernels.INT8_STRATEGIES)
def test_linear_int8_activation_strategies(rng, shape, strategy):
    needs(strategy)
    x, qvalue, scale = linear_data(rng, *shape)
    f = jax.jit(lambda x, q, s: _kernels.linear(x, q, s, "int8", strategy))
    got = f(x, qvalue, scale)
    want = ref.linear_q(x, qvalue, scale, activations="int8")
    assert got.shape == want.shape
    assert rel_err(got, want) <= TOLERANCE[strategy]


def test_linear_leading_axes_and_vectors(rng):
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    _, qvalue, scale = linear_data(rng, 1, 64, 16)
    for strategy in _kernels.WEIGHT_ONLY_STRATEGIES:
        if strategy == "kernel" and not _ffi.available():
            continue
        got = _kernels.linear(jnp.asarray(x), qvalue, scale, "float32", strategy)
        assert rel_err(got, ref.linear_q(x, qvalue, scale)) <= TOLERANCE[strategy]
        got = _kernels.linear(jnp.asarray(x[0, 0]), qvalue, scale, "float32", strategy)
        assert got.shape == (16,)


@pytest.mark.parametrize(
    ("m", "activations"),
    [(1, "float32"), (8, "float32"), (256, "float32"), (1, "int8"), (8, "int8")],
)
def test_linear_q_runs_the_chosen_strategy_on_cpu(rng, m, activations):
    x, qvalue, scale = linear_data(rng, m, 64, 32)
    chosen = _kernels.choose_strategy(m, 64, 32, activations, "cpu", "nk")
    forced = jax.jit(lambda x, q, s: _kernels.linear(x, q, s, activations, chosen))
    auto = jax.jit(lambda x, q, s: qa.linear_q(x, qa.pack(q, s), activations))
    np.testing.assert_array_equal(auto(x, qvalue, scale), forced(x, qvalue, scale))


def test_unknown_linear_strategy_is_refused():
    args = (jnp.ones((2, 4)), jnp.ones((3, 4), jnp.int8), jnp.ones(3))
    with pytest.raises(ValueError, match="unknown weight-only strategy 'int8_dot'"):
        _kernels.linear(*args, "float32", "int8_dot")
    with pytest.raises(ValueError, match="unknown int8-activation strategy 'fast'"):
        _kernels.linear(*args, "int8", "fast")


@pytest.mark.parametrize("shape", [(1, 64, 48), (5, 300, 7), (64, 96, 130), (0, 8, 4)])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_backward_for_x_is_float32_exact(rng, shape, activations):
    """Each product's backward for x is the other's weight-only product, on the
    int8 payload: g @ W^T (matmul_q, W stored (k, n)) and g @ W (linear_q, W
    stored (n, k)) stay float32-exact for any number of rows, whatever the
    forward's activations."""
    m, k, n = shape
    x = rng.standard_normal((m, k)).astype(np.float32)
    g = rng.standard_normal((m, n)).astype(np.float32)
    for product, w_shape in ((qa.matmul_q, (k, n)), (qa.linear_q, (n, k))):
        qvalue, scale = ref.quantize(rng.standard_normal(w_shape).astype(np.float32))
        w = ref.dequantize(qvalue, scale).astype(np.float64)
        w_kn = w if product is qa.matmul_q else w.T

        @jax.jit
        def ct_x(x, g, qvalue, scale, product=product):
            qw = qa.pack(qvalue, scale)
            return jax.vjp(lambda x: product(x, qw, activations), x)[1](g)[0]

        got = ct_x(x, g, qvalue, scale)
        assert got.shape == (m, k)
        assert rel_err(got, g.astype(np.float64) @ w_kn.T) <= TOLERANCE["split_int8"]


# --- the CPU kernels against the XLA formulations, shape by shape


KERNEL_SHAPES = [(1, 4096, 512), (4, 2048, 33), (7, 17, 1000), (64, 256, 256)]


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=str)
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_kernel_agrees_with_the_xla_formulations(rng, shape, layout, activations):
    needs("kernel")
    m, k, n = shape
    x = rng.standard_normal((m, k)).astype(np.float32)
    stored = (k, n) if layout == "kn" else (n, k)
    qvalue, scale = ref.quantize(rng.standard_normal(stored).astype(np.float32))
    fn = _kernels.matmul if layout == "kn" else _kernels.linear
    xla = "chunked"
    kernel = jax.jit(lambda x, q, s: fn(x, q, s, activations, "kernel"))(
        x, qvalue, scale
    )
    other = jax.jit(lambda x, q, s: fn(x, q, s, activations, xla))(x, qvalue, scale)
    assert rel_err(kernel, np.asarray(other, np.float64)) <= 2e-6
    product = ref.matmul_q if layout == "kn" else ref.linear_q
    assert rel_err(kernel, product(x, qvalue, scale, activations)) <= 1e-6


def test_quantize_kernel_rounds_near_ties_like_division(rng):
    """The kernel multiplies by 1 / scale and divides only near a half-integer:
    rows built of exact half-integer multiples of their scale and their float32
    neighbours (where x * (1 / s) and x / s can round apart), rows whose scale
    would be subnormal (flushed to zero, as XLA's), and one input large enough
    for the streamed stores: scales bit for bit the XLA formulation's, values
    NumPy's correctly rounded division by them."""
    needs("kernel")
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


def test_kernels_switch_off_with_qarray_kernels_xla():
    import subprocess
    import sys

    code = "from qarray import _ffi; print(_ffi.status())"
    env = {**os.environ, "QARRAY_KERNELS": "xla", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.stdout.strip() == "QARRAY_KERNELS=xla", out.stderr


@pytest.mark.parametrize("shape", [(1, 1), (5, 17), (64, 300), (3, 2, 33), (0, 5)])
def test_quantize_kernel_matches_numpy_and_xla(rng, shape):
    """quantize's CPU kernel: the XLA formulation's scales bit for bit (the
    reciprocal of 127), the NumPy reference's values, zero and inf rows; a row
    with a NaN gets a NaN scale (jnp.max's rule, which XLA's vectorised max
    keeps at some widths only) and 0 for the NaN entry."""
    needs("kernel")
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
