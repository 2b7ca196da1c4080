"""bfloat16 and float16 activations, and precision as a choice, against the
NumPy float64 reference.

A product of bf16 (f16) x answers in x's dtype: it computes in float32 from
x's exact values, then rounds once, so each entry is within one rounding of
the float64 answer (2**-8 relative for bf16, 2**-11 for f16) plus float32's
own error. ``precision`` means what it means to ``jnp.dot``: "highest" is
float32 everywhere; the platform's default is float32 on CPU and one bf16
pass over x on a TPU (relative error up to ~2**-8 there).

Covers: qarray/_primitives.py, qarray/_conv.py, qarray/_ops.py"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray as qa
from support import reference as ref

pytestmark = pytest.mark.formulations

# unit roundoff of each dtype: one rounding of the float32 answer
ROUNDING = {jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}
# float32 products, relative to the answer's norm (the suite's tolerance)
FLOAT32_REL = 1e-6
# one bf16 pass over x (a TPU's default precision): x's entries rounded to
# bf16 (2**-9 each), the sums float32; relative to the answer's norm
ONE_BF16_PASS_REL = 2.0**-8
DTYPES = list(ROUNDING)


def within_one_rounding(got, want, dtype):
    """Each entry within one rounding of ``dtype`` of the float64 answer,
    plus float32's error relative to the largest entry."""
    got = np.asarray(got, np.float64)
    slack = ROUNDING[dtype] * np.abs(want) + FLOAT32_REL * np.abs(want).max()
    assert (np.abs(got - want) <= slack).all(), np.abs(got - want).max()


def rel_err(got, want):
    got = np.asarray(got, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def as_dtype(rng, shape, dtype):
    """Normal data in ``dtype`` and its exact values in float64."""
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    return x, np.asarray(x, np.float64)


def tie_slack(x, qvalue, scale):
    """W8A8 ``x (..., k)`` with weights ``qvalue (n, k) * scale``: what the
    entries of x at a tie (x / sx half a level, to within two ulps) may add
    where XLA's division quantizes x (a TPU's, or XLA:CPU's vectorised one
    under QARRAY_KERNELS=xla: within an ulp, not correctly rounded, so such
    an entry may take its other neighbour, as near to x: -63.499996 came out
    -64): one level of x each, ``sx * |w[n, k]|`` summed over them."""
    x = np.asarray(x, np.float32)
    sx = ref.quantize(x)[1][..., None]
    quotient = x / np.where(sx > 0, sx, 1)
    half = np.abs(np.abs(quotient - np.trunc(quotient)) - 0.5)
    ties = half <= 2 * np.spacing(np.abs(quotient))
    w = np.abs(ref.dequantize(qvalue, scale)).astype(np.float64)
    return (ties * sx) @ w.T


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_linear_and_matmul_answer_in_x_dtype(rng, dtype, activations):
    """bf16 rows hold exact ties often (8 bits of mantissa): with int8
    activations each may round to either neighbour off CPU (``tie_slack``)."""
    x, x64 = as_dtype(rng, (5, 3, 96), dtype)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    qvalue, scale = ref.quantize(w)
    f = jax.jit(lambda x: qa.linear_q(x, qa.pack(qvalue, scale), activations))
    y = f(x)
    assert y.dtype == dtype and y.shape == (5, 3, 40)
    want = ref.linear_q(x64, qvalue, scale, activations)
    slack = tie_slack(x64, qvalue, scale) if activations == "int8" else 0.0
    got = np.asarray(y, np.float64)
    bound = ROUNDING[dtype] * np.abs(want) + FLOAT32_REL * np.abs(want).max()
    assert (np.abs(got - want) <= bound + (1 + ROUNDING[dtype]) * slack).all()

    wk = rng.standard_normal((96, 24)).astype(np.float32)
    qk, sk = ref.quantize(wk)
    y = jax.jit(lambda x: qa.matmul_q(x, qa.pack(qk, sk), activations))(x)
    assert y.dtype == dtype
    want = ref.matmul_q(x64, qk, sk, activations)
    if activations == "float32":
        within_one_rounding(y, want, dtype)
    else:  # x * scale rounds in float32 before it is quantized: one step of x
        assert rel_err(y, want) <= 2 * ROUNDING[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_int4_weights_take_low_precision_x(rng, dtype):
    x, x64 = as_dtype(rng, (4, 128), dtype)
    w = rng.standard_normal((16, 128)).astype(np.float32)
    qw = qa.quantize(jnp.asarray(w), bits=4, group_size=32)
    y = jax.jit(qa.linear_q)(x, qw)
    assert y.dtype == dtype
    dense = ref.roundtrip4(w, 32).astype(np.float64)
    within_one_rounding(y, x64 @ dense.T, dtype)


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_conv_answers_in_x_dtype(rng, dtype, activations):
    x, x64 = as_dtype(rng, (2, 3, 9, 9), dtype)
    w = rng.standard_normal((4, 3 * 9)).astype(np.float32)
    qvalue, scale = ref.quantize(w)
    qw = qa.pack(qvalue, scale)
    f = jax.jit(lambda x: qa.conv_q(x, qw, (3, 3), padding=1, activations=activations))
    y = f(x)
    assert y.dtype == dtype and y.shape == (2, 4, 9, 9)
    pads = ((1, 1), (1, 1))
    want = ref.conv_q(x64, qvalue, scale, (3, 3), (1, 1), pads, (1, 1), 1, activations)
    within_one_rounding(y, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_cotangents_in_x_dtype_and_weights_in_float32(rng, dtype):
    """x's cotangent in x's dtype, the dense weights' in theirs (quantize is
    straight-through), a QArray's tangent float32; values as the dense
    product's: the cotangent of y rounds to x's dtype (y's), the sums are
    float32, the result rounds once more: two roundings, relative to the norm
    (entries that cancel have no relative bound)."""
    x, x64 = as_dtype(rng, (6, 32), dtype)
    w, w64 = as_dtype(rng, (8, 32), dtype)
    g = rng.standard_normal((6, 8))

    def loss(x, w):
        y = qa.linear_q(x, qa.quantize(w))
        return jnp.sum(y.astype(jnp.float32) * g.astype(np.float32))

    gx, gw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    assert gx.dtype == dtype and gw.dtype == dtype
    dense = ref.roundtrip(np.asarray(w64, np.float32)).astype(np.float64)
    assert rel_err(gx, g @ dense) <= 2 * ROUNDING[dtype]
    assert rel_err(gw, g.T @ x64) <= 2 * ROUNDING[dtype]

    qw = qa.quantize(w)
    _, t = jax.jvp(lambda q: qa.dequantize(q), (qw,), (jnp.ones((8, 32)),))
    assert t.dtype == jnp.float32
    _, tx = jax.jvp(lambda x: qa.matmul_q(x, qa.quantize(w.T)), (x,), (x,))
    assert tx.dtype == dtype


def products(rng):
    """(name, fn(x, precision), float64 answer fn) for each product on f32 x."""
    w = rng.standard_normal((48, 64)).astype(np.float32)
    qvalue, scale = ref.quantize(w)
    qk, sk = ref.quantize(w.T.copy())
    cw = rng.standard_normal((4, 4)).astype(np.float32)  # (out, C * kernel)
    cq, cs = ref.quantize(cw)
    return [
        (
            "linear_q",
            lambda x, p: qa.linear_q(x, qa.pack(qvalue, scale), precision=p),
            lambda x: ref.linear_q(x, qvalue, scale),
        ),
        (
            "matmul_q",
            lambda x, p: qa.matmul_q(x, qa.pack(qk, sk), precision=p),
            lambda x: ref.matmul_q(x, qk, sk),
        ),
        (
            "conv_q",
            lambda x, p: qa.conv_q(
                x.reshape(8, 4, 16), qa.pack(cq, cs), 1, precision=p
            ),
            lambda x: ref.conv_q(
                x.reshape(8, 4, 16), cq, cs, (1,), (1,), ((0, 0),), (1,)
            ),
        ),
    ]


def test_precision_is_honoured_per_call_and_from_the_context(rng):
    """ "highest" is float32 everywhere; the platform's default (precision
    None under jax.default_matmul_precision("default"), or "default") is
    float32 on CPU and one bf16 pass over x on a TPU."""
    x = rng.standard_normal((8, 64)).astype(np.float32)
    cpu = jax.default_backend() == "cpu"
    for name, product, want in products(rng):
        want = want(x.astype(np.float64))
        highest = jax.jit(lambda x, f=product: f(x, "highest"))(x)
        assert rel_err(highest, want) <= FLOAT32_REL, name
        default = jax.jit(lambda x, f=product: f(x, "default"))(x)
        with jax.default_matmul_precision("default"):
            from_context = jax.jit(lambda x, f=product: f(x, None))(x)
        with jax.default_matmul_precision("highest"):
            highest_context = jax.jit(lambda x, f=product: f(x, None))(x)
        assert rel_err(highest_context, want) <= FLOAT32_REL, name
        for got in (default, from_context):
            assert rel_err(got, want) <= (FLOAT32_REL if cpu else ONE_BF16_PASS_REL)
        if jax.default_backend() == "tpu":  # one bf16 pass: x's rounding shows
            assert rel_err(default, want) > 10 * FLOAT32_REL, name


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_gradients_agree_with_the_dense_product_at_the_precision_asked(rng, precision):
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    g = rng.standard_normal((8, 48))
    dense = ref.roundtrip(w).astype(np.float64)

    def loss(x, w):
        y = qa.linear_q(x, qa.quantize(w), precision=precision)
        return jnp.sum(y * g.astype(np.float32))

    gx, gw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    bound = FLOAT32_REL
    if precision == "default" and jax.default_backend() != "cpu":
        bound = ONE_BF16_PASS_REL
    assert rel_err(gx, g @ dense) <= bound
    assert rel_err(gw, g.T @ x.astype(np.float64)) <= bound


def test_precision_is_a_static_parameter_in_the_jaxpr(rng):
    qw = qa.quantize(jnp.ones((4, 8)))
    jaxpr = jax.make_jaxpr(lambda x: qa.linear_q(x, qw, precision="highest"))(
        jnp.ones((2, 8), jnp.bfloat16)
    )
    assert "precision=HIGHEST" in str(jaxpr)
    assert re.search(r"bf16\[2,4\] = LinearQ", str(jaxpr))
    pair = (jax.lax.Precision.HIGH, "highest")
    jaxpr = jax.make_jaxpr(lambda x: qa.matmul_q(x, qa.quantize(x.T), precision=pair))(
        jnp.ones((8, 8))
    )
    assert "precision=(Precision.HIGH, Precision.HIGHEST)" in str(jaxpr)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: qa.conv_q(
                jnp.ones((3, 8), jnp.int32), qa.quantize(jnp.ones((4, 9))), 3
            ),
            "conv_q requires x to be a float32, bfloat16 or float16 array, "
            "got i32[3,8].",
        ),
        (
            lambda: qa.matmul_q(
                jnp.ones((2, 3)), qa.quantize(jnp.ones((3, 4))), precision="bf16"
            ),
            "matmul_q requires precision None, 'default', 'high', 'highest', a "
            "jax.lax.Precision or a pair of them, got 'bf16'.",
        ),
        (
            lambda: qa.conv_q(
                jnp.ones((3, 8)), qa.quantize(jnp.ones((4, 9))), 3, precision=3
            ),
            "conv_q requires precision None, 'default', 'high', 'highest', a "
            "jax.lax.Precision or a pair of them, got 3.",
        ),
    ],
)
def test_dtype_and_precision_errors_at_trace_time(call, message):
    error = ValueError if "precision" in message else TypeError
    with pytest.raises(error, match=re.escape(message)):
        jax.jit(call).trace()


def test_float64_x_is_refused_under_x64():
    qw = qa.quantize(jnp.ones((4, 3)))
    with jax.enable_x64(True):
        x = jnp.ones((2, 3), jnp.float64)
        with pytest.raises(TypeError, match=re.escape("got f64[2,3]")):
            qa.linear_q(x, qw)
