"""The primitives' numerics: values of quantize / dequantize / matmul_q /
linear_q against the NumPy reference, a QArray as one q8 value in jaxprs and
across jit, each product's backward running as the other product, the
trace-time errors each primitive raises (the checks in qarray/_ops.py), and
qarray/_numerics.py's jnp and NumPy quantizers agreeing with the reference.

Covers: qarray/_primitives.py, qarray/_ops.py, qarray/_numerics.py, qarray/_qarray.py"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray as qa
from qarray import _ffi
from support import reference as ref

# rerun on XLA's formulations alone where the kernels ran (make test)
pytestmark = pytest.mark.formulations


def normal(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("shape", [(7,), (2, 3), (4, 5, 33), (3, 1)])
@pytest.mark.parametrize("jit", [False, True])
def test_quantize_matches_reference(rng, shape, jit):
    x = normal(rng, shape, scale=3.0)
    quantize = jax.jit(qa.quantize) if jit else qa.quantize
    q = quantize(jnp.asarray(x))
    assert q.qvalue.dtype == np.int8 and q.scale.dtype == np.float32
    assert q.scale.shape == shape[:-1]
    assert_quantized_like_reference(x, q)


def assert_quantized_like_reference(x, q):
    """qvalue and scale as the reference gives them, up to XLA:CPU's division.

    XLA:CPU divides float32 to within 1 ulp (not always correctly rounded), so
    the scale may be 1 ulp off and a qvalue may differ by 1 where x / scale is
    within a few ulp of a rounding tie; everywhere else they are equal.
    """
    want_q, want_s = ref.quantize(x)
    np.testing.assert_allclose(np.asarray(q.scale), want_s, rtol=1.2e-7, atol=0)
    ratio = x / np.where(want_s > 0, want_s, 1)[..., None]
    near_tie = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) < 1e-5 * np.abs(ratio)
    diff = np.asarray(q.qvalue).astype(np.int32) - want_q
    assert np.all(np.abs(diff) <= 1)
    assert np.all(diff[~near_tie] == 0)


def test_round_half_to_even_and_clip():
    # max |row| = 127 gives scale exactly 1, so x / scale is exact
    row = np.array([[0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -127.0, 127.0]], np.float32)
    q = qa.quantize(jnp.asarray(row))
    np.testing.assert_array_equal(np.asarray(q.scale), [1.0])
    np.testing.assert_array_equal(
        np.asarray(q.qvalue), [[0, 2, 2, 0, -2, 126, -127, 127]]
    )


def test_all_zero_rows_give_zero_and_no_nan():
    x = np.zeros((3, 4), np.float32)
    x[1] = [1.0, -2.5, 0.0, 4.0]
    q = jax.jit(qa.quantize)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(q.qvalue)[[0, 2]], 0)
    np.testing.assert_array_equal(np.asarray(q.scale)[[0, 2]], 0.0)
    back = np.asarray(qa.dequantize(q))
    assert np.isfinite(back).all()
    np.testing.assert_array_equal(back[[0, 2]], 0.0)
    np.testing.assert_allclose(back[1], ref.roundtrip(x)[1])


def test_ties_round_half_to_even():
    """x / scale landing on a half level rounds to the even level: -2 /
    (4 / 127) is -63.5 in float32, so -64, as qarray's CPU kernel rounds it.
    XLA's division (a TPU's, XLA:CPU's vectorised one) is within an ulp, not
    correctly rounded, so there a tie may take its other neighbour (one
    level, and only at a tie); every other entry is exact everywhere."""
    x = np.array([[1.0, -2.0, 0.0, 4.0], [0.5, 1.5, -2.5, 127.0]], np.float32)
    want, want_scale = ref.quantize(x)
    q = jax.jit(qa.quantize)(jnp.asarray(x))
    got = np.asarray(q.qvalue).astype(int)
    np.testing.assert_array_equal(np.asarray(q.scale), want_scale)
    quotient = x / want_scale[:, None]
    ties = np.abs(quotient - np.trunc(quotient)) == 0.5
    assert ties.any() and want[0, 1] == -64
    if jax.default_backend() == "cpu" and _ffi.available():
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_array_equal(got[~ties], want[~ties])
        assert (np.abs(got - want)[ties] <= 1).all()


def test_qvalues_stay_in_symmetric_range(rng):
    x = normal(rng, (64, 128), scale=1e3)
    q = np.asarray(qa.quantize(jnp.asarray(x)).qvalue)
    assert q.min() >= -127 and q.max() <= 127
    # the absmax of every row maps to +-127 exactly
    np.testing.assert_array_equal(np.abs(q).max(axis=-1), 127)


@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 3, 4)])
def test_dequantize_matches_reference(rng, shape):
    x = normal(rng, shape)
    q = qa.quantize(jnp.asarray(x))
    got = jax.jit(qa.dequantize)(q)
    np.testing.assert_array_equal(
        np.asarray(got), ref.dequantize(np.asarray(q.qvalue), np.asarray(q.scale))
    )
    np.testing.assert_allclose(np.asarray(got), ref.roundtrip(x), rtol=1e-6)


def test_roundtrip_error_is_half_a_step(rng):
    x = normal(rng, (16, 256))
    back = np.asarray(qa.dequantize(qa.quantize(jnp.asarray(x))))
    step = np.abs(x).max(axis=-1, keepdims=True) / 127
    assert np.all(np.abs(back - x) <= 0.5 * step * (1 + 1e-5))


@pytest.mark.parametrize("x_shape", [(6,), (3, 6), (2, 3, 6)])
@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("jit", [False, True])
def test_matmul_q_matches_reference(rng, x_shape, activations, jit):
    x, w = normal(rng, x_shape), normal(rng, (6, 5))
    qw = qa.quantize(jnp.asarray(w))
    matmul = jax.jit(qa.matmul_q, static_argnums=2) if jit else qa.matmul_q
    y = matmul(jnp.asarray(x), qw, activations)
    assert y.shape == (*x_shape[:-1], 5) and y.dtype == np.float32
    want = ref.matmul_q(x, *ref.quantize(w), activations=activations)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-5)


def test_int8_activations_are_close_to_dense(rng):
    x, w = normal(rng, (32, 256)), normal(rng, (256, 64))
    qw = qa.quantize(jnp.asarray(w))
    y8 = np.asarray(qa.matmul_q(jnp.asarray(x), qw, "int8"))
    dense = x.astype(np.float64) @ w
    rel = np.linalg.norm(y8 - dense) / np.linalg.norm(dense)
    assert rel < 1.25e-2


@pytest.mark.parametrize("x_shape", [(6,), (3, 6), (2, 3, 6), (9, 6)])
@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("jit", [False, True])
def test_linear_q_matches_reference(rng, x_shape, activations, jit):
    x, w = normal(rng, x_shape), normal(rng, (5, 6))  # w stored (out, in)
    qw = qa.quantize(jnp.asarray(w))
    linear = jax.jit(qa.linear_q, static_argnums=2) if jit else qa.linear_q
    y = linear(jnp.asarray(x), qw, activations)
    assert y.shape == (*x_shape[:-1], 5) and y.dtype == np.float32
    want = ref.linear_q(x, *ref.quantize(w), activations=activations)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    ("activations", "bound"), [("float32", 9.0e-3), ("int8", 1.25e-2)]
)
def test_linear_q_error_on_gaussian_data_at_k_4096(activations, bound):
    """Relative error against the dense float64 product: the weights' own
    quantization error weight-only; int8 activations add x's (same size)."""
    rng = np.random.default_rng(3)
    x, w = normal(rng, (64, 4096)), normal(rng, (256, 4096))
    qw = qa.quantize(jnp.asarray(w))
    y = np.asarray(jax.jit(qa.linear_q, static_argnums=2)(x, qw, activations))
    dense = x.astype(np.float64) @ w.T.astype(np.float64)
    rel = np.linalg.norm(y - dense) / np.linalg.norm(dense)
    assert bound / 2 < rel <= bound


def test_quantized_array_is_one_value_in_jaxprs():
    x = jnp.ones((2, 3), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x: qa.dequantize(qa.quantize(x)))(x)
    assert ref.equations(jaxpr) == [
        ("Quantize", ["float32[2,3]"], ["q8[2,3]"]),
        ("Dequantize", ["q8[2,3]"], ["float32[2,3]"]),
    ]
    jaxpr = jax.make_jaxpr(qa.matmul_q)(x, qa.quantize(jnp.ones((3, 4))))
    assert ref.equations(jaxpr) == [
        ("MatmulQ", ["float32[2,3]", "q8[3,4]"], ["float32[2,4]"])
    ]
    jaxpr = jax.make_jaxpr(qa.linear_q)(x, qa.quantize(jnp.ones((4, 3))))
    assert ref.equations(jaxpr) == [
        ("LinearQ", ["float32[2,3]", "q8[4,3]"], ["float32[2,4]"])
    ]


def test_each_product_backward_is_the_other_product():
    """g @ W^T for matmul_q's qw is linear_q's product and vice versa: the
    backward passes run as the other primitive (on the int8 payload)."""
    x = jnp.ones((2, 3), jnp.float32)

    def grad_eqns(product, w):
        loss = lambda x, w: jnp.sum(product(x, qa.quantize(w), "int8"))  # noqa: E731
        return [e[0] for e in ref.equations(jax.make_jaxpr(jax.grad(loss))(x, w))]

    # the backward for x is the weight-only product whatever the activations
    assert "LinearQ" in grad_eqns(qa.matmul_q, jnp.ones((3, 4)))
    assert "MatmulQ" in grad_eqns(qa.linear_q, jnp.ones((4, 3)))


def test_typeof_prints_q8():
    assert str(jax.typeof(qa.quantize(jnp.ones((2, 3), "float32")))) == "q8[2,3]"


def test_qarray_in_and_out_of_jit(rng):
    x = normal(rng, (2, 3))
    q = jax.jit(qa.quantize)(jnp.asarray(x))
    assert isinstance(q, qa.QArray) and str(jax.typeof(q)) == "q8[2,3]"
    assert_quantized_like_reference(x, q)
    np.testing.assert_allclose(
        np.asarray(jax.jit(qa.dequantize)(q)), ref.roundtrip(x), rtol=1e-6
    )


# --- errors, raised while tracing by the primitives' typing rules

ERRORS = [
    (
        lambda: qa.quantize(jnp.ones((2, 3), jnp.int32)),
        TypeError,
        "quantize requires x to be a float32, bfloat16 or float16 array, got i32[2,3].",
    ),
    (
        lambda: qa.quantize(jnp.float32(1.0)),
        TypeError,
        "quantize requires x of rank >= 1, got f32[].",
    ),
    (
        lambda: qa.dequantize(jnp.ones((2, 3))),
        TypeError,
        "dequantize requires q to be a QArray (q8 or q4), got f32[2,3].",
    ),
    (
        lambda: qa.matmul_q(jnp.ones((2, 3)), qa.quantize(jnp.ones((4, 5)))),
        TypeError,
        "matmul_q requires x.shape[-1] == qw.shape[0], got f32[2,3] @ q8[4,5].",
    ),
    (
        lambda: qa.matmul_q(jnp.ones((2, 3)), jnp.ones((3, 5))),
        TypeError,
        "matmul_q requires qw to be a QArray (q8 or q4), got f32[3,5].",
    ),
    (
        lambda: qa.matmul_q(jnp.ones((2, 3), jnp.int8), qa.quantize(jnp.ones((3, 5)))),
        TypeError,
        "matmul_q requires x to be a float32, bfloat16 or float16 array, got i8[2,3].",
    ),
    (
        lambda: qa.matmul_q(jnp.ones((2, 3)), qa.quantize(jnp.ones((2, 3, 5)))),
        TypeError,
        "matmul_q requires qw of rank 2, got f32[2,3] @ q8[2,3,5].",
    ),
    (
        lambda: qa.matmul_q(jnp.ones((2, 3)), qa.quantize(jnp.ones((3, 5))), "int4"),
        ValueError,
        "matmul_q requires activations in ('float32', 'int8'), got 'int4'.",
    ),
    (
        lambda: qa.linear_q(jnp.ones((2, 3)), qa.quantize(jnp.ones((5, 4)))),
        TypeError,
        "linear_q requires x.shape[-1] == qw.shape[1], got f32[2,3] @ q8[5,4]^T.",
    ),
    (
        # matmul_q's layout handed to linear_q: (k, n) where (n, k) is wanted
        lambda: qa.linear_q(jnp.ones((2, 3)), qa.quantize(jnp.ones((3, 5)))),
        TypeError,
        "linear_q requires x.shape[-1] == qw.shape[1], got f32[2,3] @ q8[3,5]^T.",
    ),
    (
        lambda: qa.linear_q(jnp.ones((2, 3)), jnp.ones((5, 3))),
        TypeError,
        "linear_q requires qw to be a QArray (q8 or q4), got f32[5,3].",
    ),
    (
        lambda: qa.linear_q(jnp.ones((2, 3), jnp.int32), qa.quantize(jnp.ones((5, 3)))),
        TypeError,
        "linear_q requires x to be a float32, bfloat16 or float16 array, got i32[2,3].",
    ),
    (
        lambda: qa.linear_q(
            jnp.ones((2, 3)), qa.quantize(jnp.ones((5, 3))), "int8", precision="fast"
        ),
        ValueError,
        "linear_q requires precision None, 'default', 'high', 'highest', a "
        "jax.lax.Precision or a pair of them, got 'fast'.",
    ),
    (
        lambda: qa.linear_q(jnp.float32(1.0), qa.quantize(jnp.ones((5, 3)))),
        TypeError,
        "linear_q requires x of rank >= 1, got f32[].",
    ),
    (
        lambda: qa.linear_q(jnp.ones((2, 3)), qa.quantize(jnp.ones((3,)))),
        TypeError,
        "linear_q requires qw of rank 2, got f32[2,3] @ q8[3]^T.",
    ),
    (
        lambda: qa.linear_q(jnp.ones((2, 3)), qa.quantize(jnp.ones((2, 5, 3)))),
        TypeError,
        "linear_q requires qw of rank 2, got f32[2,3] @ q8[2,5,3]^T.",
    ),
    (
        lambda: qa.linear_q(jnp.ones((2, 3)), qa.quantize(jnp.ones((5, 3))), "bf16"),
        ValueError,
        "linear_q requires activations in ('float32', 'int8'), got 'bf16'.",
    ),
]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(("call", "error", "message"), ERRORS)
def test_errors_at_trace_time(call, error, message, jit):
    run = (lambda: jax.jit(call).trace()) if jit else call
    with pytest.raises(error, match=re.escape(message)):
        run()


# --- qarray._numerics: the jnp and NumPy forms of each rule agree, and with
# the independent reference


def _awkward_rows(rng):
    """Gaussian rows, a zero row, a row with NaN, exact ties at +-k.5 steps."""
    x = rng.standard_normal((6, 32)).astype(np.float32)
    x[1] = 0.0
    x[2, 3] = np.nan
    x[3] = np.arange(32, dtype=np.float32) - 15.5  # max 16.5: ties after scaling
    x[4, :2] = (127.0, -0.5)
    return x


def test_xla_casts_nan_levels_to_zero():
    """What the traced quantizers rely on instead of a select (qarray/
    _numerics.py's doc): XLA casts a NaN level to int8 0, and the clip keeps
    infinities in range; a NaN entry's int4 nibble is 0 too."""
    from qarray import _numerics as nm

    levels = jnp.array([np.nan, -np.nan, np.inf, -np.inf, 2.5, -300.0], jnp.float32)
    cast = jax.jit(lambda v: nm.on_grid(v, 1.0, nm.QMAX).astype(jnp.int8))(levels)
    np.testing.assert_array_equal(cast, [0, 0, 127, -127, 2, -127])
    x = np.ones((1, 4), np.float32)
    x[0, 1] = np.nan
    packed, scale = jax.jit(nm.quantize_groups, static_argnums=1)(x, 4)
    assert np.isnan(np.asarray(scale)).all()  # the group's scale carries the NaN
    np.testing.assert_array_equal(nm.unpack_nibbles(packed)[0, 1], 0)


def test_numerics_row_quantizers_agree(rng):
    from qarray import _numerics as nm

    x = _awkward_rows(rng)
    q_np, s_np = nm.quantize_rows_np(x)
    q_jnp, s_jnp = jax.jit(nm.quantize_rows)(x)
    finite = np.isfinite(x).all(axis=1)
    want_q, want_s = ref.quantize(x[finite])
    np.testing.assert_array_equal(q_np[finite], want_q)
    np.testing.assert_allclose(s_np[finite], want_s, rtol=1e-7)
    # XLA's division is within 1 ulp: a tie may round one step apart
    assert np.abs(q_np.astype(int) - np.asarray(q_jnp, int)).max() <= 1
    assert (q_np[1] == 0).all() and s_np[1] == 0  # all-zero row, no NaN
    assert q_np[2, 3] == 0 and np.asarray(q_jnp)[2, 3] == 0  # NaN -> 0
    # within 1 ulp (XLA's division)
    np.testing.assert_allclose(s_np[finite], np.asarray(s_jnp)[finite], rtol=2.5e-7)


def test_numerics_group_quantizers_and_nibbles_agree(rng):
    from qarray import _numerics as nm

    x = rng.standard_normal((5, 64)).astype(np.float32)
    x[2] = 0.0
    packed_np, scale_np = nm.quantize_groups_np(x, 16)
    packed_jnp, scale_jnp = jax.jit(nm.quantize_groups, static_argnums=1)(x, 16)
    np.testing.assert_array_equal(packed_np, np.asarray(packed_jnp))
    np.testing.assert_allclose(scale_np, np.asarray(scale_jnp), rtol=2.5e-7)
    # values: the independent rule, recovered from the nibbles
    values = np.asarray(nm.unpack_nibbles(packed_np)).reshape(5, 4, 16)
    groups = x.reshape(5, 4, 16)
    scale = np.abs(groups).max(axis=-1) / 7
    want = np.clip(np.round(groups / np.where(scale > 0, scale, 1)[..., None]), -7, 7)
    np.testing.assert_array_equal(values, want)
    all_values = np.arange(-8, 8, dtype=np.int8).reshape(2, 8)
    np.testing.assert_array_equal(
        np.asarray(nm.unpack_nibbles(nm.pack_nibbles(all_values))), all_values
    )


@pytest.mark.parametrize("group_size", [16, 128])
def test_int4_read_as_jnp_int4_is_the_dequantization_rounded_once(rng, group_size):
    """dequantize_groups_bf16 (the bytes bitcast to jnp.int4, as the TPU's
    int4_bf16 product reads them): NumPy's dequantized values (every nibble
    value -8..7 among them) rounded once to bf16 by NumPy's own cast, bit
    for bit, in a leading batch axis too."""
    from qarray import _numerics as nm

    values = rng.integers(-8, 8, (2, 3, 256)).astype(np.int8)
    values[0, 0, :16] = np.arange(-8, 8)
    scale = rng.uniform(0.01, 2.0, (2, 3, 256 // group_size)).astype(np.float32)
    packed = ref.pack4(values)
    want = ref.dequantize4(values, scale).astype(jnp.bfloat16)  # ml_dtypes' cast
    got = jax.jit(nm.dequantize_groups_bf16)(packed, scale)
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 3, 256)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert nm.as_int4(packed).dtype == jnp.int4


def test_numerics_relative_errors_agree(rng):
    from qarray import _numerics as nm

    w = rng.standard_normal((8, 32)).astype(np.float32)
    q, s = nm.quantize_rows_np(w)
    deq = q.astype(np.float64) * s[:, None]
    want = np.linalg.norm(w - deq) / np.linalg.norm(w)
    assert nm.relative_error_np(w, q, s) == pytest.approx(want, rel=1e-6)
    assert float(nm.relative_error(w, deq.astype(np.float32))) == pytest.approx(
        want, rel=1e-5
    )
    packed, scale = nm.quantize_groups_np(w, 8)
    deq4 = np.asarray(nm.dequantize_groups(packed, scale), np.float64)
    want4 = np.linalg.norm(w - deq4) / np.linalg.norm(w)
    assert nm.relative_error4_np(w, packed, scale) == pytest.approx(want4, rel=1e-6)
    zero = np.zeros((2, 8), np.float32)
    assert nm.relative_error_np(zero, *nm.quantize_rows_np(zero)) == 0.0
