"""Explicit sharding (shardings in types) and shard_map, on 8 CPU devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import qarray as qa
from qarray import QArrayP
from tests import reference as ref

RTOL = ATOL = 2e-4
P = jax.P


@pytest.fixture
def mesh():
    mesh = jax.make_mesh((4,), ("i",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        yield mesh


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def put(x, *spec):
    return jax.device_put(jnp.asarray(x), P(*spec))


def spec_of(x):
    return jax.typeof(x).sharding.spec


def test_quantize_propagates_row_sharding(mesh, rng):
    x = normal(rng, (8, 3))
    for quantize in (qa.quantize, jax.jit(qa.quantize)):
        q = quantize(put(x, "i"))
        assert str(jax.typeof(q)) == "q8[8@i,3]"
        assert q.qvalue.sharding.spec == P("i", None)
        assert q.scale.sharding.spec == P("i")
        back = qa.dequantize(q)
        assert str(jax.typeof(back)) == "float32[8@i,3]"
        np.testing.assert_allclose(back, ref.roundtrip(x), rtol=1e-6)
    jaxpr = jax.make_jaxpr(lambda x: qa.dequantize(qa.quantize(x)))(put(x, "i"))
    assert ref.equations(jaxpr)[0] == ("Quantize", ["float32[8@i,3]"], ["q8[8@i,3]"])


def test_matmul_q_propagates_shardings(mesh, rng):
    x, w = normal(rng, (8, 3)), normal(rng, (3, 4))
    y = qa.matmul_q(put(x, "i"), qa.quantize(jnp.asarray(w)))
    assert str(jax.typeof(y)) == "float32[8@i,4]"
    np.testing.assert_allclose(
        y, ref.matmul_q(x, *ref.quantize(w)), rtol=RTOL, atol=ATOL
    )

    qw_cols = qa.quantize(put(w, None, "i"))
    assert str(jax.typeof(qw_cols)) == "q8[3,4@i]"
    y = jax.jit(qa.matmul_q)(jnp.asarray(x[:2]), qw_cols)
    assert str(jax.typeof(y)) == "float32[2,4@i]"
    np.testing.assert_allclose(
        y, ref.matmul_q(x[:2], *ref.quantize(w)), rtol=RTOL, atol=ATOL
    )


def test_sharded_contraction_axis_is_a_type_error_at_trace_time(mesh):
    xk = put(np.ones((2, 8), np.float32), None, "i")
    qk = qa.quantize(put(np.ones((8, 3), np.float32), "i"))
    message = (
        "matmul_q requires an unsharded contraction axis (x's last, qw's first), "
        "got f32[2,8@i] @ q8[8@i,3]."
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        jax.jit(qa.matmul_q).trace(xk, qk)
    with pytest.raises(TypeError, match="same mesh axis"):
        qa.matmul_q(
            put(np.ones((8, 3), np.float32), "i"),
            qa.quantize(put(np.ones((3, 4), np.float32), None, "i")),
        )


@pytest.mark.parametrize("w_spec", [(None, None), (None, "i")])
def test_grad_keeps_primal_shardings(mesh, rng, w_spec):
    x, w = normal(rng, (8, 3)), normal(rng, (3, 4))
    xs, ws = put(x, "i"), put(w, *w_spec)

    def loss(x, w):
        return jnp.sum(jnp.sin(qa.matmul_q(x, qa.quantize(w))))

    if w_spec[1] is not None:  # x's rows and w's columns can't share axis i
        xs = put(x)
    gx, gw = jax.jit(jax.grad(loss, (0, 1)))(xs, ws)
    assert spec_of(gx) == spec_of(xs) and spec_of(gw) == spec_of(ws)
    wq = ref.roundtrip(w)
    want_gx, want_gw = ref.dense_vjp(x, wq, np.cos(x.astype(np.float64) @ wq))
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(gw, want_gw, rtol=RTOL, atol=ATOL)

    # with respect to a sharded QArray operand too
    def qloss(x, qw):
        return jnp.sum(jnp.sin(qa.matmul_q(x, qw)))

    qw = qa.quantize(ws)
    gx, gqw = jax.grad(qloss, (0, 1))(xs, qw)
    assert spec_of(gqw) == spec_of(ws)
    np.testing.assert_allclose(gqw, want_gw, rtol=RTOL, atol=ATOL)


def test_shard_map_out_and_in_with_qarray_p(mesh, rng):
    x = normal(rng, (8, 3))
    rows = put(x, "i")

    @jax.jit
    @jax.shard_map(in_specs=P("i"), out_specs=QArrayP(P("i")))
    def quantize_shards(x):
        assert jax.typeof(x).shape == (2, 3)
        return qa.quantize(x)

    @jax.jit
    @jax.shard_map(in_specs=QArrayP(P("i")), out_specs=P("i"))
    def dequantize_shards(q):
        assert jax.typeof(q).shape == (2, 3)
        return qa.dequantize(q)

    q = quantize_shards(rows)
    assert str(jax.typeof(q)) == "q8[8@i,3]"
    assert q.qvalue.sharding.spec == P("i", None) and q.scale.sharding.spec == P("i")
    # per-row scales: quantizing shard by shard equals quantizing globally
    q_global = qa.quantize(rows)
    np.testing.assert_array_equal(q.qvalue, q_global.qvalue)
    np.testing.assert_array_equal(q.scale, q_global.scale)
    np.testing.assert_allclose(dequantize_shards(q), ref.roundtrip(x), rtol=1e-6)


def test_matmul_q_inside_shard_map(mesh, rng):
    x, w = normal(rng, (8, 3)), normal(rng, (3, 5))

    @jax.jit
    @jax.shard_map(in_specs=(P("i"), QArrayP(P())), out_specs=P("i"))
    def f(x, qw):
        return qa.matmul_q(x, qw)

    y = f(put(x, "i"), qa.quantize(jnp.asarray(w)))
    np.testing.assert_allclose(
        y, ref.matmul_q(x, *ref.quantize(w)), rtol=RTOL, atol=ATOL
    )


def test_grad_through_shard_map_that_quantizes_inside(mesh, rng):
    x, w = normal(rng, (8, 3)), normal(rng, (3, 5))

    def loss(x, w):
        @jax.shard_map(in_specs=(P("i"), P()), out_specs=P())  # check_vma=True
        def per_device(x, w):
            y = qa.matmul_q(qa.dequantize(qa.quantize(x)), qa.quantize(w))
            return jax.lax.psum(jnp.sum(jnp.sin(y)), "i")

        return per_device(x, w)

    gx, gw = jax.jit(jax.grad(loss, (0, 1)))(put(x, "i"), put(w))
    xq, wq = ref.roundtrip(x), ref.roundtrip(w)
    want_gx, want_gw = ref.dense_vjp(xq, wq, np.cos(xq.astype(np.float64) @ wq))
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
    # w is replicated while x varies over i: its cotangent is summed over i
    np.testing.assert_allclose(gw, want_gw, rtol=RTOL, atol=ATOL)


def test_grad_through_shard_map_with_qarray_in_and_out(mesh, rng):
    x, w = normal(rng, (8, 3)), normal(rng, (3, 5))

    def loss(x, qw):
        @jax.shard_map(in_specs=(P("i"), QArrayP(P())), out_specs=QArrayP(P("i")))
        def layer(x, qw):
            return qa.quantize(qa.matmul_q(x, qw))

        return jnp.sum(qa.dequantize(layer(x, qw)) ** 2)

    gx, gqw = jax.jit(jax.grad(loss, (0, 1)))(put(x, "i"), qa.quantize(jnp.asarray(w)))
    wq = ref.roundtrip(w)
    yq = ref.roundtrip((x.astype(np.float64) @ wq).astype(np.float32))
    want_gx, want_gw = ref.dense_vjp(x, wq, 2 * yq)
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(gqw, want_gw, rtol=RTOL, atol=ATOL)
