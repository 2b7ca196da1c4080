"""The hijax doc's other examples: rank-1 matrices and tuples."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import qarray as qa
from tests import reference as ref


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


# --- Rank1


def test_rank1_matmul_jit_and_type(rng):
    col, row, x = normal(rng, 6), normal(rng, 5), normal(rng, (3, 6))
    r1 = qa.outer(jnp.asarray(col), jnp.asarray(row))
    assert str(jax.typeof(r1)) == "r1[6,5]"
    want = x.astype(np.float64) @ np.outer(col, row)
    for matmul in (qa.matmul_r1, jax.jit(qa.matmul_r1)):
        np.testing.assert_allclose(matmul(x, r1), want, rtol=1e-5, atol=1e-5)
    jaxpr = jax.make_jaxpr(qa.matmul_r1)(x, r1)
    assert ref.equations(jaxpr) == [
        ("MatmulR1", ["float32[3,6]", "r1[6,5]"], ["float32[3,5]"])
    ]
    got_col, got_row = jax.jit(qa.factors)(r1)
    np.testing.assert_array_equal(got_col, col)
    np.testing.assert_array_equal(got_row, row)


def test_rank1_grads_dense_and_to_factors(rng):
    col, row, x = normal(rng, 6), normal(rng, 5), normal(rng, (3, 6))
    dense = np.outer(col, row).astype(np.float64)
    g = 2 * (x @ dense)  # d sum(y^2) / dy

    def loss(x, r1):
        return jnp.sum(qa.matmul_r1(x, r1) ** 2)

    g_r1 = jax.grad(loss, argnums=1)(x, qa.outer(jnp.asarray(col), jnp.asarray(row)))
    assert jax.typeof(g_r1).shape == (6, 5)  # dense tangent
    np.testing.assert_allclose(g_r1, x.T @ g, rtol=1e-4, atol=1e-4)

    def factor_loss(col, row):
        return loss(x, qa.outer(col, row))

    g_col, g_row = jax.jit(jax.grad(factor_loss, (0, 1)))(col, row)
    dense_grad = x.T @ g  # d loss / d (col row^T)
    np.testing.assert_allclose(g_col, dense_grad @ row, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g_row, col @ dense_grad, rtol=1e-4, atol=1e-4)


def test_rank1_sharding_in_types():
    mesh = jax.make_mesh((4,), ("i",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        col = jax.device_put(jnp.zeros(8, jnp.float32), jax.P("i"))
        r1 = qa.outer(col, jnp.ones(5, jnp.float32))
        assert str(jax.typeof(r1)) == "r1[8@i,5]"
        y = qa.matmul_r1(
            jnp.ones((2, 8), jnp.float32),
            qa.outer(
                jnp.ones(8, jnp.float32),
                jax.device_put(jnp.ones(4, jnp.float32), jax.P("i")),
            ),
        )
        assert str(jax.typeof(y)) == "float32[2,4@i]"


def test_rank1_errors():
    with pytest.raises(
        TypeError, match=r"matmul_r1 requires .* got f32\[2,3\] @ r1\[4,5\]"
    ):
        qa.matmul_r1(jnp.ones((2, 3)), qa.outer(jnp.ones(4), jnp.ones(5)))
    with pytest.raises(TypeError, match="outer requires col to be a float32 vector"):
        qa.outer(jnp.ones((2, 2)), jnp.ones(5))


# --- tuples


def test_tuples_keep_element_types_under_jit():
    tup = qa.make_tup(jnp.arange(3.0), jnp.float32(5.0))
    assert str(jax.typeof(tup)) == "Tup{float32[3],float32[]}"
    out = jax.jit(
        lambda t: qa.make_tup(qa.get_tuple_element(t, 1), qa.get_tuple_element(t, 0))
    )(tup)
    assert str(jax.typeof(out)) == "Tup{float32[],float32[3]}"
    traced = jax.jit(lambda a, b: qa.make_tup(a, b)).trace(jnp.ones(2), jnp.ones(3))
    assert ref.equations(traced.jaxpr) == [
        ("MakeTup", ["float32[2]", "float32[3]"], ["Tup{float32[2],float32[3]}"])
    ]
    assert float(qa.get_tuple_element(out, 0)) == 5.0


def test_nested_tuples_and_a_tuple_holding_a_qarray(rng):
    nested = qa.make_tup(
        qa.make_tup(jnp.float32(1.0), jnp.float32(2.0)), jnp.arange(2.0)
    )
    assert str(jax.typeof(nested)) == "Tup{Tup{float32[],float32[]},float32[2]}"
    inner = jax.jit(lambda t: qa.get_tuple_element(qa.get_tuple_element(t, 0), 1))(
        nested
    )
    assert float(inner) == 2.0

    x = normal(rng, (2, 3))
    held = qa.make_tup(qa.quantize(jnp.asarray(x)), jnp.float32(3.0))
    assert str(jax.typeof(held)) == "Tup{q8[2,3],float32[]}"
    back = jax.jit(
        lambda t: qa.dequantize(qa.get_tuple_element(t, 0)) * qa.get_tuple_element(t, 1)
    )(held)
    np.testing.assert_allclose(back, 3 * ref.roundtrip(x), rtol=1e-6)


def test_vmap_with_tup_spec():
    tup = qa.make_tup(jnp.arange(3.0, dtype=jnp.float32), jnp.float32(5.0))

    def swap(t):
        return qa.make_tup(qa.get_tuple_element(t, 1), qa.get_tuple_element(t, 0))

    out = jax.vmap(
        swap, in_axes=qa.TupSpec((0, None)), out_axes=qa.TupSpec((None, 0)), axis_size=3
    )(tup)
    assert str(jax.typeof(out)) == "Tup{float32[],float32[3]}"
    np.testing.assert_array_equal(qa.get_tuple_element(out, 1), [0.0, 1.0, 2.0])

    # both elements mapped, one of them a QArray mapped with its own spec
    pair = qa.make_tup(
        jnp.arange(3.0, dtype=jnp.float32),
        qa.quantize(jnp.ones((3, 2, 4), jnp.float32)),
    )
    spec = qa.TupSpec((0, qa.QArraySpec()))

    def scale_rows(t):
        a, q = qa.get_tuple_element(t, 0), qa.get_tuple_element(t, 1)
        return qa.make_tup(a + 1, qa.quantize(qa.dequantize(q) * a))

    out = jax.jit(jax.vmap(scale_rows, in_axes=spec, out_axes=spec, axis_size=3))(pair)
    assert str(jax.typeof(out)) == "Tup{float32[3],q8[3,2,4]}"
    np.testing.assert_array_equal(qa.get_tuple_element(out, 0), [1.0, 2.0, 3.0])
    want = np.broadcast_to(np.arange(3.0, dtype=np.float32)[:, None, None], (3, 2, 4))
    np.testing.assert_allclose(
        qa.dequantize(qa.get_tuple_element(out, 1)), want, rtol=1e-6
    )


def test_get_tuple_element_index_is_checked():
    tup = qa.make_tup(jnp.ones(2))
    with pytest.raises(ValueError, match=r"0 <= idx < 1, got idx=1"):
        qa.get_tuple_element(tup, 1)
