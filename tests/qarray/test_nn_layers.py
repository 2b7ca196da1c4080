"""qarray.nn.Embedding, quantized recurrent cells, ConvTranspose and
multi-head attention through its quantized projections, against NumPy.

Covers: qarray/nn/_embedding.py, qarray/nn/_quantize.py"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray.nn as qnn
from support import reference as ref
from support.breadth import breadth_param
from support.compiled import call, vcall


# Models are called through support.compiled and the helpers here (one XLA
# program per model structure and shape) rather than eagerly, op by op. One
# eager call per layer kind stays: Embedding in
# test_lookups_are_the_quantized_rows, the cells' scan in
# test_recurrent_cells_against_numpy, ConvTranspose in
# test_conv_transpose_named_paddings_and_qat.
@eqx.filter_jit
def x_gradient(model, x, g):
    """d/dx of sum(model(x) * g)."""
    return jax.grad(lambda x: jnp.sum(model(x) * g))(x)


def table(rng, num=10, size=32):
    return rng.standard_normal((num, size)).astype(np.float32)


def expected_rows(weight, precision, group_size):
    if precision == "int4":
        return ref.roundtrip4(weight, group_size)
    return ref.roundtrip(weight)


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("trainable", [False, True])
def test_lookups_are_the_quantized_rows(rng, precision, trainable):
    weight = table(rng)
    layer = eqx.nn.Embedding(weight=jnp.asarray(weight))
    emb = qnn.Embedding.from_eqx(
        layer, trainable=trainable, precision=precision, group_size=16
    )
    index = np.asarray([3, 0, 9, 3], np.int32)
    got = vcall(emb, index)
    want = expected_rows(weight, precision, 16)[index]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert got.shape == jax.eval_shape(jax.vmap(layer), index).shape
    # equinox's convention: a key is accepted (eager on purpose)
    np.testing.assert_array_equal(emb(3, key=jax.random.key(0)), got[0])


def test_gradients(rng):
    """Stored: exact w.r.t. the scales (sum of g * qvalue over the row);
    trainable: straight-through (g lands on the looked-up rows)."""
    weight = table(rng, 6, 8)
    g = rng.standard_normal((3, 8)).astype(np.float32)
    index = np.asarray([1, 4, 1], np.int32)
    stored = qnn.Embedding.from_eqx(eqx.nn.Embedding(weight=jnp.asarray(weight)))

    @eqx.filter_jit
    @jax.grad
    def scale_gradient(scale, stored, index, g):
        e = eqx.tree_at(lambda t: t.scale, stored, scale)
        return jnp.sum(jax.vmap(e)(index) * g)

    got = scale_gradient(stored.scale, stored, index, g)
    qvalue, _ = ref.quantize(weight)
    want = np.zeros(6, np.float64)
    for row, i in enumerate(index):
        want[i] += g[row] @ qvalue[i]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    trainable = qnn.Embedding.from_eqx(
        eqx.nn.Embedding(weight=jnp.asarray(weight)), trainable=True
    )
    grads = eqx.filter_jit(
        eqx.filter_grad(lambda e, index, g: jnp.sum(jax.vmap(e)(index) * g))
    )(trainable, index, g)
    want_w = np.zeros_like(weight)
    np.add.at(want_w, index, g)
    np.testing.assert_allclose(grads.weight, want_w, rtol=1e-6, atol=1e-6)


def test_quantize_and_freeze_a_model_with_an_embedding(rng):
    k1, k2 = jax.random.split(jax.random.key(0))
    model = eqx.nn.Sequential(
        [eqx.nn.Embedding(20, 16, key=k1), eqx.nn.Linear(16, 4, key=k2)]
    )
    stored = qnn.quantize(model)
    trainable = qnn.quantize(model, trainable=True)
    assert (
        isinstance(stored.layers[0], qnn.Embedding) and not stored.layers[0].trainable
    )
    assert stored.layers[0].qvalue.dtype == jnp.int8
    frozen = qnn.freeze(trainable)
    assert not frozen.layers[0].trainable
    index = np.arange(5, dtype=np.int32)
    np.testing.assert_allclose(
        vcall(frozen, index), vcall(stored, index), rtol=1e-6, atol=1e-6
    )
    emb, linear = model.layers
    rows = ref.roundtrip(np.asarray(emb.weight))[:5]
    want = rows @ ref.roundtrip(np.asarray(linear.weight)).T + np.asarray(linear.bias)
    np.testing.assert_allclose(vcall(stored, index), want, rtol=1e-4, atol=1e-4)
    # int4 where the group size divides the row: the table packs, 8 bytes a row
    packed = qnn.quantize(model, precision="int4", group_size=8).layers[0]
    assert packed.qvalue.dtype == jnp.uint8 and packed.qvalue.shape == (20, 8)
    # where= keeps it float
    kept = qnn.quantize(model, where=lambda layer: layer is not emb)
    assert isinstance(kept.layers[0], eqx.nn.Embedding)


def test_errors_name_what_was_required(rng):
    with pytest.raises(TypeError, match="either weight"):
        qnn.Embedding()
    with pytest.raises(TypeError, match="multiple of group_size 16"):
        qnn.Embedding(np.zeros((4, 12), np.float32), precision="int4", group_size=16)
    with pytest.raises(ValueError, match="precision in"):
        qnn.Embedding(np.zeros((4, 8), np.float32), precision="int2")


# --- recurrent cells: their matrices quantized, the cell classes kept


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def numpy_gru(cell, x, h):
    w_ih, w_hh = (
        ref.roundtrip(np.asarray(w)) for w in (cell.weight_ih, cell.weight_hh)
    )
    gi = w_ih @ x + np.asarray(cell.bias)
    gh = w_hh @ h
    (ir, iz, in_), (hr, hz, hn) = np.split(gi, 3), np.split(gh, 3)
    reset, update = _sigmoid(ir + hr), _sigmoid(iz + hz)
    new = np.tanh(in_ + reset * (hn + np.asarray(cell.bias_n)))
    return new + update * (h - new)


def numpy_lstm(cell, x, h, c):
    w_ih, w_hh = (
        ref.roundtrip(np.asarray(w)) for w in (cell.weight_ih, cell.weight_hh)
    )
    i, f, g, o = np.split(w_ih @ x + w_hh @ h + np.asarray(cell.bias), 4)
    c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
    return _sigmoid(o) * np.tanh(c), c


@pytest.mark.parametrize("trainable", [False, True])
def test_recurrent_cells_against_numpy(rng, trainable):
    k1, k2 = jax.random.split(jax.random.key(3))
    gru, lstm = eqx.nn.GRUCell(6, 8, key=k1), eqx.nn.LSTMCell(6, 8, key=k2)
    qgru = qnn.quantize(gru, trainable=trainable)
    qlstm = qnn.quantize(lstm, trainable=trainable)
    assert isinstance(qgru.weight_ih, qnn.Linear)  # no float matrix left
    assert isinstance(qlstm.weight_hh, qnn.Linear)
    x, h, c = (rng.standard_normal(n).astype(np.float32) for n in (6, 8, 8))
    got = jax.jit(lambda cell, x, h: cell(x, h, key=k1))(qgru, x, h)
    np.testing.assert_allclose(got, numpy_gru(gru, x, h), rtol=1e-5, atol=1e-5)
    got_h, got_c = jax.jit(lambda cell, x, hc: cell(x, hc))(qlstm, x, (h, c))
    want_h, want_c = numpy_lstm(lstm, x, h, c)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_c, want_c, rtol=1e-5, atol=1e-5)
    # a scan over a sequence, as equinox's RNN examples run them
    xs = rng.standard_normal((5, 6)).astype(np.float32)
    _, hs = jax.lax.scan(lambda h, x: (qgru(x, h), qgru(x, h)), h, xs)  # eager
    want, state = [], h
    for x_t in xs:
        state = numpy_gru(gru, x_t, state)
        want.append(state)
    np.testing.assert_allclose(hs, np.stack(want), rtol=1e-4, atol=1e-4)
    frozen = qnn.freeze(qgru)
    assert not frozen.weight_ih.trainable


def conv_transpose(x, w, stride, pads, dilation, output_padding):
    """A transposed convolution in float64 by scattering (PyTorch's
    definition): input position i and kernel offset k land on output
    ``s * i + d * k - p0``, with ``w (out, in, *k)`` in equinox's layout (the
    kernel flipped against PyTorch's ``(in, out, *k)``)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    kernel = w.shape[2:]
    out_shape = [
        (n - 1) * s - p0 - p1 + d * (k - 1) + a + 1
        for n, s, (p0, p1), d, k, a in zip(
            x.shape[1:], stride, pads, dilation, kernel, output_padding, strict=True
        )
    ]
    y = np.zeros((w.shape[0], *out_shape))
    for i in np.ndindex(*x.shape[1:]):
        for k in np.ndindex(*kernel):
            t = [
                s * ii + d * (kk_max - 1 - kk) - p0
                for ii, kk, kk_max, s, d, (p0, _) in zip(
                    i, k, kernel, stride, dilation, pads, strict=True
                )
            ]
            if all(0 <= tt < n for tt, n in zip(t, out_shape, strict=True)):
                y[(slice(None), *t)] += (
                    w[(slice(None), slice(None), *k)] @ x[(slice(None), *i)]
                )
    return y


TRANSPOSED = [  # eqx.nn.ConvTranspose arguments
    {"num_spatial_dims": 1, "kernel_size": 4, "stride": 3, "padding": 1},
    {
        "num_spatial_dims": 2,
        "kernel_size": 3,
        "stride": 2,
        "padding": 1,
        "output_padding": 1,
    },
    {
        "num_spatial_dims": 2,
        "kernel_size": (3, 2),
        "stride": (1, 2),
        "dilation": (2, 1),
    },
    {"num_spatial_dims": 3, "kernel_size": 2, "stride": 2},
]


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize(
    "conv",
    [
        breadth_param(
            c,
            reason="3-D convolutions: test_conv's"
            if c["num_spatial_dims"] == 3
            else None,
        )
        for c in TRANSPOSED
    ],
    ids=lambda c: f"{c['num_spatial_dims']}d",
)
def test_conv_transpose_against_numpy(rng, conv, precision):
    """qnn.quantize of an eqx.nn.ConvTranspose: the scatter definition on the
    dequantized weights, values and gradients w.r.t. x; equinox's own float
    layer on those weights as a second reference."""
    nsp = conv["num_spatial_dims"]
    layer = eqx.nn.ConvTranspose(
        in_channels=4, out_channels=8, key=jax.random.key(1), **conv
    )
    quantized = qnn.quantize(layer, precision=precision, group_size=4)
    assert isinstance(quantized, qnn.ConvTranspose)
    x = rng.standard_normal((4, *(5,) * nsp)).astype(np.float32)
    w = np.asarray(layer.weight)
    flat = w.reshape(w.shape[0], -1)
    deq = (
        ref.roundtrip4(flat, 4) if precision == "int4" else ref.roundtrip(flat)
    ).reshape(w.shape)
    per_axis = lambda v: (v,) * nsp if isinstance(v, int) else tuple(v)  # noqa: E731
    pads = [(p, p) for p in per_axis(conv.get("padding", 0))]
    args = [per_axis(conv.get(k, d)) for k, d in (("stride", 1), ("dilation", 1))]
    extra = per_axis(conv.get("output_padding", 0))
    want = conv_transpose(x, deq, args[0], pads, args[1], extra)
    want += np.asarray(layer.bias).reshape(-1, *(1,) * nsp)
    got = call(quantized, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    float_layer = eqx.tree_at(lambda m: m.weight, layer, deq.astype(np.float32))
    np.testing.assert_allclose(got, call(float_layer, x), rtol=1e-4, atol=1e-4)
    # the gradient w.r.t. x is the float layer's (straight-through)
    g = rng.standard_normal(want.shape).astype(np.float32)
    gx = x_gradient(quantized, x, g)
    np.testing.assert_allclose(gx, x_gradient(float_layer, x, g), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("padding", ["SAME", "SAME_LOWER", "VALID"])
def test_conv_transpose_named_paddings_and_qat(rng, padding):
    layer = eqx.nn.ConvTranspose(
        2, 3, 6, 3, stride=2, padding=padding, groups=3, key=jax.random.key(2)
    )
    x = rng.standard_normal((3, 7, 6)).astype(np.float32)
    qat = qnn.quantize(layer, trainable=True)
    exported = qnn.freeze(qat)
    assert exported.qvalue.dtype == np.int8 and exported.weight is None
    deq = ref.roundtrip(np.asarray(layer.weight).reshape(6, -1)).reshape(
        layer.weight.shape
    )
    float_layer = eqx.tree_at(lambda m: m.weight, layer, deq)
    exported_x = exported(x)  # eager on purpose: a stored ConvTranspose op by op
    np.testing.assert_allclose(exported_x, call(float_layer, x), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(call(qat, x), exported_x, rtol=1e-5, atol=1e-5)
    # trainable: straight-through gradient w.r.t. the float weights
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2)))(qat, x)
    assert grads.weight.shape == layer.weight.shape and np.all(
        np.isfinite(grads.weight)
    )


def test_conv_transpose_errors():
    with pytest.raises(ValueError, match="output_padding"):
        qnn.ConvTranspose(np.ones((2, 2, 3), np.float32), stride=2, output_padding=2)
    with pytest.raises(ValueError, match="padding up to"):
        qnn.ConvTranspose(np.ones((2, 2, 3), np.float32), padding=3)


PROJECTIONS = ("query_proj", "key_proj", "value_proj", "output_proj")


def numpy_attention(mha, x):
    """Self-attention of ``x (length, size)`` in float64 by an
    ``eqx.nn.MultiheadAttention`` (no biases) with its four projections'
    weights quantized and dequantized."""
    x = np.asarray(x, np.float64)
    length, size = x.shape
    heads = mha.num_heads
    w = {
        p: ref.roundtrip(np.asarray(getattr(mha, p).weight)).astype(np.float64)
        for p in PROJECTIONS
    }

    def split(a):  # (length, size) -> (heads, length, size / heads)
        return a.reshape(length, heads, -1).transpose(1, 0, 2)

    q, k, v = (split(x @ w[p].T) for p in PROJECTIONS[:3])
    logits = q @ k.transpose(0, 2, 1) / np.sqrt(size // heads)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    attended = (weights @ v).transpose(1, 0, 2).reshape(length, size)
    return attended @ w["output_proj"].T


def test_multihead_attention_through_its_quantized_projections(rng):
    """eqx.nn.MultiheadAttention quantizes through its four Linear
    projections: attention in NumPy on the dequantized weights."""
    heads, size, length = 2, 16, 5
    mha = eqx.nn.MultiheadAttention(heads, size, key=jax.random.key(3))
    quantized = qnn.quantize(mha)
    assert all(isinstance(getattr(quantized, p), qnn.Linear) for p in PROJECTIONS)
    x = rng.standard_normal((length, size)).astype(np.float64)
    want = numpy_attention(mha, x)
    xs = x.astype(np.float32)
    got = eqx.filter_jit(lambda m, x: m(x, x, x))(quantized, xs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
