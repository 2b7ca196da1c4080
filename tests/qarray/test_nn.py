"""qarray.nn: quantized equinox modules against NumPy references.

Values and gradients of Linear in both layouts, stored and trainable; any
equinox MLP quantized by qarray.nn.quantize; quantization-aware training with
optax and the int8 export.

Covers: qarray/nn/__init__.py, qarray/nn/_linear.py, qarray/nn/_quantize.py,
qarray/nn/_weights.py
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qarray as qa
import qarray.nn as qnn
from support import reference as ref
from support.compiled import call, filter_vcall, vcall

# rerun on XLA's formulations alone where the kernels ran (make test)
pytestmark = pytest.mark.formulations

RTOL, ATOL = 2e-5, 2e-5


# Models are called through support.compiled (one XLA program per model
# structure and shape) rather than eagerly, op by op. Eager calls stay where
# they are the point: test_linear_values_match_numpy and
# test_linear_int8_activations_match_numpy (Linear),
# test_a_module_under_jit_carries_no_qarray (its jaxpr).


def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def dense(layer_w, layout):
    """The (K, N) float64 matrix a layer multiplies by (dequantized)."""
    w = ref.roundtrip(layer_w).astype(np.float64)
    return w if layout == "kn" else w.T


@pytest.fixture(params=["kn", "nk"])
def layout(request):
    return request.param


@pytest.mark.parametrize("trainable", [False, True])
def test_linear_values_match_numpy(rng, layout, trainable):
    k, n = 6, 5
    w = normal(rng, *((k, n) if layout == "kn" else (n, k)))
    bias = normal(rng, n)
    x = normal(rng, 3, 2, k)  # any leading axes
    layer = qnn.Linear.from_float(w, bias, layout=layout, trainable=trainable)
    assert layer.trainable == trainable
    assert (layer.in_features, layer.out_features) == (k, n)
    want = x.astype(np.float64) @ dense(w, layout) + bias
    np.testing.assert_allclose(layer(x), want, rtol=RTOL, atol=ATOL)  # eager
    jitted = jax.jit(lambda m, x: m(x))(layer, x)  # the module as an argument
    np.testing.assert_allclose(jitted, want, rtol=RTOL, atol=ATOL)
    # the recorded (stored) or computed (trainable) relative weight error
    err = np.linalg.norm(w - ref.roundtrip(w)) / np.linalg.norm(w)
    np.testing.assert_allclose(float(layer.weight_error()), err, rtol=1e-5)


def test_linear_int8_activations_match_numpy(rng, layout):
    k, n = 8, 4
    w = normal(rng, *((k, n) if layout == "kn" else (n, k)))
    x = normal(rng, 5, k)
    layer = qnn.Linear.from_float(w, layout=layout, activations="int8")
    q, s = ref.quantize(w)
    product = ref.matmul_q if layout == "kn" else ref.linear_q
    want = product(x, q, s, "int8")
    np.testing.assert_allclose(layer(x), want, rtol=1e-5, atol=1e-5)
    # int8 activations differ from weight-only by more than the tolerance
    assert np.abs(np.asarray(layer(x)) - x @ dense(w, layout)).max() > 1e-4


def test_trainable_gradients_are_straight_through(rng, layout):
    """d/dw of sum(g * layer(x)) is the dense product's; x's and bias's use
    the quantized weights."""
    k, n = 6, 5
    w = normal(rng, *((k, n) if layout == "kn" else (n, k)))
    bias, x, g = normal(rng, n), normal(rng, 4, k), normal(rng, 4, n)
    layer = qnn.Linear(w, bias, layout=layout)

    def loss(layer, x, g):
        return jnp.sum(g * layer(x))

    grads, gx = eqx.filter_jit(jax.grad(loss, argnums=(0, 1)))(layer, x, g)
    gx_want, gw_kn = ref.dense_vjp(x, dense(w, layout), g)
    gw_want = gw_kn if layout == "kn" else gw_kn.T
    np.testing.assert_allclose(grads.weight, gw_want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(gx, gx_want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grads.bias, g.sum(0), rtol=RTOL, atol=ATOL)


def test_stored_gradient_with_respect_to_the_scales_is_exact(rng, layout):
    k, n = 6, 5
    w = normal(rng, *((k, n) if layout == "kn" else (n, k)))
    x, g = normal(rng, 4, k), normal(rng, 4, n)
    layer = qnn.Linear.from_float(w, layout=layout)
    q = np.asarray(layer.qvalue, np.float64)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, x, g: jnp.sum(g * m(x))))(
        layer, x, g
    )
    assert grads.qvalue is None  # int8 carries no gradient
    if layout == "nk":  # y[m, n] = s[n] * (x @ q.T)[m, n]
        want = np.sum(g * (x @ q.T), axis=0)
    else:  # y = x @ (q * s[:, None]):  dL/ds[k] = sum_n (x.T g)[k, n] q[k, n]
        want = np.sum((x.T.astype(np.float64) @ g) * q, axis=1)
    np.testing.assert_allclose(grads.scale, want, rtol=1e-4, atol=1e-4)


def test_a_module_under_jit_carries_no_qarray(rng):
    """Parts are the leaves: the jitted function's inputs are plain arrays
    (a QArray argument takes JAX's slow Python dispatch path for hi types)."""
    layer = qnn.Linear.from_float(normal(rng, 5, 6))
    jaxpr = jax.make_jaxpr(lambda m, x: m(x))(layer, normal(rng, 2, 6))
    assert not any(isinstance(a, qa.QArrayTy) for a in jaxpr.in_avals)
    assert {str(a.dtype) for a in jaxpr.in_avals} == {"int8", "float32"}


def test_linear_under_vmap_and_grad_of_vmap(rng):
    layer = qnn.Linear.from_float(normal(rng, 5, 6), normal(rng, 5), trainable=True)
    xs = normal(rng, 7, 6)
    np.testing.assert_allclose(vcall(layer, xs), call(layer, xs), rtol=RTOL, atol=ATOL)
    grads = eqx.filter_jit(jax.grad(lambda m, xs: jnp.sum(jax.vmap(m)(xs) ** 2)))(
        layer, xs
    )
    want = eqx.filter_jit(jax.grad(lambda m, xs: jnp.sum(m(xs) ** 2)))(layer, xs)
    np.testing.assert_allclose(grads.weight, want.weight, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"weight": np.ones((2, 3))},
            TypeError,
            "weight to be a float32, bfloat16 or float16 array, got float64",
        ),
        ({"weight": np.ones(3, np.float32)}, TypeError, "weight of rank >= 2"),
        (
            {"qvalue": np.ones((2, 3), np.int8), "scale": np.ones(3, np.float32)},
            TypeError,
            "scale.shape == qvalue.shape",
        ),
        ({"qvalue": np.ones((2, 3), np.int8)}, TypeError, "qvalue and scale"),
        ({}, TypeError, "got neither"),
        (
            {"weight": np.ones((2, 3), np.float32), "layout": "mk"},
            ValueError,
            "layout in",
        ),
        (
            {"weight": np.ones((2, 3), np.float32), "activations": "int4"},
            ValueError,
            "activations in",
        ),
        (
            {"weight": np.ones((2, 3), np.float32), "bias": np.ones(3, np.float32)},
            TypeError,
            r"bias of shape \(\.\.\., 2\)",
        ),
    ],
)
def test_linear_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        qnn.Linear(**kwargs)


# --- quantize(model) on equinox models


def mlp(key=0, depth=2):
    return eqx.nn.MLP(8, 3, 16, depth=depth, key=jax.random.key(key))


def numpy_mlp(model, x, quantized):
    """The MLP's forward pass in float64: relu between layers, with each
    layer's weights dequantized where ``quantized(i)``."""
    h = np.asarray(x, np.float64)
    layers = model.layers
    for i, layer in enumerate(layers):
        w = np.asarray(layer.weight)
        w = ref.roundtrip(w) if quantized(i) else w
        h = h @ w.astype(np.float64).T + np.asarray(layer.bias)
        if i < len(layers) - 1:
            h = np.maximum(h, 0)
    return h


def test_quantized_mlp_matches_numpy_and_stays_near_the_float_model(rng):
    model = mlp()
    quantized = qnn.quantize(model)
    assert all(isinstance(layer, qnn.Linear) for layer in quantized.layers)
    assert all(layer.qvalue.dtype == jnp.int8 for layer in quantized.layers)
    xs = normal(rng, 32, 8)
    got = vcall(quantized, xs)
    want = numpy_mlp(model, xs, quantized=lambda i: True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # within the quantization bound of the float model: a few 1e-3 relative
    float_out = numpy_mlp(model, xs, quantized=lambda i: False)
    rel = np.linalg.norm(got - float_out) / np.linalg.norm(float_out)
    assert 1e-5 < rel < 2e-2, rel
    # the original model is untouched
    assert isinstance(model.layers[0], eqx.nn.Linear)


def test_where_keeps_chosen_layers_float(rng):
    model = mlp(depth=3)
    ends = (model.layers[0], model.layers[-1])
    quantized = qnn.quantize(model, where=lambda layer: layer not in ends)
    kinds = [type(layer) for layer in quantized.layers]
    assert kinds == [eqx.nn.Linear, qnn.Linear, qnn.Linear, eqx.nn.Linear]
    xs = normal(rng, 16, 8)
    want = numpy_mlp(model, xs, quantized=lambda i: i in (1, 2))
    np.testing.assert_allclose(vcall(quantized, xs), want, rtol=1e-4, atol=1e-5)


def test_quantize_stores_every_layer_with_one_program(rng, monkeypatch):
    """Round-to-nearest stored weights: the converted layers are frozen by
    one compiled program for the model (one call of ``stored_parts`` for
    layers of three shapes, as ``freeze`` does), where frozen one by one each
    shape compiled its own; a trainable layer already in the model is left
    trainable, and the values are the stored layers' own."""
    from qarray.nn import _weights

    calls = []
    real = _weights.stored_parts

    def counted(layers):
        calls.append(len(layers))
        return real(layers)

    monkeypatch.setattr(_weights, "stored_parts", counted)
    model = mlp(depth=3)
    already = qnn.quantize(model.layers[1], trainable=True)
    model = eqx.tree_at(lambda m: m.layers[1], model, already)
    calls.clear()
    quantized = qnn.quantize(model)
    assert calls == [3]
    assert eqx.tree_equal(quantized.layers[1], already)
    assert [layer.trainable for layer in quantized.layers] == [
        False,
        True,
        False,
        False,
    ]
    xs = normal(rng, 4, 8)
    want = numpy_mlp(mlp(depth=3), xs, quantized=lambda i: True)
    np.testing.assert_allclose(vcall(quantized, xs), want, rtol=1e-4, atol=1e-5)


def test_quantize_with_int8_activations(rng):
    quantized = qnn.quantize(mlp(), activations="int8")
    assert {layer.activations for layer in quantized.layers} == {"int8"}
    xs = normal(rng, 8, 8)
    weight_only = vcall(qnn.quantize(mlp()), xs)
    got = vcall(quantized, xs)
    assert not np.allclose(got, weight_only, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got, weight_only, rtol=0.05, atol=0.02)


def test_qat_trains_with_optax_and_the_int8_export_scores_the_same(rng):
    """A trainable quantized MLP fits a regression in-process; freeze gives
    stored int8 layers with the QAT model's outputs."""
    teacher = mlp(key=1)
    xs = normal(rng, 256, 8)
    ys = np.asarray(vcall(teacher, xs))
    model = qnn.quantize(mlp(key=2), trainable=True)
    optimizer = optax.adam(1e-2)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    def loss(model, xs, ys):
        return jnp.mean((jax.vmap(model)(xs) - ys) ** 2)

    @eqx.filter_jit
    def step(model, state):
        value, grads = eqx.filter_value_and_grad(loss)(model, xs, ys)
        updates, state = optimizer.update(grads, state)
        return eqx.apply_updates(model, updates), state, value

    score = eqx.filter_jit(loss)
    first = float(score(model, xs, ys))
    for _ in range(150):
        model, state, _ = step(model, state)
    last = float(score(model, xs, ys))
    assert last < 0.2 * first, (first, last)
    exported = qnn.freeze(model)
    assert all(not layer.trainable for layer in exported.layers)
    assert all(layer.qvalue.dtype == jnp.int8 for layer in exported.layers)
    np.testing.assert_allclose(
        vcall(exported, xs), vcall(model, xs), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(float(score(exported, xs, ys)), last, rtol=1e-4)


def test_scalar_layers_stay_float():
    model = eqx.nn.MLP("scalar", "scalar", 8, depth=2, key=jax.random.key(0))
    quantized = qnn.quantize(model)
    kinds = [type(layer) for layer in quantized.layers]
    assert kinds == [eqx.nn.Linear, qnn.Linear, eqx.nn.Linear]
    x = np.float32(1.5)
    np.testing.assert_allclose(call(quantized, x), call(model, x), rtol=0.05, atol=1e-3)


@pytest.mark.cpu_breadth("an import graph: the same on every platform")
def test_the_library_imports_no_server():
    """``import qarray`` (and qarray.nn) pulls in neither tesseract-core nor
    the HTTP stack: the library stays a library."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, qarray, qarray.nn\n"
        "found = [m for m in ('tesseract_core', 'fastapi', 'uvicorn', "
        "'qarray.tesseract') if m in sys.modules]\n"
        "sys.exit(', '.join(found) or None)"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


# --- equinox's calling conventions: every layer takes key= (issue 27)


@pytest.mark.parametrize("trainable", [False, True])
def test_a_sequential_runs_quantized_with_a_key(rng, trainable):
    """eqx.nn.Sequential passes key= to every layer; the quantized model is the
    NumPy network of the dequantized weights."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    seq = eqx.nn.Sequential(
        [
            eqx.nn.Linear(8, 16, key=k1),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Linear(16, 4, key=k2),
        ]
    )
    quantized = qnn.quantize(seq, trainable=trainable)
    x = normal(rng, 3, 8)
    got = eqx.filter_jit(lambda m, x, k: jax.vmap(lambda x: m(x, key=k))(x))(
        quantized, x, k3
    )
    first, last = seq.layers[0], seq.layers[2]
    h = x @ dense(np.asarray(first.weight), "nk") + np.asarray(first.bias)
    want = np.maximum(h, 0) @ dense(np.asarray(last.weight), "nk") + np.asarray(
        last.bias
    )
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_sequential_of_convolutions_and_a_stateful_one_take_a_key(rng):
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    convs = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(3, 8, 3, key=k1),
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.Conv2d(8, 4, 3, key=k2),
        ]
    )
    x = normal(rng, 3, 12, 12)
    got, want = call(qnn.quantize(convs), x, key=k3), call(convs, x)
    assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want)
    model, state = eqx.nn.make_with_state(eqx.nn.Sequential)(
        [
            eqx.nn.Linear(8, 16, key=k1),
            eqx.nn.BatchNorm(16, "batch", mode="batch"),
            eqx.nn.Linear(16, 4, key=k2),
        ]
    )
    batch = jax.vmap(
        lambda m, x, s: m(x, s, key=k3),
        axis_name="batch",
        in_axes=(None, 0, None),
        out_axes=(0, None),
    )
    xs = normal(rng, 5, 8)
    batch = eqx.filter_jit(batch)
    (got, _), (want, _) = batch(qnn.quantize(model), xs, state), batch(model, xs, state)
    assert np.linalg.norm(got - want) <= 5e-2 * np.linalg.norm(want)


def test_equinox_tools_work_on_a_quantized_model(rng, tmp_path):
    """filter_vmap, tree_serialise_leaves / tree_deserialise_leaves,
    filter_grad and partition, as on the float model."""
    k1, k2 = jax.random.split(jax.random.key(2))
    mlp = eqx.nn.MLP(6, 3, 8, 2, key=k1)
    stored, trainable = qnn.quantize(mlp), qnn.quantize(mlp, trainable=True)
    x = normal(rng, 4, 6)
    y = filter_vcall(stored, x)
    np.testing.assert_allclose(y, vcall(stored, x), rtol=1e-6, atol=1e-6)
    path = tmp_path / "model.eqx"
    eqx.tree_serialise_leaves(path, stored)
    like = qnn.quantize(eqx.nn.MLP(6, 3, 8, 2, key=k2))  # other weights, same tree
    loaded = eqx.tree_deserialise_leaves(path, like)
    np.testing.assert_array_equal(filter_vcall(loaded, x), y)

    @eqx.filter_jit
    @eqx.filter_grad
    def grad(model, x):
        return jnp.sum(eqx.filter_vmap(model)(x) ** 2)

    grads = grad(trainable, x)
    float_grads = grad(mlp, x)
    for got, want in zip(
        jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array)),
        jax.tree.leaves(eqx.filter(float_grads, eqx.is_inexact_array)),
        strict=True,
    ):  # straight-through: the float model's gradients, up to quantization
        assert got.shape == want.shape
        assert np.linalg.norm(got - want) <= 0.1 * np.linalg.norm(want) + 1e-6
    params, static = eqx.partition(trainable, eqx.is_inexact_array)
    np.testing.assert_array_equal(
        filter_vcall(eqx.combine(params, static), x), filter_vcall(trainable, x)
    )
