"""qarray.tesseract.Network, the contract's network as a module, against
NumPy: batch axes, its errors, its model file, and its equinox form for the
calibrators (``to_equinox`` / ``from_equinox``).

Covers: qarray/network/__init__.py, qarray/network/_network.py,
qarray/network/_shapes.py"""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

import qarray.nn as qnn
from qarray.checkpoint import load_network, save_network
from qarray.tesseract import Network
from support import reference as ref


def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def network_layers(rng):
    return [
        qnn.Linear.from_float(normal(rng, 6, 5), normal(rng, 5), layout="kn"),
        qnn.Linear(jnp.asarray(normal(rng, 4, 5)), layout="nk"),
    ]


def test_network_matches_numpy_with_batch_axes(rng):
    """Per-example weights on a leading axis: y[b] = net(x[b], params[b])."""
    layers = network_layers(rng)
    x = normal(rng, 3, 2, 6)
    batched_w = normal(rng, 3, 4, 5)  # layer 1's weights, one per example
    layers[1] = qnn.Linear(jnp.asarray(batched_w), layout="nk")
    net = Network(layers, ["relu", "none"])
    y, per_layer = net.run(x, return_w_q=True)
    w0 = np.asarray(layers[0].qvalue, np.float64) * np.asarray(layers[0].scale)[:, None]
    for b in range(3):
        h = np.maximum(x[b] @ w0 + np.asarray(layers[0].bias), 0)
        want = h @ ref.roundtrip(batched_w[b]).astype(np.float64).T
        np.testing.assert_allclose(y[b], want, rtol=1e-4, atol=1e-5)
    assert per_layer[0]["w_q"] is None  # a stored layer
    assert per_layer[1]["weight_error"].shape == (3,)
    np.testing.assert_array_equal(
        per_layer[1]["w_q"]["qvalue"], ref.quantize(batched_w)[0]
    )


def test_network_refuses_widths_that_do_not_chain(rng):
    a = qnn.Linear(jnp.asarray(normal(rng, 6, 5)), layout="kn")
    b = qnn.Linear(jnp.asarray(normal(rng, 4, 6)), layout="nk")
    with pytest.raises(TypeError, match=r"layers.\[0\] gives 5 features"):
        Network([a, b])
    with pytest.raises(ValueError, match="activations in"):
        Network([a], ["swish"])
    with pytest.raises(TypeError, match="K = 6"):
        Network([a]).run(normal(rng, 2, 5))


def test_network_model_file_round_trip(rng, tmp_path):
    net = Network(network_layers(rng), ["gelu", "none"])
    path = tmp_path / "model.safetensors"
    save_network(path, net)
    loaded = load_network(path)
    assert loaded.activation == ("gelu", "none")
    assert [layer.layout for layer in loaded.layers] == ["kn", "nk"]
    assert all(not layer.trainable for layer in loaded.layers)
    x = normal(rng, 4, 6)
    np.testing.assert_allclose(loaded(x), net(x), rtol=1e-5, atol=1e-6)


def test_to_equinox_and_back(rng):
    """A float32 network as eqx.nn.Linear layers computes the same function
    on one example (either layout); quantized there and turned back, each
    layer is what its "nk" weights round to (NumPy)."""
    w0, b0, w1 = normal(rng, 6, 5), normal(rng, 5), normal(rng, 4, 5)
    net = Network(
        [
            qnn.Linear(
                jnp.asarray(w0), jnp.asarray(b0), layout="kn", precision="float32"
            ),
            qnn.Linear(jnp.asarray(w1), layout="nk", precision="float32"),
        ],
        ["tanh", "none"],
    )
    stack = net.to_equinox()
    assert all(isinstance(layer, eqx.nn.Linear) for layer in stack.layers)
    x = normal(rng, 6)
    want = np.tanh(x.astype(np.float64) @ w0 + b0) @ w1.T.astype(np.float64)
    np.testing.assert_allclose(stack(x), want, rtol=1e-5, atol=1e-5)
    back = Network.from_equinox(qnn.quantize(stack))
    assert [layer.layout for layer in back.layers] == ["nk", "nk"]
    q0, q1 = ref.roundtrip(w0.T).astype(np.float64), ref.roundtrip(w1)
    want = np.tanh(x @ q0.T + b0) @ q1.T.astype(np.float64)
    np.testing.assert_allclose(back(x), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"layers.\[0\] must be float32"):
        back.to_equinox()  # stored int8: nothing float to calibrate
