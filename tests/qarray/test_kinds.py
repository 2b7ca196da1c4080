"""qarray.nn's table of layer kinds: quantize, evaluate and plan agree on
what each layer becomes (one int4-fit rule), and every float layer kind
quantize names is in it."""

import equinox as eqx
import jax
import numpy as np

import qarray.nn as qnn


class TwoWidths(eqx.Module):
    """A layer whose input width a group of 16 divides, and one it does not."""

    fits: eqx.nn.Linear
    odd: eqx.nn.Linear
    cell: eqx.nn.GRUCell

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.fits = eqx.nn.Linear(32, 24, key=k[0])
        self.odd = eqx.nn.Linear(24, 8, key=k[1])
        # input matrix (3 * 8, 32) packs, hidden (3 * 8, 8) does not: one
        # precision for the cell, int8
        self.cell = eqx.nn.GRUCell(32, 8, key=k[2])

    def __call__(self, x):
        return self.odd(jax.nn.relu(self.fits(x))) + self.cell(x, x[:8])


def test_quantize_and_the_accuracy_report_share_the_int4_rule(rng):
    model = TwoWidths(jax.random.key(0))
    quantized = qnn.quantize(model, precision="int4", group_size=16)
    stored = [
        quantized.fits.precision,
        quantized.odd.precision,
        quantized.cell.weight_ih.precision,
        quantized.cell.weight_hh.precision,
    ]
    assert stored == ["int4", "int8", "int8", "int8"]
    x = rng.standard_normal((6, 32)).astype(np.float32)
    report = qnn.evaluate(model, x, precision="int4", group_size=16)
    assert [layer["precision"] for layer in report["layers"]] == [
        "int4",
        "int8",
        "int8",
    ]
    # a loose budget: plan takes each layer's cheapest precision, the same
    planned = qnn.plan(model, x, 10.0, group_size=16)
    assert planned["precisions"] == ["int4", "int8", "int8"]


def test_every_float_layer_kind_is_replaced(rng):
    """Each type in FLOAT_LAYERS (what model files and the calibrators look
    for) leaves no float weight matrix after quantize."""
    key = jax.random.key(1)
    layers = {
        eqx.nn.Linear: eqx.nn.Linear(4, 4, key=key),
        eqx.nn.Conv: eqx.nn.Conv(1, 2, 4, 2, key=key),
        eqx.nn.ConvTranspose: eqx.nn.ConvTranspose(1, 2, 4, 2, key=key),
        eqx.nn.Embedding: eqx.nn.Embedding(5, 4, key=key),
        eqx.nn.GRUCell: eqx.nn.GRUCell(4, 4, key=key),
        eqx.nn.LSTMCell: eqx.nn.LSTMCell(4, 4, key=key),
        qnn.SpectralConv: qnn.SpectralConv(2, 2, (3,), key=key),
    }
    assert set(layers) == set(qnn.FLOAT_LAYERS)
    for kind, layer in layers.items():
        quantized = qnn.quantize(layer)
        matrices = [
            leaf.shape
            for leaf in jax.tree.leaves(quantized)
            if getattr(leaf, "dtype", None) == np.float32 and leaf.ndim >= 2
        ]
        assert matrices == [], (kind, matrices)  # scales and biases are 1-D
