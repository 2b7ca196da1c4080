"""GPTQ (qnn.quantize(method="gptq", data=X)) against a NumPy GPTQ written
from the paper, and what it buys over round-to-nearest on held-out data."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray.nn as qnn
from qarray.checkpoint import load_quantized, save_tree
from qarray.nn._gptq import gptq
from support import reference as ref


def layer_error(w, back, h):
    """trace((W - Q) H (W - Q)^T): the layer's output error on the data."""
    d = np.asarray(w, np.float64) - back
    return float(np.einsum("ok,kl,ol->", d, h, d))


def dequantized(values, scales, group_size):
    if scales.ndim == 1:
        return values * scales[:, None]
    return (values.reshape(*scales.shape, -1) * scales[..., None]).reshape(values.shape)


@pytest.mark.parametrize(
    "bits, group_size, act_order",
    [(8, None, False), (8, None, True), (4, 16, False), (4, 16, True), (4, 20, False)],
)
def test_the_same_values_as_numpy_gptq(rng, bits, group_size, act_order):
    """A small layer (K = 160: more than one block of columns, and groups of
    20 not dividing the block): the values NumPy's GPTQ picks (a few may
    round the other way: the loop runs in float32), and the same error."""
    out, k = 12, 160
    # correlated inputs of uneven scales, as a layer's usually are
    mixing = rng.standard_normal((24, k)) + 0.2 * np.eye(24, k)
    x = rng.standard_normal((300, 24)) @ mixing * np.linspace(0.2, 3, k)
    x += 0.05 * rng.standard_normal(x.shape)
    w = rng.standard_normal((out, k))
    h = x.T @ x
    v, s = gptq(w, h, bits=bits, group_size=group_size, act_order=act_order)
    want_v, want_s = ref.gptq(w, h, bits, group_size, act_order=act_order)
    assert v.dtype == np.int8 and np.abs(v).max() <= (127 if bits == 8 else 7)
    same = np.mean(v == want_v)
    assert same > 0.97, same
    assert np.all(np.abs(v.astype(int) - want_v) <= 1)
    np.testing.assert_allclose(s, want_s, rtol=1e-3, atol=1e-6)
    got_error = layer_error(w, dequantized(v, s.astype(np.float64), group_size), h)
    want_error = layer_error(w, dequantized(want_v, want_s, group_size), h)
    assert got_error == pytest.approx(want_error, rel=0.02)
    # and both far below round-to-nearest's
    rtn = dequantized(*(
        ref.quantize4(w, group_size) if bits == 4 else ref.quantize(w)
    ), group_size).astype(np.float64)  # fmt: skip
    assert got_error < 0.7 * layer_error(w, rtn, h)


def test_dead_inputs_get_zero_weights(rng):
    x = rng.standard_normal((50, 8))
    x[:, 3] = 0
    v, _ = gptq(rng.standard_normal((4, 8)), x.T @ x)
    np.testing.assert_array_equal(v[:, 3], 0)


class SmallCNN(eqx.Module):
    convs: list
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.convs = [
            eqx.nn.Conv2d(2, 8, 3, padding=1, key=k[0]),
            eqx.nn.Conv2d(8, 8, 3, padding=1, groups=2, key=k[1]),
            eqx.nn.Conv2d(8, 8, 3, stride=2, dilation=1, key=k[2]),
        ]
        self.head = eqx.nn.Linear(8 * 3 * 3, 4, key=k[3])

    def __call__(self, x):
        for conv in self.convs:
            x = jax.nn.gelu(conv(x))
        return self.head(x.ravel())


def relative(model, reference, x):
    y, want = jax.vmap(model)(x), jax.vmap(reference)(x)
    return float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want))


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_a_cnn_quantized_by_gptq_beats_round_to_nearest_on_held_out_data(
    rng, precision, tmp_path
):
    model = SmallCNN(jax.random.key(0))
    # correlated inputs (smooth fields), as a surrogate's are
    smooth = lambda n: jnp.asarray(  # noqa: E731
        np.cumsum(np.cumsum(rng.standard_normal((n, 2, 8, 8)), 2), 3) / 4, jnp.float32
    )
    calibration, held_out = smooth(128), smooth(64)
    options = {"precision": precision, "group_size": 6}  # divides every K
    rtn = qnn.quantize(model, **options)
    calibrated = qnn.quantize(model, method="gptq", data=calibration, **options)
    assert all(isinstance(c, qnn.Conv) for c in calibrated.convs)
    assert calibrated.convs[0].precision == precision
    err_rtn, err_gptq = (
        relative(rtn, model, held_out),
        relative(calibrated, model, held_out),
    )
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)
    # stored like any quantized layer: a model file round trip
    save_tree(tmp_path / "m.safetensors", calibrated)
    loaded = load_quantized(tmp_path / "m.safetensors", SmallCNN(jax.random.key(5)))
    np.testing.assert_array_equal(
        jax.vmap(loaded)(held_out), jax.vmap(calibrated)(held_out)
    )


def test_where_and_errors(rng):
    mlp = eqx.nn.MLP(16, 4, 32, depth=2, key=jax.random.key(1))
    x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    last = mlp.layers[-1]
    q = qnn.quantize(mlp, method="gptq", data=x, where=lambda layer: layer is not last)
    assert isinstance(q.layers[0], qnn.Linear) and q.layers[-1] is last
    with pytest.raises(ValueError, match="method must be one of"):
        qnn.quantize(mlp, method="awq-ish", data=x)
    with pytest.raises(ValueError, match="needs data"):
        qnn.quantize(mlp, method="gptq")
    with pytest.raises(ValueError, match="trainable=False"):
        qnn.quantize(mlp, method="gptq", data=x, trainable=True)


def test_evaluate_plan_and_apply_plan_with_gptq(rng):
    """method="gptq" in evaluate and plan: a smaller whole-model error than
    RTN's at the same precision, a plan never larger in bytes at the same
    budget, and apply_plan builds the model the plan measured."""
    mlp = eqx.nn.MLP(32, 4, 64, depth=3, key=jax.random.key(0))
    x = jnp.asarray(rng.standard_normal((256, 32)), jnp.float32)
    errors = {
        m: qnn.evaluate(mlp, x, precision="int4", group_size=16, method=m)
        for m in ("rtn", "gptq")
    }
    assert errors["gptq"]["method"] == "gptq"
    rtn_error = errors["rtn"]["model"]["output_rel_l2"]
    assert errors["gptq"]["model"]["output_rel_l2"] < rtn_error
    plans = {
        m: qnn.plan(mlp, x, 0.02, group_size=16, method=m) for m in ("rtn", "gptq")
    }
    assert plans["gptq"]["bytes"] <= plans["rtn"]["bytes"]
    applied = qnn.apply_plan(mlp, plans["gptq"], data=x)
    y, want = jax.vmap(applied)(x), jax.vmap(mlp)(x)
    error = float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want))
    assert error == pytest.approx(plans["gptq"]["model"]["output_rel_l2"], rel=1e-3)
    with pytest.raises(ValueError, match="needs data"):
        qnn.apply_plan(mlp, plans["gptq"])
