"""qarray.nn.Conv and quantize() on equinox CNNs, against NumPy references."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray.nn as qnn
from support import reference as ref

RTOL, ATOL = 1e-4, 1e-4


def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


class SmallCNN(eqx.Module):
    """Two 2-D convolutions, a BatchNorm-free residual, a dense head."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(2, 4, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(4, 4, 3, padding="SAME", groups=2, key=k2)
        self.head = eqx.nn.Linear(4 * 6 * 6, 3, key=k3)

    def __call__(self, x):
        h = jax.nn.relu(self.conv1(x))
        h = h + self.conv2(h)
        return self.head(h.ravel())


def reference_cnn(model, x, quantized=True, roundtrip=None):
    """The float64 forward of SmallCNN with (optionally) quantized weights:
    ``roundtrip(w (out, K))`` per layer (default: int8 per row)."""
    roundtrip = roundtrip or (lambda layer, w: ref.roundtrip(w))

    def w(conv):
        a = np.asarray(conv.weight)
        if not quantized:
            return a
        return roundtrip(conv, a.reshape(a.shape[0], -1)).reshape(a.shape)

    def conv(layer, h, groups=1):
        y = ref.conv(h, w(layer), (1, 1), ((1, 1), (1, 1)), (1, 1), groups)
        return y + np.asarray(layer.bias)

    h = np.maximum(conv(model.conv1, x), 0)
    h = h + conv(model.conv2, h, groups=2)
    hw = np.asarray(model.head.weight)
    hw = roundtrip(model.head, hw) if quantized else hw
    return hw.astype(np.float64) @ h.ravel() + np.asarray(model.head.bias)


@pytest.mark.parametrize("trainable", [False, True])
def test_quantized_cnn_matches_numpy(rng, trainable):
    model = SmallCNN(jax.random.key(0))
    q = qnn.quantize(model, trainable=trainable)
    assert isinstance(q.conv1, qnn.Conv) and isinstance(q.conv2, qnn.Conv)
    assert isinstance(q.head, qnn.Linear)
    assert q.conv1.trainable == trainable
    x = normal(rng, 2, 6, 6)
    want = reference_cnn(model, x)
    np.testing.assert_allclose(eqx.filter_jit(q)(x), want, rtol=RTOL, atol=ATOL)
    # a batch through vmap, as equinox models take one
    xs = normal(rng, 3, 2, 6, 6)
    got = jax.vmap(q)(xs)
    for xi, yi in zip(xs, got, strict=True):
        np.testing.assert_allclose(yi, reference_cnn(model, xi), rtol=RTOL, atol=ATOL)
    # and the quantized model stays near the float one
    np.testing.assert_allclose(want, reference_cnn(model, x, False), rtol=0.1, atol=0.1)


def test_trainable_conv_gradients_are_straight_through(rng):
    w, bias = normal(rng, 3, 2, 3, 3), normal(rng, 3)
    x = normal(rng, 2, 5, 5)
    layer = qnn.Conv.from_float(w, bias, trainable=True, padding=1, stride=2)

    def loss(layer, x):
        return jnp.sum(jnp.sin(layer(x)))

    grads = eqx.filter_grad(loss)(layer, x)
    gx = jax.grad(loss, 1)(layer, x)
    dense = ref.roundtrip(w.reshape(3, -1)).reshape(w.shape)
    geometry = ((2, 2), ((1, 1), (1, 1)), (1, 1), 1)
    y = ref.conv(x, dense, *geometry) + bias[:, None, None]
    want_gx, want_gw = ref.conv_vjp(x, dense, np.cos(y), *geometry)
    np.testing.assert_allclose(grads.weight, want_gw, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        grads.bias, np.cos(y).sum(axis=(1, 2)), rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)


def test_freeze_keeps_outputs_and_stores_int8(rng):
    model = qnn.quantize(SmallCNN(jax.random.key(1)), trainable=True)
    frozen = qnn.freeze(model)
    assert frozen.conv1.qvalue.dtype == jnp.int8 and frozen.conv1.weight is None
    assert frozen.conv1.qvalue.shape == (4, 2 * 9)
    x = normal(rng, 2, 6, 6)
    np.testing.assert_allclose(frozen(x), model(x), rtol=1e-6, atol=1e-6)
    w = np.asarray(model.conv1.weight).reshape(4, -1)
    err = np.linalg.norm(w - ref.roundtrip(w)) / np.linalg.norm(w)
    np.testing.assert_allclose(float(frozen.conv1.weight_error()), err, rtol=1e-5)


@pytest.mark.parametrize("trainable", [False, True])
def test_int4_cnn_matches_numpy(rng, trainable):
    """Every layer int4 where the group size divides its input width (K = 18
    for both convolutions, 144 for the head), int8 where it does not."""
    model = SmallCNN(jax.random.key(2))
    x = normal(rng, 2, 6, 6)
    q = qnn.quantize(model, precision="int4", group_size=6, trainable=trainable)
    assert [q.conv1.precision, q.conv2.precision, q.head.precision] == ["int4"] * 3
    if not trainable:
        assert q.conv1.qvalue.dtype == jnp.uint8 and q.conv1.qvalue.shape == (4, 9)
        assert q.conv1.scale.shape == (4, 3)
    want = reference_cnn(model, x, roundtrip=lambda _, w: ref.roundtrip4(w, 6))
    np.testing.assert_allclose(eqx.filter_jit(q)(x), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(qnn.freeze(q)(x), want, rtol=RTOL, atol=ATOL)

    mixed = qnn.quantize(model, precision="int4", group_size=16)
    assert [mixed.conv1.precision, mixed.head.precision] == ["int8", "int4"]

    def per_layer(layer, w):
        return ref.roundtrip4(w, 16) if layer is model.head else ref.roundtrip(w)

    want = reference_cnn(model, x, roundtrip=per_layer)
    np.testing.assert_allclose(mixed(x), want, rtol=RTOL, atol=ATOL)
    # the recorded weight error is the grouped one's
    w = np.asarray(model.conv1.weight).reshape(4, -1)
    err = np.linalg.norm(w - ref.roundtrip4(w, 6)) / np.linalg.norm(w)
    frozen = qnn.freeze(qnn.quantize(model, precision="int4", group_size=6))
    assert frozen.conv1.stored_error == pytest.approx(err, rel=1e-5)


def test_where_and_padding_modes_keep_layers_float(rng):
    model = SmallCNN(jax.random.key(2))
    q = qnn.quantize(model, where=lambda layer: layer is not model.conv1)
    assert isinstance(q.conv1, eqx.nn.Conv2d) and isinstance(q.conv2, qnn.Conv)
    reflect = eqx.nn.Conv1d(
        2, 2, 3, padding=1, padding_mode="REFLECT", key=jax.random.key(3)
    )
    assert qnn.quantize(reflect) is reflect or isinstance(
        qnn.quantize(reflect), eqx.nn.Conv1d
    )
    with pytest.raises(ValueError, match="zero padding"):
        qnn.Conv.from_eqx(reflect)


@pytest.mark.parametrize("dims", [1, 3])
def test_conv1d_and_conv3d_with_int8_activations(rng, dims):
    cls = {1: eqx.nn.Conv1d, 3: eqx.nn.Conv3d}[dims]
    conv = cls(3, 4, 2, stride=1, dilation=1, key=jax.random.key(4))
    q = qnn.quantize(conv, activations="int8")
    x = normal(rng, 3, *(5,) * dims)
    w = np.asarray(conv.weight)
    geometry = ((1,) * dims, ((0, 0),) * dims, (1,) * dims, 1)
    want = ref.conv_q(
        x, *ref.quantize(w.reshape(4, -1)), (2,) * dims, *geometry, "int8"
    )
    want = want + np.asarray(conv.bias)
    np.testing.assert_allclose(q(x), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({}, TypeError, "either weight"),
        ({"weight": np.zeros((2, 3), np.float32)}, TypeError, "rank >= 3"),
        ({"weight": np.zeros((2,) * 6, np.float32)}, TypeError, "1 to 3 spatial"),
        (
            {"weight": np.zeros((2, 3, 3), np.int8)},
            TypeError,
            "float32, bfloat16 or float16 array",
        ),
        (
            {"qvalue": np.zeros((2, 9), np.int8), "scale": np.zeros(2, np.float32)},
            TypeError,
            "together",
        ),
        (
            {
                "qvalue": np.zeros((2, 10), np.int8),
                "scale": np.zeros(2, np.float32),
                "kernel_size": (3, 3),
            },
            TypeError,
            "whole number",
        ),
        (
            {
                "weight": np.zeros((2, 3, 3), np.float32),
                "bias": np.zeros(3, np.float32),
            },
            TypeError,
            r"bias of shape \(2,\)",
        ),
        (
            {"weight": np.zeros((2, 3, 3), np.float32), "activations": "int4"},
            ValueError,
            "activations in",
        ),
        (
            {"weight": np.zeros((2, 3, 3), np.float32), "precision": "float32"},
            ValueError,
            "is eqx.nn.Conv",
        ),
        (
            {
                "weight": np.zeros((2, 3, 3), np.float32),
                "precision": "int4",
                "activations": "int8",
            },
            ValueError,
            "weight-only",
        ),
        (
            {
                "weight": np.zeros((2, 3, 3), np.float32),
                "precision": "int4",
                "group_size": 4,
            },
            TypeError,
            "K = C / groups \\* prod\\(kernel_size\\) = 9",
        ),
        (
            {
                "qvalue": np.zeros((2, 9), np.uint8),
                "scale": np.zeros((2, 2), np.float32),
                "kernel_size": (3, 3),
                "precision": "int4",
                "group_size": 6,
            },
            TypeError,
            r"scale \(out, K / 6\) for int4",
        ),
        (
            {
                "qvalue": np.zeros((2, 9), np.int8),
                "scale": np.zeros((2, 3), np.float32),
                "kernel_size": (3, 3),
                "precision": "int4",
                "group_size": 6,
            },
            TypeError,
            "uint8 array",
        ),
    ],
)
def test_conv_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        qnn.Conv(**kwargs)
