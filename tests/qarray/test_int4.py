"""Packed int4 QArrays (quantize(x, bits=4, group_size=G)) and linear_q on
them, against NumPy; the transform table (tests/qarray/test_transforms.py)
holds their jit/grad/jvp/hessian/checkpoint cases.

Covers: qarray/_primitives.py, qarray/_numerics.py, qarray/_qarray.py"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray as qa
from qarray import _ffi, _formulations
from support import reference as ref

# rerun on XLA's formulations alone where the kernels ran (make test)
pytestmark = pytest.mark.formulations

RTOL = ATOL = 2e-4
P = jax.P

# Compiled once per shape and shared by the tests (each eager op is an XLA
# program of its own, ~0.1-0.2 s on a TPU). The eager paths stay covered:
# int4 quantize in test_nibble_order_and_sign, pack and dequantize in
# test_pack_round_trip_and_scale_gradient, a scan of linear_q in
# test_vmap_and_scan_over_stacked_int4_weights (and the transform table).
quantize = jax.jit(qa.quantize, static_argnames=("bits", "group_size"))
dequantize = jax.jit(qa.dequantize)
linear_q = jax.jit(qa.linear_q, static_argnums=2)


@jax.jit
def unpacked(q):
    """The packed nibbles and scales of q, as arrays."""
    return qa.unpack(q)


@jax.jit
def _quantize_stack(ws):
    return jax.vmap(
        lambda w: qa.quantize(w, bits=4, group_size=8), out_axes=qa.QArraySpec()
    )(ws)


@jax.jit
def _linear_stack(x, qws):
    return jax.vmap(lambda q: qa.linear_q(x, q), in_axes=qa.QArraySpec(), axis_size=3)(
        qws
    )


@jax.jit
def _scale_grad(packed, scale, x, g):
    """d/dscale of sum(g * linear_q(x, pack(packed, scale, 4, 8)))."""
    return jax.grad(lambda s: jnp.sum(qa.linear_q(x, qa.pack(packed, s, 4, 8)) * g))(
        scale
    )


@jax.jit
def _x_grads(x, q, g):
    """d/dx of sum(g * linear_q(x, q, a)) for a in float32, int8."""
    return [
        jax.grad(lambda x, a=a: jnp.sum(qa.linear_q(x, q, a) * g))(x)
        for a in ("float32", "int8")
    ]


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("group_size", [2, 32, 128])
def test_quantize_packs_like_numpy(rng, group_size):
    x = normal(rng, (3, 256))
    x[1, :group_size] = 0  # an all-zero group: scale 0, values 0
    q = quantize(x, bits=4, group_size=group_size)
    assert str(jax.typeof(q)) == "q4[3,256]"
    values, scale = ref.quantize4(x, group_size)
    packed, got_scale = qa.unpack(q)
    assert packed.dtype == np.uint8 and packed.shape == (3, 128)
    assert got_scale.shape == (3, 256 // group_size)
    np.testing.assert_array_equal(packed, ref.pack4(values))
    np.testing.assert_allclose(got_scale, scale, rtol=1e-6)
    assert np.all(np.abs(values) <= 7) and scale[1, 0] == 0
    np.testing.assert_allclose(dequantize(q), ref.dequantize4(values, scale), rtol=1e-6)
    # the bytes: half of int8's payload
    assert packed.nbytes == x.size // 2


@pytest.mark.parametrize("group_size", [2, 32, 256])
def test_the_kind_is_read_back_from_the_parts(rng, group_size):
    """kind_of_parts (what the type, qarray.jit and model files read): the
    bits and group size quantize was given, from the parts alone."""
    from qarray._qarray import kind_of_parts

    x = normal(rng, (2, 3, 256))
    q4 = quantize(x, bits=4, group_size=group_size)
    assert kind_of_parts(q4.qvalue, q4.scale) == (4, group_size)
    assert kind_of_parts(np.asarray(q4.qvalue), np.asarray(q4.scale)) == (
        4,
        group_size,
    )
    assert (jax.typeof(q4).bits, jax.typeof(q4).group_size) == (4, group_size)
    q8 = quantize(x)
    assert kind_of_parts(q8.qvalue, q8.scale) == (8, None)


def test_nibble_order_and_sign():
    # eager on purpose: the one un-jitted int4 quantize of this file
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
    packed, scale = unpacked(quantize(x, bits=4, group_size=16))
    q = qa.pack(packed, scale, bits=4, group_size=16)  # eager on purpose
    assert str(jax.typeof(q)) == "q4[4,64]"
    values = ref.quantize4(x, 16)[0]
    np.testing.assert_allclose(
        qa.dequantize(q), ref.dequantize4(values, scale), rtol=1e-6
    )
    g = normal(rng, (4, 64))
    grad = jax.jit(
        jax.grad(lambda s: jnp.sum(qa.dequantize(qa.pack(packed, s, 4, 16)) * g))
    )(scale)
    want = (g * values).reshape(4, 4, 16).sum(-1)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


def int4_reference(x, w, group_size, activations):
    """x @ W4^T in float64, x first rounded to its per-row int8 grid for W4A8."""
    if activations == "int8":
        x = ref.roundtrip(x)
    return x.astype(np.float64) @ ref.roundtrip4(w, group_size).astype(np.float64).T


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize(
    "strategy",
    [
        None,
        "dequantize",
        pytest.param("kernel", marks=pytest.mark.cpu_only("qarray's C++ kernels")),
        "pallas_groups",
        "pallas_tile",
        "int4_bf16",
    ],
)
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_linear_q_int4_matches_numpy(rng, strategy, m, activations, group_size):
    """Every strategy; the TPU's kernels (qarray/_tpu, interpreted off a
    TPU): mode groups reads the bytes a word at a time at G = 128 and unpacks
    them by shifts at G = 64, and takes int8 activations as one int8 part
    of x; mode tile is weight-only and refuses them, as does int4_bf16 (XLA's
    one bf16 pass: x and the dequantized weights rounded to bf16, 2**-9
    each, so its bound is a relative error of the whole product)."""
    if strategy == "kernel" and not _ffi.available():
        pytest.skip(f"CPU kernels: {_ffi.status()}")
    if strategy in ("pallas_tile", "int4_bf16") and activations == "int8":
        packed, scale = unpacked(
            quantize(np.ones((8, 128), np.float32), bits=4, group_size=group_size)
        )
        with pytest.raises(ValueError, match="weight-only"):
            _formulations.linear_int4(
                np.ones((m, 128), np.float32), packed, scale, activations, strategy
            )
        return
    k, n = 256, 48
    x, w = normal(rng, (m, k)), normal(rng, (n, k))
    q = quantize(w, bits=4, group_size=group_size)
    want = int4_reference(x, w, group_size, activations)
    if strategy is None:
        got = linear_q(x, q, activations)
    else:
        packed, scale = unpacked(q)
        product = lambda *a: _formulations.linear_int4(*a, activations, strategy)  # noqa: E731
        got = jax.jit(product)(x, packed, scale)
    if strategy == "int4_bf16":
        err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        assert 0 < err <= 2.0**-7, err  # rounded (> 0), within bf16's pass
        return
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * np.abs(want).max())


@pytest.mark.parametrize("m", [3, 64])
def test_w4a8_error_bound(rng, m):
    """W4A8 differs from weight-only int4 by at most the rounding of x to its
    int8 grid: |y_a8 - y_w4| <= (max|x_row| / 254) * sum_k |W4[n, k]|."""
    k, n = 256, 40
    x, w = normal(rng, (m, k)), normal(rng, (n, k))
    q = quantize(w, bits=4, group_size=128)
    product = linear_q
    gap = np.abs(
        np.asarray(product(x, q, "int8")) - np.asarray(product(x, q, "float32"))
    )
    half_step = np.abs(x).max(-1, keepdims=True) / 254
    bound = half_step * np.abs(ref.roundtrip4(w, 128)).sum(-1)[None, :]
    assert np.all(gap <= bound * (1 + 1e-4) + 1e-5)
    assert gap.max() > 0  # the mode does quantize x
    # gradients are those of the weight-only product (straight-through in x)
    g = normal(rng, (m, n))
    grads = _x_grads(x, q, g)
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-6)


def test_vmap_and_scan_over_stacked_int4_weights(rng):
    ws = normal(rng, (3, 6, 32))
    qws = _quantize_stack(ws)
    assert str(jax.typeof(qws)) == "q4[3,6,32]"
    x = normal(rng, (2, 32))
    got = _linear_stack(x, qws)
    want = np.stack([x @ ref.roundtrip4(w, 8).T for w in ws])
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # scan: three same-shape int4 layers (32 -> 32)
    ws = normal(rng, (3, 32, 32)) * 0.3
    qws = _quantize_stack(ws)

    def run(x, qws):
        h, _ = jax.lax.scan(
            lambda h, q: (jnp.tanh(qa.linear_q(h, q)), None), x, qws, length=3
        )
        return h

    h = x.astype(np.float64)
    for w in ws:
        h = np.tanh(h @ ref.roundtrip4(w, 8).T)
    for fn in (run, jax.jit(run)):  # run: an eager scan, on purpose
        np.testing.assert_allclose(fn(x, qws), h, rtol=RTOL, atol=ATOL)


def test_grad_with_respect_to_stored_int4_scales(rng):
    x, w = normal(rng, (3, 32)), normal(rng, (4, 32))
    packed, scale = unpacked(quantize(w, bits=4, group_size=8))
    g = normal(rng, (3, 4))
    values = ref.quantize4(w, 8)[0].astype(np.float64)
    # d/ds[n, j] of sum g[m, n] x[m, k] v[n, k] s[n, k // 8]
    want = np.einsum("mn,mk,nk->nk", g, x, values).reshape(4, 4, 8).sum(-1)
    np.testing.assert_allclose(
        _scale_grad(packed, scale, x, g), want, rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize(
    "n", [pytest.param(300, marks=pytest.mark.cpu_breadth("n = 1024's")), 1024]
)
def test_the_x_cotangent_of_int4_weights_holds_no_float_copy(rng, n):
    """The backward pass of a large int4 layer dequantizes a block of rows
    at a time (a remainder block for n = 300): the values of g @ W, and a
    compiled VJP whose temporaries are far below the float32 weights'."""
    k = 4096
    w = normal(rng, (n, k))
    q = quantize(w, bits=4, group_size=128)
    x, g = normal(rng, (8, k)), normal(rng, (8, n))

    def ct_x(x, q, g):
        return jax.vjp(lambda x: qa.linear_q(x, q), x)[1](g)[0]

    # against the weights q holds (the quantizer's own rounding is tested above)
    packed, scale = unpacked(q)
    values = ref.unpack4(np.asarray(packed))
    dense = ref.dequantize4(values, np.asarray(scale))
    want = g.astype(np.float64) @ dense.astype(np.float64)
    np.testing.assert_allclose(jax.jit(ct_x)(x, q, g), want, rtol=1e-4, atol=1e-3)
    # the blocked rule under vmap and differentiated again (its scan of
    # primitives transforms like any other)
    batched = jax.jit(jax.vmap(ct_x, in_axes=(None, None, 0)))(
        x, q, np.stack([g, 2 * g])
    )
    np.testing.assert_allclose(batched[1], 2 * want, rtol=1e-4, atol=2e-3)
    second = jax.jit(jax.grad(lambda g, x, q: jnp.sum(ct_x(x, q, g) ** 2)))(g, x, q)
    np.testing.assert_allclose(
        second, 2 * want @ dense.T.astype(np.float64), rtol=1e-3, atol=5e-2
    )
    if n == 1024:
        memory = jax.jit(ct_x).lower(x, q, g).compile().memory_analysis()
        assert memory.temp_size_in_bytes < 4 * n * k / 4, memory


@pytest.mark.parametrize("block_rows", [None, 48], ids=["whole", "blocks"])
def test_the_x_cotangent_in_bf16_blocks_matches_numpy(rng, monkeypatch, block_rows):
    """The TPU's form of int4's x cotangent at one bf16 pass (there it is
    chosen by platform; forced here): g and the dequantized weights rounded
    to bf16, summed in float32, the layer whole or in blocks of 48 rows of
    300 (a remainder block); under vmap too."""
    from qarray import _primitives

    k, n = 512, 300
    if block_rows:
        monkeypatch.setattr(_primitives, "_INT4_BLOCK_BYTES_TPU", 2 * k * block_rows)
    q = quantize(normal(rng, (n, k)), bits=4, group_size=128)
    g = normal(rng, (2, 4, n))
    packed, scale = unpacked(q)
    dense = ref.dequantize4(ref.unpack4(np.asarray(packed)), np.asarray(scale))
    want = g.astype(np.float64) @ dense.astype(np.float64)
    rows = jax.jit(
        functools.partial(_primitives._int4_blocks, group_size=128, bf16=True)
    )
    got = np.asarray(rows(g, *unpacked(q)), np.float64)
    assert got.shape == (2, 4, k)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 0 < err <= 2.0**-7, err
    batched = jax.vmap(rows, in_axes=(0, None, None))(
        np.stack([g, 2 * g]), *unpacked(q)
    )
    np.testing.assert_allclose(batched[1], 2 * got, rtol=1e-6, atol=1e-5)


def test_full_hessian_over_x_and_int4_w(rng):
    """Second derivatives of linear_q on int4 weights, the mixed terms
    included (the x cotangent's derivative in w, which the backward's whole
    float32 form carries for a small layer), against central differences of
    the float64 straight-through gradient at the dequantized weights."""
    x, w = normal(rng, (2, 4)), normal(rng, (3, 4))

    def f(x, w):
        return jnp.sum(jnp.sin(qa.linear_q(x, quantize(w, bits=4, group_size=2))))

    hess = jax.jit(jax.hessian(f, (0, 1)))(x, w)

    def grad_ref(flat):  # the gradient of sum(sin(x @ W.T))
        xx, ww = flat[:8].reshape(2, 4), flat[8:].reshape(3, 4)
        g = np.cos(xx @ ww.T)
        return np.concatenate([(g @ ww).ravel(), (g.T @ xx).ravel()])

    point = np.concatenate([x.ravel(), ref.roundtrip4(w, 2).ravel()]).astype(np.float64)
    eps = 1e-6
    numeric = np.stack(
        [
            (grad_ref(point + eps * e) - grad_ref(point - eps * e)) / (2 * eps)
            for e in np.eye(20)
        ],
        axis=1,
    )
    sizes = (8, 12)
    got = np.block(
        [
            [np.asarray(hess[i][j]).reshape(sizes[i], sizes[j]) for j in range(2)]
            for i in range(2)
        ]
    )
    np.testing.assert_allclose(got, numeric, rtol=1e-3, atol=1e-3)


def test_output_channels_sharded(mesh, rng):
    x, w = normal(rng, (3, 32)), normal(rng, (8, 32))
    ws = jax.device_put(w, P("i"))
    q = quantize(ws, bits=4, group_size=8)
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
    np.testing.assert_allclose(dequantize(q), ref.roundtrip4(w, 8), rtol=1e-6)

    @jax.jit
    @jax.shard_map(in_specs=qa.QArrayP(P("i")), out_specs=P("i"))
    def dequantize_shards(q):
        return qa.dequantize(q)

    np.testing.assert_allclose(dequantize_shards(q), ref.roundtrip4(w, 8), rtol=1e-6)


@pytest.mark.parametrize(
    "fn, error, match",
    [
        (
            lambda: qa.quantize(np.ones((2, 12), np.float32), bits=4, group_size=8),
            TypeError,
            "multiple of group_size=8",
        ),
        (
            lambda: qa.quantize(np.ones((2, 12), np.float32), bits=4, group_size=3),
            ValueError,
            "positive even int",
        ),
        (
            lambda: qa.quantize(np.ones((2, 12), np.float32), bits=2),
            ValueError,
            r"bits in \(8, 4\)",
        ),
        (
            lambda: qa.quantize(np.ones((2, 12), np.float32), group_size=4),
            ValueError,
            "group_size is for bits=4",
        ),
        (
            lambda: qa.matmul_q(
                np.ones((2, 8), np.float32),
                quantize(np.ones((8, 8), np.float32), bits=4, group_size=4),
            ),
            TypeError,
            'layout "nk"',
        ),
        (
            lambda: qa.pack(
                np.zeros((2, 4), np.int8),
                np.ones((2, 1), np.float32),
                bits=4,
                group_size=8,
            ),
            TypeError,
            "uint8",
        ),
        (
            lambda: qa.pack(
                np.zeros((2, 4), np.uint8),
                np.ones((2, 2), np.float32),
                bits=4,
                group_size=8,
            ),
            TypeError,
            r"scale of shape \(2, 1\)",
        ),
    ],
)
def test_errors_at_trace_time(fn, error, match):
    with pytest.raises(error, match=match):
        fn()


def test_w4a8_linear_layer(rng):
    """qarray.nn.Linear with int4 weights and int8 activations: the W4A8
    product plus its bias, under jit and grad."""
    from qarray import nn as qnn

    x, w, b = normal(rng, (6, 128)), normal(rng, (24, 128)), normal(rng, (24,))
    # eager (from_float records the weight error as a Python float)
    layer = qnn.Linear.from_float(
        w,
        b,
        precision="int4",
        group_size=32,
        activations="int8",
    )
    want = int4_reference(x, w, 32, "int8") + b
    got = eqx.filter_jit(lambda m, x: m(x))(layer, x)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * np.abs(want).max())
    g = eqx.filter_jit(jax.grad(lambda x, m: jnp.sum(m(x)), argnums=0))(x, layer)
    np.testing.assert_allclose(
        g, np.ones((6, 24)) @ ref.roundtrip4(w, 32), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("group_size", [64, 128])
def test_int4_rows_of_no_entries(group_size):
    """int4 weights whose rows hold no entries (K = 0): their parts are
    empty, the type reads the default group size (no group to measure;
    every G lays them out alike), and products, their gradients and a
    repack run: an empty contraction sums to 0."""
    from qarray._qarray import DEFAULT_GROUP_SIZE

    q = qa.quantize(jnp.ones((3, 0)), bits=4, group_size=group_size)
    packed, scale = qa.unpack(q)
    assert packed.shape == (3, 0) and scale.shape == (3, 0)
    assert jax.typeof(q).shape == (3, 0)
    assert jax.typeof(q).group_size == DEFAULT_GROUP_SIZE
    assert jax.jit(qa.dequantize)(q).shape == (3, 0)
    x = jnp.ones((2, 0))
    for activations in ("float32", "int8"):
        y = qa.linear_q(x, q, activations=activations)
        np.testing.assert_array_equal(np.asarray(y), np.zeros((2, 3)))
    grad_x = jax.grad(lambda x: qa.linear_q(x, q).sum())(x)
    grad_w = jax.grad(lambda w: qa.linear_q(x, qa.quantize(w, 4, group_size)).sum())(
        jnp.ones((3, 0))
    )
    assert grad_x.shape == (2, 0) and grad_w.shape == (3, 0)
    assert jax.typeof(qa.pack(packed, scale, 4, group_size)).shape == (3, 0)
    # traced and eager types agree: a scan carry re-quantized in its body
    traced = jax.jit(lambda w: qa.quantize(w, 4, group_size)).trace(jnp.ones((3, 0)))
    assert traced.jaxpr.out_avals[0] == jax.typeof(q)
    carry, _ = jax.lax.scan(
        lambda c, _: (qa.quantize(jnp.ones((3, 0)), 4, group_size), None),
        q,
        None,
        length=2,
    )
    assert jax.typeof(carry) == jax.typeof(q)
