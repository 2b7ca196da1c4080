"""qarray.nn.Embedding and quantized recurrent cells against NumPy."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray.nn as qnn
from tests import reference as ref


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
    index = jnp.asarray([3, 0, 9, 3])
    got = jax.jit(jax.vmap(emb))(index)
    want = expected_rows(weight, precision, 16)[np.asarray(index)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert got.shape == jax.vmap(layer)(index).shape
    # equinox's convention: a key is accepted
    np.testing.assert_array_equal(emb(3, key=jax.random.key(0)), got[0])


def test_gradients(rng):
    """Stored: exact w.r.t. the scales (sum of g * qvalue over the row);
    trainable: straight-through (g lands on the looked-up rows)."""
    weight = table(rng, 6, 8)
    g = rng.standard_normal((3, 8)).astype(np.float32)
    index = jnp.asarray([1, 4, 1])
    stored = qnn.Embedding.from_eqx(eqx.nn.Embedding(weight=jnp.asarray(weight)))

    def loss(scale):
        e = eqx.tree_at(lambda t: t.scale, stored, scale)
        return jnp.sum(jax.vmap(e)(index) * g)

    got = jax.grad(loss)(stored.scale)
    qvalue, _ = ref.quantize(weight)
    want = np.zeros(6, np.float64)
    for row, i in enumerate(np.asarray(index)):
        want[i] += g[row] @ qvalue[i]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    trainable = qnn.Embedding.from_eqx(
        eqx.nn.Embedding(weight=jnp.asarray(weight)), trainable=True
    )
    grads = eqx.filter_grad(lambda e: jnp.sum(jax.vmap(e)(index) * g))(trainable)
    want_w = np.zeros_like(weight)
    np.add.at(want_w, np.asarray(index), g)
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
    index = jnp.arange(5)
    np.testing.assert_allclose(
        jax.vmap(frozen)(index), jax.vmap(stored)(index), rtol=1e-6, atol=1e-6
    )
    emb, linear = model.layers
    rows = ref.roundtrip(np.asarray(emb.weight))[:5]
    want = rows @ ref.roundtrip(np.asarray(linear.weight)).T + np.asarray(linear.bias)
    np.testing.assert_allclose(jax.vmap(stored)(index), want, rtol=1e-4, atol=1e-4)
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
        qnn.Embedding(jnp.zeros((4, 12)), precision="int4", group_size=16)
    with pytest.raises(ValueError, match="precision in"):
        qnn.Embedding(jnp.zeros((4, 8)), precision="int2")


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
    _, hs = jax.lax.scan(lambda h, x: (qgru(x, h), qgru(x, h)), h, xs)
    want, state = [], h
    for x_t in xs:
        state = numpy_gru(gru, x_t, state)
        want.append(state)
    np.testing.assert_allclose(hs, np.stack(want), rtol=1e-4, atol=1e-4)
    frozen = qnn.freeze(qgru)
    assert not frozen.weight_ih.trainable
