"""Explicit sharding (shardings in types) and shard_map, on 8 CPU devices.

Covers: qarray/_primitives.py, qarray/_ops.py, qarray/_qarray.py"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray as qa
from qarray import QArrayP
from support import reference as ref

# rerun on XLA's formulations alone where the kernels ran (make test)
pytestmark = pytest.mark.formulations

RTOL = ATOL = 2e-4
P = jax.P


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
        assert jax.typeof(x).shape == (8 // mesh.size, 3)
        return qa.quantize(x)

    @jax.jit
    @jax.shard_map(in_specs=QArrayP(P("i")), out_specs=P("i"))
    def dequantize_shards(q):
        assert jax.typeof(q).shape == (8 // mesh.size, 3)
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


# --- linear_q: weights stored (out, in); rows of qw are the output channels


def test_linear_q_propagates_shardings(mesh, rng):
    x, w = normal(rng, (8, 3)), normal(rng, (4, 3))
    qw = qa.quantize(jnp.asarray(w))
    for activations in ("float32", "int8"):
        y = qa.linear_q(put(x, "i"), qw, activations)
        assert str(jax.typeof(y)) == "float32[8@i,4]"
        want = ref.linear_q(x, *ref.quantize(w), activations=activations)
        np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)

    # output channels sharded: the rows of qw, and the columns of y
    qw_rows = qa.quantize(put(w, "i"))
    assert str(jax.typeof(qw_rows)) == "q8[4@i,3]"
    for activations in ("float32", "int8"):
        y = jax.jit(qa.linear_q, static_argnums=2)(
            jnp.asarray(x[:2]), qw_rows, activations
        )
        assert str(jax.typeof(y)) == "float32[2,4@i]"
        want = ref.linear_q(x[:2], *ref.quantize(w), activations=activations)
        np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)
    jaxpr = jax.make_jaxpr(qa.linear_q)(jnp.asarray(x[:2]), qw_rows)
    assert ref.equations(jaxpr) == [
        ("LinearQ", ["float32[2,3]", "q8[4@i,3]"], ["float32[2,4@i]"])
    ]


def test_linear_q_sharded_contraction_axis_is_a_type_error(mesh):
    xk = put(np.ones((2, 8), np.float32), None, "i")
    qk = qa.quantize(put(np.ones((3, 8), np.float32), None, "i"))
    message = (
        "linear_q requires an unsharded contraction axis (x's last, qw's last), "
        "got f32[2,8@i] @ q8[3,8@i]^T."
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        jax.jit(qa.linear_q).trace(xk, qk)
    # either operand alone is enough
    with pytest.raises(TypeError, match="unsharded contraction axis"):
        qa.linear_q(put(np.ones((2, 8), np.float32)), qk)
    with pytest.raises(TypeError, match="unsharded contraction axis"):
        qa.linear_q(xk, qa.quantize(jnp.ones((3, 8), jnp.float32)))
    message = (
        "linear_q cannot shard x's rows and qw's rows over the same mesh axis, "
        "got f32[8@i,3] @ q8[4@i,3]^T."
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        qa.linear_q(
            put(np.ones((8, 3), np.float32), "i"),
            qa.quantize(put(np.ones((4, 3), np.float32), "i")),
        )


@pytest.mark.parametrize("w_spec", [(None, None), ("i", None)])
def test_linear_q_grad_keeps_primal_shardings(mesh, rng, w_spec):
    x, w = normal(rng, (8, 3)), normal(rng, (4, 3))
    xs, ws = put(x, "i"), put(w, *w_spec)
    if w_spec[0] is not None:  # x's rows and w's rows can't share axis i
        xs = put(x)

    def loss(x, w):
        return jnp.sum(jnp.sin(qa.linear_q(x, qa.quantize(w))))

    gx, gw = jax.jit(jax.grad(loss, (0, 1)))(xs, ws)
    assert spec_of(gx) == spec_of(xs) and spec_of(gw) == spec_of(ws)
    wq = ref.roundtrip(w)
    want_gx, want_gw = ref.dense_vjp(x, wq.T, np.cos(x.astype(np.float64) @ wq.T))
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(gw, want_gw.T, rtol=RTOL, atol=ATOL)

    # with respect to a sharded QArray operand, and forward mode
    def qloss(x, qw):
        return jnp.sum(jnp.sin(qa.linear_q(x, qw)))

    qw = qa.quantize(ws)
    gx, gqw = jax.grad(qloss, (0, 1))(xs, qw)
    assert spec_of(gqw) == spec_of(ws)
    np.testing.assert_allclose(gqw, want_gw.T, rtol=RTOL, atol=ATOL)
    tx, tw = normal(rng, (8, 3)), normal(rng, (4, 3))
    _, tangent = jax.jit(jax.jvp, static_argnums=0)(
        qloss, (xs, qw), (jax.device_put(tx, xs.sharding), put(tw, *w_spec))
    )
    y = x.astype(np.float64) @ wq.T
    want = np.sum(np.cos(y) * ref.dense_jvp(x, wq.T, tx, tw.T))
    np.testing.assert_allclose(tangent, want, rtol=RTOL, atol=ATOL)


def test_linear_q_inside_shard_map(mesh, rng):
    x, w = normal(rng, (8, 3)), normal(rng, (5, 3))

    @jax.jit
    @jax.shard_map(in_specs=(P("i"), QArrayP(P())), out_specs=P("i"))
    def f(x, qw):
        return qa.linear_q(x, qw)

    y = f(put(x, "i"), qa.quantize(jnp.asarray(w)))
    np.testing.assert_allclose(
        y, ref.linear_q(x, *ref.quantize(w)), rtol=RTOL, atol=ATOL
    )

    # output channels split across devices: each computes its columns of y
    @jax.jit
    @jax.shard_map(in_specs=(P(), QArrayP(P("i"))), out_specs=P(None, "i"))
    def by_channel(x, qw):
        assert str(jax.typeof(qw)).startswith(f"q8[{8 // mesh.size},3]")
        return qa.linear_q(x, qw, "int8")

    w8 = normal(rng, (8, 3))
    y = by_channel(put(x), qa.quantize(put(w8, "i")))
    want = ref.linear_q(x, *ref.quantize(w8), activations="int8")
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)


def test_linear_q_grad_through_shard_map(mesh, rng):
    x, w = normal(rng, (8, 3)), normal(rng, (5, 3))

    def loss(x, w):
        @jax.shard_map(in_specs=(P("i"), P()), out_specs=P())  # check_vma=True
        def per_device(x, w):
            y = qa.linear_q(qa.dequantize(qa.quantize(x)), qa.quantize(w))
            return jax.lax.psum(jnp.sum(jnp.sin(y)), "i")

        return per_device(x, w)

    gx, gw = jax.jit(jax.grad(loss, (0, 1)))(put(x, "i"), put(w))
    xq, wq = ref.roundtrip(x), ref.roundtrip(w)
    want_gx, want_gw = ref.dense_vjp(xq, wq.T, np.cos(xq.astype(np.float64) @ wq.T))
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
    # w is replicated while x varies over i: its cotangent is summed over i
    np.testing.assert_allclose(gw, want_gw.T, rtol=RTOL, atol=ATOL)


def test_linear_q_grad_through_shard_map_with_qarray_in_and_out(mesh, rng):
    x, w = normal(rng, (8, 3)), normal(rng, (5, 3))

    def loss(x, qw):
        @jax.shard_map(in_specs=(P("i"), QArrayP(P())), out_specs=QArrayP(P("i")))
        def layer(x, qw):
            return qa.quantize(qa.linear_q(x, qw))

        return jnp.sum(qa.dequantize(layer(x, qw)) ** 2)

    gx, gqw = jax.jit(jax.grad(loss, (0, 1)))(put(x, "i"), qa.quantize(jnp.asarray(w)))
    wq = ref.roundtrip(w)
    yq = ref.roundtrip((x.astype(np.float64) @ wq.T).astype(np.float32))
    want_gx, want_gw = ref.dense_vjp(x, wq.T, 2 * yq)
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(gqw, want_gw.T, rtol=RTOL, atol=ATOL)
