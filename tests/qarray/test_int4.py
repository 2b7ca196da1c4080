"""Packed int4 QArrays (quantize(x, bits=4, group_size=G)) and linear_q on
them, against NumPy; the transform table (tests/qarray/test_transforms.py)
holds their jit/grad/jvp/hessian/checkpoint cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import qarray as qa
from qarray import _ffi, _kernels
from tests import reference as ref

RTOL = ATOL = 2e-4
P = jax.P


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("group_size", [2, 32, 128])
def test_quantize_packs_like_numpy(rng, group_size):
    x = normal(rng, (3, 256))
    x[1, :group_size] = 0  # an all-zero group: scale 0, values 0
    q = jax.jit(lambda x: qa.quantize(x, bits=4, group_size=group_size))(x)
    assert str(jax.typeof(q)) == "q4[3,256]"
    values, scale = ref.quantize4(x, group_size)
    packed, got_scale = qa.unpack(q)
    assert packed.dtype == np.uint8 and packed.shape == (3, 128)
    assert got_scale.shape == (3, 256 // group_size)
    np.testing.assert_array_equal(packed, ref.pack4(values))
    np.testing.assert_allclose(got_scale, scale, rtol=1e-6)
    assert np.all(np.abs(values) <= 7) and scale[1, 0] == 0
    np.testing.assert_allclose(
        qa.dequantize(q), ref.dequantize4(values, scale), rtol=1e-6
    )
    # the bytes: half of int8's payload
    assert packed.nbytes == x.size // 2


def test_nibble_order_and_sign():
    # [-7, 7, 0.7, -0.35] in groups of 2 (scales 1 and 0.1): values -7, 7,
    # 7 and -4 (-0.35 / 0.1 is -3.5 in float32, and rounds half to even)
    x = np.array([[-7.0, 7.0, 0.7, -0.35]], np.float32)
    packed, scale = qa.unpack(qa.quantize(x, bits=4, group_size=2))
    values = ref.quantize4(x, 2)[0]
    assert values.tolist() == [[-7, 7, 7, -4]]
    # low nibble = even index, 4-bit two's complement: 0x79 (7 << 4 | -7 & 0xF)
    # and 0xC7 (-4 & 0xF = 0xC, high)
    assert packed.tolist() == [[0x79, 0xC7]]
    np.testing.assert_allclose(scale, [[1.0, 0.1]], rtol=1e-6)


def test_pack_round_trip_and_scale_gradient(rng):
    x = normal(rng, (4, 64))
    packed, scale = qa.unpack(qa.quantize(x, bits=4, group_size=16))
    q = qa.pack(packed, scale, bits=4, group_size=16)
    assert str(jax.typeof(q)) == "q4[4,64]"
    values = ref.quantize4(x, 16)[0]
    np.testing.assert_allclose(
        qa.dequantize(q), ref.dequantize4(values, scale), rtol=1e-6
    )
    g = normal(rng, (4, 64))
    grad = jax.grad(lambda s: jnp.sum(qa.dequantize(qa.pack(packed, s, 4, 16)) * g))(
        scale
    )
    want = (g * values).reshape(4, 4, 16).sum(-1)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", [None, "dequantize", "kernel"])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_linear_q_int4_matches_numpy(rng, strategy, m):
    if strategy == "kernel" and not _ffi.available():
        pytest.skip(f"CPU kernels: {_ffi.status()}")
    k, n = 256, 48
    x, w = normal(rng, (m, k)), normal(rng, (n, k))
    q = qa.quantize(jnp.asarray(w), bits=4, group_size=64)
    want = x.astype(np.float64) @ ref.roundtrip4(w, 64).astype(np.float64).T
    if strategy is None:
        got = jax.jit(qa.linear_q)(x, q)
    else:
        packed, scale = qa.unpack(q)
        got = jax.jit(lambda *a: _kernels.linear_int4(*a, strategy))(x, packed, scale)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * np.abs(want).max())


@pytest.mark.parametrize("m", [11, 40])
def test_int4_kernel_gemm_matches_numpy(rng, m):
    """The kernel's GEMM (33 int8 parts and more): K not a multiple of 64, N
    not one of 16, rows not one of 4."""
    if not _ffi.available():
        pytest.skip(f"CPU kernels: {_ffi.status()}")
    k, n, group = 96, 33, 32
    x, w = normal(rng, (m, k)), normal(rng, (n, k))
    packed, scale = qa.unpack(qa.quantize(jnp.asarray(w), bits=4, group_size=group))
    want = x.astype(np.float64) @ ref.roundtrip4(w, group).astype(np.float64).T
    got = jax.jit(lambda *a: _kernels.linear_int4(*a, "kernel"))(x, packed, scale)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * np.abs(want).max())


def test_vmap_and_scan_over_stacked_int4_weights(rng):
    ws = normal(rng, (3, 6, 32))
    qws = jax.vmap(
        lambda w: qa.quantize(w, bits=4, group_size=8), out_axes=qa.QArraySpec()
    )(jnp.asarray(ws))
    assert str(jax.typeof(qws)) == "q4[3,6,32]"
    x = normal(rng, (2, 32))
    got = jax.vmap(lambda q: qa.linear_q(x, q), in_axes=qa.QArraySpec(), axis_size=3)(
        qws
    )
    want = np.stack([x @ ref.roundtrip4(w, 8).T for w in ws])
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # scan: three same-shape int4 layers (32 -> 32)
    ws = normal(rng, (3, 32, 32)) * 0.3
    qws = jax.vmap(
        lambda w: qa.quantize(w, bits=4, group_size=8), out_axes=qa.QArraySpec()
    )(jnp.asarray(ws))

    def run(x, qws):
        h, _ = jax.lax.scan(
            lambda h, q: (jnp.tanh(qa.linear_q(h, q)), None), x, qws, length=3
        )
        return h

    h = x.astype(np.float64)
    for w in ws:
        h = np.tanh(h @ ref.roundtrip4(w, 8).T)
    for fn in (run, jax.jit(run)):
        np.testing.assert_allclose(fn(x, qws), h, rtol=RTOL, atol=ATOL)


def test_grad_with_respect_to_stored_int4_scales(rng):
    x, w = normal(rng, (3, 32)), normal(rng, (4, 32))
    packed, scale = qa.unpack(qa.quantize(jnp.asarray(w), bits=4, group_size=8))
    g = normal(rng, (3, 4))

    def loss(scale):
        return jnp.sum(qa.linear_q(x, qa.pack(packed, scale, 4, 8)) * g)

    values = ref.quantize4(w, 8)[0].astype(np.float64)
    # d/ds[n, j] of sum g[m, n] x[m, k] v[n, k] s[n, k // 8]
    want = np.einsum("mn,mk,nk->nk", g, x, values).reshape(4, 4, 8).sum(-1)
    np.testing.assert_allclose(jax.grad(loss)(scale), want, rtol=1e-4, atol=1e-4)


@pytest.fixture
def mesh():
    mesh = jax.make_mesh((4,), ("i",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        yield mesh


def test_output_channels_sharded(mesh, rng):
    x, w = normal(rng, (3, 32)), normal(rng, (8, 32))
    ws = jax.device_put(jnp.asarray(w), P("i"))
    q = qa.quantize(ws, bits=4, group_size=8)
    assert str(jax.typeof(q)) == "q4[8@i,32]"
    y = jax.jit(qa.linear_q)(x, q)
    assert str(jax.typeof(y)) == "float32[3,8@i]"
    want = x.astype(np.float64) @ ref.roundtrip4(w, 8).T
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)
    gw = jax.jit(
        jax.grad(lambda w: jnp.sum(qa.linear_q(x, qa.quantize(w, 4, 8)) ** 2))
    )(ws)
    assert jax.typeof(gw).sharding.spec == P("i", None)
    want_gw = (2 * want).T @ x
    np.testing.assert_allclose(gw, want_gw, rtol=RTOL, atol=ATOL)


def test_shard_map_in_and_out(mesh, rng):
    w = normal(rng, (8, 32))

    @jax.jit
    @jax.shard_map(in_specs=P("i"), out_specs=qa.QArrayP(P("i")))
    def quantize_shards(w):
        return qa.quantize(w, bits=4, group_size=8)

    q = quantize_shards(jax.device_put(w, P("i")))
    assert str(jax.typeof(q)) == "q4[8@i,32]"
    np.testing.assert_allclose(qa.dequantize(q), ref.roundtrip4(w, 8), rtol=1e-6)

    @jax.jit
    @jax.shard_map(in_specs=qa.QArrayP(P("i")), out_specs=P("i"))
    def dequantize_shards(q):
        return qa.dequantize(q)

    np.testing.assert_allclose(dequantize_shards(q), ref.roundtrip4(w, 8), rtol=1e-6)


@pytest.mark.parametrize(
    "fn, error, match",
    [
        (
            lambda: qa.quantize(jnp.ones((2, 12)), bits=4, group_size=8),
            TypeError,
            "multiple of group_size=8",
        ),
        (
            lambda: qa.quantize(jnp.ones((2, 12)), bits=4, group_size=3),
            ValueError,
            "positive even int",
        ),
        (
            lambda: qa.quantize(jnp.ones((2, 12)), bits=2),
            ValueError,
            r"bits in \(8, 4\)",
        ),
        (
            lambda: qa.quantize(jnp.ones((2, 12)), group_size=4),
            ValueError,
            "group_size is for bits=4",
        ),
        (
            lambda: qa.matmul_q(
                jnp.ones((2, 8)), qa.quantize(jnp.ones((8, 8)), bits=4, group_size=4)
            ),
            TypeError,
            'layout "nk"',
        ),
        (
            lambda: qa.linear_q(
                jnp.ones((2, 8)),
                qa.quantize(jnp.ones((3, 8)), bits=4, group_size=4),
                "int8",
            ),
            TypeError,
            "weight-only",
        ),
        (
            lambda: qa.pack(
                jnp.zeros((2, 4), jnp.int8), jnp.ones((2, 1)), bits=4, group_size=8
            ),
            TypeError,
            "uint8",
        ),
        (
            lambda: qa.pack(
                jnp.zeros((2, 4), jnp.uint8), jnp.ones((2, 2)), bits=4, group_size=8
            ),
            TypeError,
            r"scale of shape \(2, 1\)",
        ),
    ],
)
def test_errors_at_trace_time(fn, error, match):
    with pytest.raises(error, match=match):
        fn()
