"""Each matmul_q and linear_q formulation against the NumPy reference, and the
choice rules.

Covers: qarray/_formulations.py"""

from functools import partial

import jax
import numpy as np
import pytest

import qarray as qa
from qarray import _ffi, _formulations
from support import reference as ref
from support.cpu_kernels import needs_kernels

# rerun on XLA's formulations alone where the kernels ran (make test)
pytestmark = pytest.mark.formulations


# the formulations only the CPU picks (choose_strategy): elsewhere each
# product runs "dequantize" or "int8_dot"
CPU_STRATEGIES = ("kernel", "chunked", "split_int8")


def strategies(names):
    """``names`` as parameters, the CPU's own marked cpu_only."""
    cpu_only = pytest.mark.cpu_only("a formulation only the CPU picks")
    return [
        pytest.param(s, marks=cpu_only) if s in CPU_STRATEGIES else s for s in names
    ]


def needs(strategy):
    """The kernel strategy must run wherever the CPU has tiles for it
    (test_cpu_kernels.needs_kernels says when it cannot)."""
    if strategy == "kernel":
        needs_kernels()


# relative error (Frobenius) each formulation may add to the exact product
TOLERANCE = {
    "kernel": 1e-6,  # float32 sums (weight-only); integer sums (int8, nk)
    "chunked": 1e-6,
    "dequantize": 1e-6,
    "split_int8": 1e-6,  # x * scale in three int8 parts: float32 precision
    "int8_dot": 1e-6,  # same quantized rows as the reference: integer sums
    # x in three bf16 parts (float32's precision: the CPU's default, and
    # what the accelerator suite asks for); interpreted off a TPU
    "pallas": 1e-6,
}

# shapes the C++ kernels' blocking needs (their tails and thread splits);
# another shape each for the formulations an accelerator runs (cpu_breadth)
_CPU_KERNEL = pytest.mark.cpu_breadth("the C++ kernels' blocking; the shapes above")
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
    pytest.param((2, 1030, 2050), marks=_CPU_KERNEL),
    pytest.param((7, 1030, 2050), marks=_CPU_KERNEL),  # W8A8: 7 int8 rows padded to 8
    # the kernel's GEMM (32 int8 rows and more; weight-only: three a row):
    # K not a multiple of 4, N not one of 16, rows not one of 8
    pytest.param((11, 5, 17), marks=_CPU_KERNEL),
    pytest.param((37, 70, 33), marks=_CPU_KERNEL),
    pytest.param((64, 96, 130), marks=_CPU_KERNEL),
    # layout kn's GEMM over two blocks of K (the second 4 rows long)
    pytest.param((12, 4100, 70), marks=_CPU_KERNEL),
]


def data(rng, m, k, n):
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    qvalue, scale = (
        ref.quantize(w) if k else (np.zeros((0, n), np.int8), np.zeros(0, np.float32))
    )
    return x, qvalue, scale


# a (2, 3, k) batch and a k-vector through one strategy under one jit: one
# XLA compile for both, not one per op and shape as run eagerly (the
# formulations' values are what these tests check)
@partial(jax.jit, static_argnums=(0, 5))
def leading_axes_and_vector(product, x, v, qvalue, scale, strategy):
    return (
        product(x, qvalue, scale, "float32", strategy),
        product(v, qvalue, scale, "float32", strategy),
    )


def rel_err(got, want):
    scale = max(np.linalg.norm(want), 1e-30)
    return np.linalg.norm(np.asarray(got, np.float64) - want) / scale


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("strategy", strategies(_formulations.WEIGHT_ONLY_STRATEGIES))
def test_weight_only_strategies(rng, shape, strategy):
    needs(strategy)
    x, qvalue, scale = data(rng, *shape)
    f = jax.jit(lambda x, q, s: _formulations.matmul(x, q, s, "float32", strategy))
    got = f(x, qvalue, scale)
    want = ref.matmul_q(x, qvalue, scale)
    assert got.shape == want.shape and got.dtype == np.float32
    assert rel_err(got, want) <= TOLERANCE[strategy]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("strategy", strategies(_formulations.INT8_STRATEGIES))
def test_int8_activation_strategies(rng, shape, strategy):
    needs(strategy)
    x, qvalue, scale = data(rng, *shape)
    f = jax.jit(lambda x, q, s: _formulations.matmul(x, q, s, "int8", strategy))
    got = f(x, qvalue, scale)
    want = ref.matmul_q(x, qvalue, scale, activations="int8")
    assert rel_err(got, want) <= TOLERANCE[strategy]


def test_leading_axes_and_vectors(rng):
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    _, qvalue, scale = data(rng, 1, 64, 16)
    for strategy in _formulations.WEIGHT_ONLY_STRATEGIES:
        if (strategy == "kernel" and not _ffi.available()) or (
            strategy in CPU_STRATEGIES and jax.default_backend() != "cpu"
        ):
            continue
        got, got_v = leading_axes_and_vector(
            _formulations.matmul, x, x[0, 0], qvalue, scale, strategy
        )
        assert rel_err(got, ref.matmul_q(x, qvalue, scale)) <= TOLERANCE[strategy]
        assert got_v.shape == (16,)


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
    got = _formulations.choose_strategy(m, kn, kn, activations, platform, kernels=False)
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
        (16, "kn", "float32", "cpu", "kernel"),  # AVX-512: ahead, packing and all
        (64, "kn", "float32", "cpu", "kernel"),
        (65, "kn", "float32", "cpu", "split_int8"),
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
    m, layout, activations, platform, expected, monkeypatch
):
    """The vector instruction sets' choices (AMX's: below)."""
    monkeypatch.setattr(_ffi, "isa", lambda: "avx512")
    got = _formulations.choose_strategy(
        m, 4096, 4096, activations, platform, layout, kernels=True
    )
    assert got == expected


@pytest.mark.parametrize("m", [65, 128, 512, 4096])
def test_amx_takes_weight_only_nk_products_at_every_row_count(m, monkeypatch):
    """AMX's nk GEMM: no row cap weight-only; kn and W8A8 keep theirs."""
    monkeypatch.setattr(_ffi, "isa", lambda: "amx")
    for k, n in ((1024, 1024), (4096, 1024), (4096, 4096)):
        assert _formulations.choose_strategy(m, k, n, "float32", "cpu", "nk", True) == (
            "kernel"
        )
    assert _formulations.choose_strategy(
        m, 4096, 4096, "float32", "cpu", "kn", True
    ) == ("split_int8")
    if m > 128:
        assert _formulations.choose_strategy(
            m, 4096, 4096, "int8", "cpu", "nk", True
        ) == ("int8_dot")


@pytest.mark.parametrize("isa", ["amx", "avxvnni", "avx2", "i8mm"])
def test_large_kn_weight_only_keeps_split_int8_past_8_rows_elsewhere(isa, monkeypatch):
    """Where the per-call packing of large kn weights costs the GEMM its
    lead (measured on AVX-512 only as ahead: there it keeps the kernel)."""
    monkeypatch.setattr(_ffi, "isa", lambda: isa)
    choose = _formulations.choose_strategy
    assert choose(8, 4096, 4096, "float32", "cpu", "kn", True) == "kernel"
    assert choose(16, 4096, 4096, "float32", "cpu", "kn", True) == "split_int8"
    assert choose(16, 1024, 1024, "float32", "cpu", "kn", True) == "kernel"


def test_w8a8_with_a_short_k_takes_the_gemm_at_every_row_count():
    for layout in ("nk", "kn"):
        got = _formulations.choose_strategy(
            512, 1024, 1024, "int8", "cpu", layout, True
        )
        assert got == "kernel"
    assert _formulations.choose_strategy(
        512, 4096, 1024, "int8", "cpu", "nk", True
    ) == ("int8_dot")


def test_the_kn_gemm_takes_small_and_large_weights():
    for activations, size in (("float32", 1024), ("int8", 1024), ("int8", 4096)):
        got = _formulations.choose_strategy(
            64, size, size, activations, "cpu", "kn", kernels=True
        )
        assert got == "kernel"


@pytest.mark.cpu_only("the strategy the CPU chooses")
@pytest.mark.parametrize(
    ("m", "activations"),
    [(1, "float32"), (8, "float32"), (256, "float32"), (1, "int8"), (8, "int8")],
)
def test_matmul_q_runs_the_chosen_strategy_on_cpu(rng, m, activations):
    x, qvalue, scale = data(rng, m, 64, 32)
    chosen = _formulations.choose_strategy(m, 64, 32, activations, "cpu", "kn")
    forced = jax.jit(lambda x, q, s: _formulations.matmul(x, q, s, activations, chosen))
    auto = jax.jit(lambda x, q, s: qa.matmul_q(x, qa.pack(q, s), activations))
    np.testing.assert_array_equal(auto(x, qvalue, scale), forced(x, qvalue, scale))


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="unknown weight-only strategy 'fast'"):
        _formulations.matmul(
            np.ones((2, 4), np.float32),
            np.ones((4, 3), np.int8),
            np.ones(4, np.float32),
            "float32",
            "fast",
        )


# --- linear_q: weights stored (n, k), one scale per output channel


def linear_data(rng, m, k, n):
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    return x, *ref.quantize(w)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("strategy", strategies(_formulations.WEIGHT_ONLY_STRATEGIES))
def test_linear_weight_only_strategies(rng, shape, strategy):
    needs(strategy)
    x, qvalue, scale = linear_data(rng, *shape)
    f = jax.jit(lambda x, q, s: _formulations.linear(x, q, s, "float32", strategy))
    got = f(x, qvalue, scale)
    want = ref.linear_q(x, qvalue, scale)
    assert got.shape == want.shape and got.dtype == np.float32
    assert rel_err(got, want) <= TOLERANCE[strategy]


@pytest.mark.parametrize("shape", [(1, 64, 48), (3, 1000, 40), (8, 96, 4096)], ids=str)
def test_linear_vector_strategy(rng, shape):
    """The TPU's vector-unit kernel (interpreted off a TPU), linear's layout
    only, up to its 8 rows: float32's products and sums."""
    x, qvalue, scale = linear_data(rng, *shape)
    f = jax.jit(lambda x, q, s: _formulations.linear(x, q, s, "float32", "vector"))
    got = f(x, qvalue, scale)
    want = ref.linear_q(x, qvalue, scale)
    assert got.shape == want.shape and got.dtype == np.float32
    assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("strategy", strategies(_formulations.INT8_STRATEGIES))
def test_linear_int8_activation_strategies(rng, shape, strategy):
    needs(strategy)
    x, qvalue, scale = linear_data(rng, *shape)
    f = jax.jit(lambda x, q, s: _formulations.linear(x, q, s, "int8", strategy))
    got = f(x, qvalue, scale)
    want = ref.linear_q(x, qvalue, scale, activations="int8")
    assert got.shape == want.shape
    assert rel_err(got, want) <= TOLERANCE[strategy]


def test_linear_leading_axes_and_vectors(rng):
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    _, qvalue, scale = linear_data(rng, 1, 64, 16)
    for strategy in _formulations.WEIGHT_ONLY_STRATEGIES:
        if (strategy == "kernel" and not _ffi.available()) or (
            strategy in CPU_STRATEGIES and jax.default_backend() != "cpu"
        ):
            continue
        got, got_v = leading_axes_and_vector(
            _formulations.linear, x, x[0, 0], qvalue, scale, strategy
        )
        assert rel_err(got, ref.linear_q(x, qvalue, scale)) <= TOLERANCE[strategy]
        assert got_v.shape == (16,)


@pytest.mark.cpu_only("the strategy the CPU chooses")
@pytest.mark.parametrize(
    ("m", "activations"),
    [(1, "float32"), (8, "float32"), (256, "float32"), (1, "int8"), (8, "int8")],
)
def test_linear_q_runs_the_chosen_strategy_on_cpu(rng, m, activations):
    x, qvalue, scale = linear_data(rng, m, 64, 32)
    chosen = _formulations.choose_strategy(m, 64, 32, activations, "cpu", "nk")
    forced = jax.jit(lambda x, q, s: _formulations.linear(x, q, s, activations, chosen))
    auto = jax.jit(lambda x, q, s: qa.linear_q(x, qa.pack(q, s), activations))
    np.testing.assert_array_equal(auto(x, qvalue, scale), forced(x, qvalue, scale))


def test_unknown_linear_strategy_is_refused():
    args = (
        np.ones((2, 4), np.float32),
        np.ones((3, 4), np.int8),
        np.ones(3, np.float32),
    )
    # traced, not run op by op (the refusal comes before any compile)
    linear = jax.jit(_formulations.linear, static_argnums=(3, 4))
    with pytest.raises(ValueError, match="unknown weight-only strategy 'int8_dot'"):
        linear(*args, "float32", "int8_dot")
    with pytest.raises(ValueError, match="unknown int8-activation strategy 'fast'"):
        linear(*args, "int8", "fast")


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


@pytest.mark.parametrize(
    "product,layout", [(_formulations.linear, "nk"), (_formulations.matmul, "kn")]
)
@pytest.mark.parametrize(
    "activations,strategy", [("int8", "int8_dot"), ("float32", "split_int8")]
)
def test_int8_sums_past_int32s_range_stay_exact(product, layout, activations, strategy):
    """int8 x int8 sums of K past 2**31 / 127**2 terms (an LM head's
    vocabulary, contracted in its VJP) of one sign: int32 sums a block of K
    at a time, the blocks added in float32, not one int32 that wraps."""
    k, n = 140_000, 8
    x = np.ones((2, k), np.float32)
    shape = (n, k) if layout == "nk" else (k, n)
    qvalue = np.full(shape, 127, np.int8)
    scale = np.full(n if layout == "nk" else k, 1 / 127, np.float32)
    got = jax.jit(product, static_argnums=(3, 4))(
        x, qvalue, scale, activations, strategy
    )
    np.testing.assert_allclose(np.asarray(got), k, rtol=1e-6)
