"""The hijax doc's other examples (qarray.doc_types): rank-1 matrices and tuples,
and the top-level namespace that leaves them out.

Covers: qarray/__init__.py, qarray/doc_types.py, qarray/_rank1.py, qarray/_tuple.py"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray as qa
from qarray import doc_types as dt
from support import reference as ref


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


# --- Rank1


def test_rank1_matmul_jit_and_type(rng):
    col, row, x = normal(rng, 6), normal(rng, 5), normal(rng, (3, 6))
    r1 = dt.outer(jnp.asarray(col), jnp.asarray(row))
    assert str(jax.typeof(r1)) == "r1[6,5]"
    want = x.astype(np.float64) @ np.outer(col, row)
    for matmul in (dt.matmul_r1, jax.jit(dt.matmul_r1)):
        np.testing.assert_allclose(matmul(x, r1), want, rtol=1e-5, atol=1e-5)
    jaxpr = jax.make_jaxpr(dt.matmul_r1)(x, r1)
    assert ref.equations(jaxpr) == [
        ("MatmulR1", ["float32[3,6]", "r1[6,5]"], ["float32[3,5]"])
    ]
    got_col, got_row = jax.jit(dt.factors)(r1)
    np.testing.assert_array_equal(got_col, col)
    np.testing.assert_array_equal(got_row, row)


def test_rank1_grads_dense_and_to_factors(rng):
    col, row, x = normal(rng, 6), normal(rng, 5), normal(rng, (3, 6))
    dense = np.outer(col, row).astype(np.float64)
    g = 2 * (x @ dense)  # d sum(y^2) / dy

    def loss(x, r1):
        return jnp.sum(dt.matmul_r1(x, r1) ** 2)

    g_r1 = jax.grad(loss, argnums=1)(x, dt.outer(jnp.asarray(col), jnp.asarray(row)))
    assert jax.typeof(g_r1).shape == (6, 5)  # dense tangent
    np.testing.assert_allclose(g_r1, x.T @ g, rtol=1e-4, atol=1e-4)

    def factor_loss(col, row):
        return loss(x, dt.outer(col, row))

    g_col, g_row = jax.jit(jax.grad(factor_loss, (0, 1)))(col, row)
    dense_grad = x.T @ g  # d loss / d (col row^T)
    np.testing.assert_allclose(g_col, dense_grad @ row, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g_row, col @ dense_grad, rtol=1e-4, atol=1e-4)


def test_rank1_sharding_in_types(mesh):
    col = jax.device_put(jnp.zeros(8, jnp.float32), jax.P("i"))
    r1 = dt.outer(col, jnp.ones(5, jnp.float32))
    assert str(jax.typeof(r1)) == "r1[8@i,5]"
    y = dt.matmul_r1(
        jnp.ones((2, 8), jnp.float32),
        dt.outer(
            jnp.ones(8, jnp.float32),
            jax.device_put(jnp.ones(4, jnp.float32), jax.P("i")),
        ),
    )
    assert str(jax.typeof(y)) == "float32[2,4@i]"


def test_rank1_errors():
    with pytest.raises(
        TypeError, match=r"matmul_r1 requires .* got f32\[2,3\] @ r1\[4,5\]"
    ):
        dt.matmul_r1(jnp.ones((2, 3)), dt.outer(jnp.ones(4), jnp.ones(5)))
    with pytest.raises(TypeError, match="outer requires col to be a float32 vector"):
        dt.outer(jnp.ones((2, 2)), jnp.ones(5))


# --- tuples


def test_tuples_keep_element_types_under_jit():
    tup = dt.make_tup(jnp.arange(3.0), jnp.float32(5.0))
    assert str(jax.typeof(tup)) == "Tup{float32[3],float32[]}"
    out = jax.jit(
        lambda t: dt.make_tup(dt.get_tuple_element(t, 1), dt.get_tuple_element(t, 0))
    )(tup)
    assert str(jax.typeof(out)) == "Tup{float32[],float32[3]}"
    traced = jax.jit(lambda a, b: dt.make_tup(a, b)).trace(jnp.ones(2), jnp.ones(3))
    assert ref.equations(traced.jaxpr) == [
        ("MakeTup", ["float32[2]", "float32[3]"], ["Tup{float32[2],float32[3]}"])
    ]
    assert float(dt.get_tuple_element(out, 0)) == 5.0


def test_nested_tuples_and_a_tuple_holding_a_qarray(rng):
    nested = dt.make_tup(
        dt.make_tup(jnp.float32(1.0), jnp.float32(2.0)), jnp.arange(2.0)
    )
    assert str(jax.typeof(nested)) == "Tup{Tup{float32[],float32[]},float32[2]}"
    inner = jax.jit(lambda t: dt.get_tuple_element(dt.get_tuple_element(t, 0), 1))(
        nested
    )
    assert float(inner) == 2.0

    x = normal(rng, (2, 3))
    held = dt.make_tup(qa.quantize(jnp.asarray(x)), jnp.float32(3.0))
    assert str(jax.typeof(held)) == "Tup{q8[2,3],float32[]}"
    back = jax.jit(
        lambda t: qa.dequantize(dt.get_tuple_element(t, 0)) * dt.get_tuple_element(t, 1)
    )(held)
    np.testing.assert_allclose(back, 3 * ref.roundtrip(x), rtol=1e-6)


def test_vmap_with_tup_spec():
    tup = dt.make_tup(jnp.arange(3.0, dtype=jnp.float32), jnp.float32(5.0))

    def swap(t):
        return dt.make_tup(dt.get_tuple_element(t, 1), dt.get_tuple_element(t, 0))

    out = jax.vmap(
        swap, in_axes=dt.TupSpec((0, None)), out_axes=dt.TupSpec((None, 0)), axis_size=3
    )(tup)
    assert str(jax.typeof(out)) == "Tup{float32[],float32[3]}"
    np.testing.assert_array_equal(dt.get_tuple_element(out, 1), [0.0, 1.0, 2.0])

    # both elements mapped, one of them a QArray mapped with its own spec
    pair = dt.make_tup(
        jnp.arange(3.0, dtype=jnp.float32),
        qa.quantize(jnp.ones((3, 2, 4), jnp.float32)),
    )
    spec = dt.TupSpec((0, qa.QArraySpec()))

    def scale_rows(t):
        a, q = dt.get_tuple_element(t, 0), dt.get_tuple_element(t, 1)
        return dt.make_tup(a + 1, qa.quantize(qa.dequantize(q) * a))

    out = jax.jit(jax.vmap(scale_rows, in_axes=spec, out_axes=spec, axis_size=3))(pair)
    assert str(jax.typeof(out)) == "Tup{float32[3],q8[3,2,4]}"
    np.testing.assert_array_equal(dt.get_tuple_element(out, 0), [1.0, 2.0, 3.0])
    want = np.broadcast_to(np.arange(3.0, dtype=np.float32)[:, None, None], (3, 2, 4))
    np.testing.assert_allclose(
        qa.dequantize(dt.get_tuple_element(out, 1)), want, rtol=1e-6
    )


def test_get_tuple_element_index_is_checked():
    tup = dt.make_tup(jnp.ones(2))
    with pytest.raises(ValueError, match=r"0 <= idx < 1, got idx=1"):
        dt.get_tuple_element(tup, 1)


# --- namespace: the doc's teaching types are not the quantization API

QUANTIZATION_API = {
    "QArray",
    "QArrayP",
    "QArraySpec",
    "QArrayTy",
    "conv_q",
    "dequantize",
    "jit",
    "linear_q",
    "matmul_q",
    "pack",
    "quantize",
    "unpack",
}
DOC_TYPES = {
    "Rank1",
    "Rank1Ty",
    "outer",
    "factors",
    "matmul_r1",
    "HiTup",
    "TupSpec",
    "TupTy",
    "make_tup",
    "get_tuple_element",
}


def test_top_level_namespace_is_the_quantization_api():
    # submodules (qarray.nn, qarray.doc_types once imported) are attributes
    # too; everything else public must be the quantization API
    public = {
        name
        for name in dir(qa)
        if not name.startswith("_")
        and not isinstance(getattr(qa, name), types.ModuleType)
    }
    assert public == QUANTIZATION_API
    assert not DOC_TYPES & set(dir(qa))


def test_doc_types_live_in_their_own_submodule():
    assert dt.__name__ == "qarray.doc_types"
    assert {name for name in dir(dt) if not name.startswith("_")} == DOC_TYPES
