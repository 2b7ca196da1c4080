"""The contract's ``lora`` field: LoRA adapters on the request's or the
resident network, their gradients through every endpoint and the residual
cache, and 4xx's naming the field. Against the NumPy reference network
(support/network.py), which adds (alpha / rank) (h a^T) b^T."""

import os

import equinox as eqx
import jax
import numpy as np
import pytest
from tesseract_core import Tesseract

import qarray.nn as qnn
from qarray.checkpoint import save_model
from support import accuracy
from support import network as net
from support import reference as ref
from support.compiled import vcall
from support.devices import caller_device
from support.server import ROOT

RTOL = ATOL = 2e-4


# The tests' own JAX programs, compiled once per model and shape (called
# eagerly, each equinox layer's jnp ops would compile op by op)
@eqx.filter_jit
def model_cotangents(model, x, g):
    """The cotangent of the whole model ``model`` for ``sum(g * vmap(model)(x))``
    (jax.vjp)."""
    _, pullback = jax.vjp(lambda m: jax.vmap(m)(x), model)
    (cotangents,) = pullback(g)
    return cotangents


@eqx.filter_jit
def adapter_cotangents(stored, pairs, x, g, alpha):
    """The cotangents of the adapters ``pairs`` of
    ``qnn.with_adapters(stored, pairs, alpha)`` (jax.vjp)."""
    _, pullback = jax.vjp(
        lambda p: jax.vmap(qnn.with_adapters(stored, p, alpha=alpha))(x), pairs
    )
    (cotangents,) = pullback(g)
    return cotangents


@pytest.fixture(scope="module")
def tess():
    with Tesseract.from_tesseract_api(str(ROOT / "tesseract_api.py")) as t:
        yield t


def adapter(rng, k, n, rank, alpha=None):
    out = {"a": net.normal(rng, (rank, k)) / 2, "b": net.normal(rng, (n, rank)) / 2}
    return out if alpha is None else {**out, "alpha": alpha}


def mixed_layers(rng):
    """x (.., 6) -> int8 kn w (relu) -> int4 nk w_q (tanh) -> float32 kn w."""
    first = net.make_layer(rng, 6, 8, "kn", "w", True, "relu")
    w = net.normal(rng, (8, 8))
    values, scale = ref.quantize4(w, 4)
    second = {
        "w_q": {"qvalue": ref.pack4(values), "scale": scale},
        "layout": "nk",
        "precision": "int4",
        "group_size": 4,
        "activation": "tanh",
        "bias": net.normal(rng, (8,)),
    }
    third = net.make_layer(rng, 8, 3, "kn", "w", True, "none")
    third["precision"] = "float32"
    return [first, second, third]


def declared(tree):
    """A request with every array as its declared shape and dtype
    (abstract_eval's input)."""
    if isinstance(tree, np.ndarray):
        return {"shape": list(tree.shape), "dtype": tree.dtype.name}
    if isinstance(tree, dict):
        return {k: declared(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [declared(v) for v in tree]
    return tree


def reference_paths(lora):
    return ["x"] + [
        f"lora.[{i}].{k}" for i, e in enumerate(lora) if e for k in ("a", "b")
    ]


def test_adapters_on_the_request_network(tess, rng):
    """Values and gradients w.r.t. x, a and b on int8, int4 and float32
    layers of both layouts, an adapter-less layer between."""
    layers = mixed_layers(rng)
    lora = [adapter(rng, 6, 8, 2), None, adapter(rng, 8, 3, 3, alpha=6.0)]
    x = net.normal(rng, (4, 6))
    inputs = {"x": x, "layers": layers, "lora": lora}
    want, _ = net.forward_one(x, layers, lora=lora)
    out = tess.apply(inputs)
    np.testing.assert_allclose(out["y"], want, rtol=RTOL, atol=ATOL)
    # the adapters change the output: not a test of the base alone
    base, _ = net.forward_one(x, layers)
    assert np.abs(want - base).max() > 0.1

    g = net.normal(rng, want.shape)
    paths = reference_paths(lora)
    reference = net.vjp_one(x, layers, g, lora=lora)
    got = tess.vector_jacobian_product(inputs, set(paths), {"y"}, {"y": g})
    for path in paths:
        np.testing.assert_allclose(got[path], reference[path], rtol=RTOL, atol=ATOL)
    # jvp along b of the last adapter: linear in b, so the difference of outputs
    t = net.normal(rng, lora[2]["b"].shape)
    jvp = tess.jacobian_vector_product(inputs, {"lora.[2].b"}, {"y"}, {"lora.[2].b": t})
    shifted = [*lora[:2], {**lora[2], "b": lora[2]["b"] + t}]
    moved, _ = net.forward_one(x, layers, lora=shifted)
    np.testing.assert_allclose(jvp["y"], moved - want, rtol=RTOL, atol=ATOL)
    abstract = tess.abstract_eval(declared({"x": x, "layers": layers, "lora": lora}))
    assert abstract["y"] == {"shape": (4, 3), "dtype": "float32"}
    jac = tess.jacobian(inputs, {"lora.[0].a"}, {"y"})["y"]["lora.[0].a"]
    assert jac.shape == (4, 3, 2, 6)
    np.testing.assert_allclose(
        np.tensordot(g, jac, axes=2), reference["lora.[0].a"], rtol=RTOL, atol=ATOL
    )


def test_adapters_on_an_ensemble(tess, rng):
    """Per-example weights (a batch axis on every layer, as tesseract-jax's
    vmap sends them) with one set of adapters: y and the adapters' VJP,
    example by example in NumPy (the adapters' cotangents summed)."""
    inputs = {"x": net.normal(rng, (2, 3, 4)), "layers": []}
    inputs["layers"].append(net.make_layer(rng, 4, 5, "kn", "w", True, "relu", (2,)))
    inputs["layers"].append(net.make_layer(rng, 5, 3, "nk", "w_q", True, "none", (2,)))
    lora = [adapter(rng, 4, 5, 2), adapter(rng, 5, 3, 1)]
    out = tess.apply({**inputs, "lora": lora})
    g = net.normal(rng, out["y"].shape)
    got = tess.vector_jacobian_product(
        {**inputs, "lora": lora}, {"lora.[0].a", "lora.[1].b"}, {"y"}, {"y": g}
    )
    want = {"lora.[0].a": 0.0, "lora.[1].b": 0.0}
    for b in range(2):
        x_b, layers_b = net.example(inputs, (b,))
        y_b, _ = net.forward_one(x_b, layers_b, lora=lora)
        np.testing.assert_allclose(out["y"][b], y_b, rtol=RTOL, atol=ATOL)
        cotangents = net.vjp_one(x_b, layers_b, g[b], lora=lora)
        for path in want:
            want[path] = want[path] + cotangents[path]
    for path, value in want.items():
        np.testing.assert_allclose(got[path], value, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("method", ["expand_dims", "auto_experimental"])
def test_tesseract_jax_vmap_over_x_with_adapters(tess, rng, method):
    """jax.vmap of apply_tesseract over x (tesseract-jax gives the adapters
    a size-1 batch axis): y and the adapters' gradient of sum(y * g), one
    example at a time in NumPy."""
    import jax.numpy as jnp
    from tesseract_jax import apply_tesseract

    layers = [net.make_layer(rng, 4, 5, "kn", "w", True, "tanh"),
              net.make_layer(rng, 5, 3, "nk", "w_q", True, "none")]  # fmt: skip
    lora = [adapter(rng, 4, 5, 2), None]
    x, g = net.normal(rng, (3, 2, 4)), net.normal(rng, (3, 2, 3))

    def f(lora, x):
        request = {"x": x, "layers": layers, "lora": lora}
        return apply_tesseract(tess, request, vmap_method=method)["y"]

    def mapped(lora, x):
        return jax.vmap(f, in_axes=(None, 0))(lora, x)

    # compiled (tesseract-jax calls the Tesseract from the programs' host
    # callback), not op by op
    with caller_device():  # the chip stays free for the Tesseract's programs
        y = jax.jit(mapped)(lora, x)
        grads = jax.jit(jax.grad(lambda lora, x, g: jnp.sum(mapped(lora, x) * g)))(
            lora, x, g
        )
    want = {"a": 0.0, "b": 0.0}
    for b in range(3):
        np.testing.assert_allclose(
            y[b], net.forward_one(x[b], layers, lora=lora)[0], rtol=RTOL, atol=ATOL
        )
        cotangents = net.vjp_one(x[b], layers, g[b], lora=lora)
        want = {k: want[k] + cotangents[f"lora.[0].{k}"] for k in want}
    for k, value in want.items():
        np.testing.assert_allclose(grads[0][k], value, rtol=RTOL, atol=ATOL)


def test_per_example_adapters(tess, rng):
    """Adapters with a batch axis (one pair per example of x's first axis):
    y[b] and the adapters' cotangents [b] from example b alone."""
    layers = [net.make_layer(rng, 4, 5, "kn", "w", True, "relu"),
              net.make_layer(rng, 5, 3, "nk", "w_q", True, "none")]  # fmt: skip
    per = [adapter(rng, 4, 5, 2) for _ in range(2)]
    lora = [{k: np.stack([p[k] for p in per]) for k in ("a", "b")}, None]
    x, g = net.normal(rng, (2, 3, 4)), net.normal(rng, (2, 3, 3))
    inputs = {"x": x, "layers": layers, "lora": lora}
    y = tess.apply(inputs)["y"]
    got = tess.vector_jacobian_product(
        inputs, {"lora.[0].a", "lora.[0].b"}, {"y"}, {"y": g}
    )
    for b in range(2):
        one = [per[b], None]
        np.testing.assert_allclose(
            y[b], net.forward_one(x[b], layers, lora=one)[0], rtol=RTOL, atol=ATOL
        )
        want = net.vjp_one(x[b], layers, g[b], lora=one)
        for k in ("a", "b"):
            np.testing.assert_allclose(
                got[f"lora.[0].{k}"][b], want[f"lora.[0].{k}"], rtol=RTOL, atol=ATOL
            )


def test_int8_activations_with_adapters(tess, rng):
    inputs = net.three_layer(rng, "nk", quantize_activations=True)
    lora = [adapter(rng, 6, 5, 1), adapter(rng, 5, 4, 2), None]
    want, _ = net.forward_one(inputs["x"], inputs["layers"], True, lora)
    out = tess.apply({**inputs, "lora": lora})
    np.testing.assert_allclose(out["y"], want, rtol=RTOL, atol=ATOL)


def test_the_residual_cache_serves_adapter_gradients(rng, monkeypatch):
    import sys

    from tesseract_core.runtime import jax_recipes

    monkeypatch.syspath_prepend(str(ROOT))
    import tesseract_api

    assert sys.modules["tesseract_api"] is tesseract_api
    monkeypatch.setattr(tesseract_api.RUNTIME.cache, "min_intensity", 0)
    monkeypatch.setattr(tesseract_api.RUNTIME.cache, "min_flops", 0)
    layers = mixed_layers(rng)
    lora = [adapter(rng, 6, 8, 2), adapter(rng, 8, 8, 4), None]
    inputs = {"x": net.normal(rng, (5, 6)), "layers": layers, "lora": lora}
    model = tesseract_api.InputSchema.model_validate(inputs)
    tesseract_api.apply(model)

    def recompute(*args, **kwargs):
        raise AssertionError("the VJP recomputed instead of using the cache")

    monkeypatch.setattr(jax_recipes, "jax_vjp", recompute)
    g = net.normal(rng, (5, 3))
    paths = reference_paths(lora)
    got = tesseract_api.vector_jacobian_product(model, set(paths), {"y"}, {"y": g})
    want = net.vjp_one(inputs["x"], layers, g, lora=lora)
    tol = accuracy.through_tanh(RTOL)  # mixed_layers' second layer is tanh
    for path in paths:
        np.testing.assert_allclose(got[path], want[path], rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def resident(tmp_path_factory):
    """A resident model (QARRAY_MODEL) and the Tesseract in-process."""
    rng = np.random.default_rng(11)
    layers = [
        net.make_layer(rng, 6, 5, "nk", "w_q", True, "gelu"),
        net.make_layer(rng, 5, 4, "kn", "w_q", True, "none"),
    ]
    path = tmp_path_factory.mktemp("lora") / "model.safetensors"
    save_model(path, layers)
    os.environ["QARRAY_MODEL"] = str(path)
    try:
        with Tesseract.from_tesseract_api(str(ROOT / "tesseract_api.py")) as t:
            yield t, layers
    finally:
        del os.environ["QARRAY_MODEL"]


def test_a_resident_model_fine_tuned_by_its_adapters_only(resident, rng):
    """A request of x and the adapters: y and the adapters' gradients, no
    weight on the wire."""
    t, layers = resident
    lora = [adapter(rng, 6, 5, 2), adapter(rng, 5, 4, 2)]
    x = net.normal(rng, (3, 6))
    out = t.apply({"x": x, "lora": lora})
    want, _ = net.forward_one(x, layers, lora=lora)
    np.testing.assert_allclose(out["y"], want, rtol=RTOL, atol=ATOL)
    g = net.normal(rng, want.shape)
    paths = reference_paths(lora)
    got = t.vector_jacobian_product({"x": x, "lora": lora}, set(paths), {"y"},
                                    {"y": g})  # fmt: skip
    reference = net.vjp_one(x, layers, g, lora=lora)
    for path in paths:
        np.testing.assert_allclose(got[path], reference[path], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "lora, message",
    [
        ([None], "lora has 1 entries for a network of 2 layers"),
        ([{"a": np.zeros((2, 5), np.float32), "b": np.zeros((5, 2), np.float32)},
          None], r"lora.\[0\].a must be \(\.\.\., rank, 6\)"),
        ([None, {"a": np.zeros((2, 5), np.float32),
                 "b": np.zeros((4, 3), np.float32)}], r"lora.\[1\].b must be .+ 4, 2"),
        ([None, {"a": np.zeros((5, 5), np.float32),
                 "b": np.zeros((4, 5), np.float32)}], r"1 <= rank <= 4"),
        ([None, {"a": np.full((2, 5), np.nan, np.float32),
                 "b": np.zeros((4, 2), np.float32)}], r"lora.\[1\].a"),
    ],
)  # fmt: skip
def test_adapters_that_do_not_fit_are_refused(resident, lora, message):
    t, _ = resident
    with pytest.raises(Exception, match=message):
        t.apply({"x": np.zeros((2, 6), np.float32), "lora": lora})


SMALL_MODEL = """
import equinox as eqx
import jax


class Small(eqx.Module):
    conv: eqx.nn.Conv1d
    fc: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv1d(2, 4, 3, padding=1, key=k[0])
        self.fc = eqx.nn.Linear(24, 8, key=k[1])
        self.head = eqx.nn.Linear(8, 3, key=k[2])

    def __call__(self, x):
        h = jax.nn.relu(self.conv(x)).ravel()
        return self.head(jax.nn.relu(self.fc(h)))
"""

SMALL_API = """
from pathlib import Path
from typing import Annotated

import equinox as eqx
import jax
from pydantic import BaseModel, Field
from small_model import Small
from tesseract_core.runtime import Array, Differentiable, Float32

from qarray.tesseract import ModelTesseract


def forward(model, inputs):
    return {"y": jax.vmap(model)(inputs["x"])}


# the skeleton (model_file has its weights) initialised in one program
TESSERACT = ModelTesseract(
    eqx.filter_jit(Small)(jax.random.key(0)), forward,
    model_file=Path(__file__).with_name("small.safetensors"),
    lora_rank=2, lora_alpha=4.0,
)
RUNTIME = TESSERACT.runtime
Float = Differentiable[Array[..., Float32]]


class InputSchema(BaseModel):
    x: Annotated[Float, TESSERACT.limits.array("float32")] = Field(description="x")
    lora: TESSERACT.Lora = Field(default=None, description="adapters")


class OutputSchema(BaseModel):
    y: Float = Field(description="y")


def apply(inputs: InputSchema) -> OutputSchema:
    return TESSERACT.apply(inputs)


def vector_jacobian_product(inputs: InputSchema, vjp_inputs, vjp_outputs,
                            cotangent_vector):
    return TESSERACT.vector_jacobian_product(inputs, vjp_inputs, vjp_outputs,
                                             cotangent_vector)


def abstract_eval(abstract_inputs):
    return TESSERACT.abstract_eval(abstract_inputs)
"""


def _dense(layer):
    """A stored int8 layer's weights, dequantized (float64, rows per output)."""
    return ref.dequantize(np.asarray(layer.qvalue), np.asarray(layer.scale)).astype(
        np.float64
    )


def numpy_small(stored, x, lora, scale=2.0):
    """Small in float64 with its stored int8 weights and the adapters
    ``lora`` (conv, fc, head; None: none) at ``alpha / rank = scale``."""
    conv = _dense(stored.conv).reshape(4, 2, 3)
    geometry = ((1,), ((1, 1),), (1,))
    ys = []
    for xi in x.astype(np.float64):
        z = ref.conv(xi, conv, *geometry) + np.asarray(stored.conv.bias)[:, None]
        if lora[0] is not None:
            low = ref.conv(xi, np.asarray(lora[0]["a"], np.float64), *geometry)
            z = z + scale * np.asarray(lora[0]["b"], np.float64) @ low
        h = np.maximum(z, 0).ravel()
        h = np.maximum(h @ _dense(stored.fc).T + np.asarray(stored.fc.bias), 0)
        y = h @ _dense(stored.head).T + np.asarray(stored.head.bias)
        if lora[2] is not None:
            a, b = (np.asarray(lora[2][k], np.float64) for k in ("a", "b"))
            y = y + scale * (h @ a.T) @ b.T
        ys.append(y)
    return np.stack(ys)


def test_a_model_tesseract_with_lora_rank(tmp_path, rng, monkeypatch):
    """ModelTesseract(lora_rank=2): one adapter per stored layer (a conv's
    kernel-shaped), values against NumPy with and without adapters, the
    gradients w.r.t. them (linear in b: against differences of NumPy
    outputs; the others against jax.vjp of qnn.with_adapters), and 4xx's
    naming lora.[i]."""
    import importlib.util
    import sys

    from qarray.checkpoint import save_tree

    monkeypatch.delenv("QARRAY_MODEL", raising=False)  # model_file, not the env's
    (tmp_path / "small_model.py").write_text(SMALL_MODEL)
    (tmp_path / "small_api.py").write_text(SMALL_API)
    spec = importlib.util.spec_from_file_location(
        "small_model", tmp_path / "small_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["small_model"] = module
    spec.loader.exec_module(module)
    stored = qnn.quantize(eqx.filter_jit(module.Small)(jax.random.key(4)))
    save_tree(tmp_path / "small.safetensors", stored)
    x = net.normal(rng, (5, 2, 6))
    lora = [
        {"a": net.normal(rng, (2, 2, 3)), "b": net.normal(rng, (4, 2))},
        None,
        {"a": net.normal(rng, (2, 8)), "b": net.normal(rng, (3, 2))},
    ]
    with Tesseract.from_tesseract_api(str(tmp_path / "small_api.py")) as t:
        got = t.apply({"x": x, "lora": lora})["y"]
        np.testing.assert_allclose(
            got, numpy_small(stored, x, lora), rtol=RTOL, atol=ATOL
        )
        np.testing.assert_allclose(
            t.apply({"x": x})["y"],
            numpy_small(stored, x, [None] * 3),
            rtol=RTOL,
            atol=ATOL,
        )
        g = net.normal(rng, (5, 3))
        paths = {"lora.[0].a", "lora.[0].b", "lora.[2].a", "lora.[2].b"}
        grads = t.vector_jacobian_product(
            {"x": x, "lora": lora}, paths, {"y"}, {"y": g}
        )
        # y is linear in the head adapter's b: its VJP from NumPy differences
        without = [lora[0], None, {**lora[2], "b": 0 * lora[2]["b"]}]
        base = numpy_small(stored, x, without)
        want = np.zeros(lora[2]["b"].shape)
        for idx in np.ndindex(*want.shape):
            unit = np.zeros_like(lora[2]["b"])
            unit[idx] = 1.0
            moved = numpy_small(stored, x, [lora[0], None, {**lora[2], "b": unit}])
            want[idx] = np.sum(g * (moved - base))
        np.testing.assert_allclose(grads["lora.[2].b"], want, rtol=RTOL, atol=ATOL)
        adapted = qnn.with_adapters(
            stored,
            [(lora[0]["a"], lora[0]["b"]), None, (lora[2]["a"], lora[2]["b"])],
            alpha=4.0,
        )
        assert isinstance(adapted.conv, qnn.LoRA) and adapted.fc is stored.fc
        cotangents = model_cotangents(adapted, x, g)
        for path, want in (
            ("lora.[0].a", cotangents.conv.a),
            ("lora.[0].b", cotangents.conv.b),
            ("lora.[2].a", cotangents.head.a),
        ):
            np.testing.assert_allclose(grads[path], want, rtol=RTOL, atol=ATOL)
        # adapters with a size-1 leading axis (what tesseract-jax's vmap sends
        # for an unmapped input) broadcast
        expanded = [None if e is None else {k: v[None] for k, v in e.items()}
                    for e in lora]  # fmt: skip
        np.testing.assert_allclose(
            t.apply({"x": x, "lora": expanded})["y"], got, rtol=1e-6, atol=1e-6
        )
        bad = {"a": np.zeros((2, 7), np.float32), "b": np.zeros((3, 2), np.float32)}
        with pytest.raises(Exception, match=r"lora.\[2\].a must be \(2, 8\)"):
            t.apply({"x": x, "lora": [None, None, bad]})
        with pytest.raises(Exception, match="the model has 3 adapted layers"):
            t.apply({"x": x, "lora": [None]})


EVERY_MODEL = """
import equinox as eqx
import jax
import jax.numpy as jnp

import qarray.nn as qnn


class Every(eqx.Module):
    up: eqx.nn.ConvTranspose1d
    embed: eqx.nn.Embedding
    gru: eqx.nn.GRUCell
    spectral: qnn.SpectralConv

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.up = eqx.nn.ConvTranspose1d(2, 3, 4, stride=2, padding=1, key=k[0])
        self.embed = eqx.nn.Embedding(5, 3, key=k[1])
        self.gru = eqx.nn.GRUCell(3, 3, key=k[2])
        self.spectral = qnn.SpectralConv(3, 2, 3, key=k[3])

    def __call__(self, x):
        h = self.up(x)  # (3, 16)
        state = self.gru(self.embed(2), jnp.tanh(h.mean(-1)))
        return self.spectral(h * state[:, None])
"""

EVERY_API = SMALL_API.replace("small_model import Small", "every_model import Every")
EVERY_API = EVERY_API.replace("(Small)", "(Every)").replace(
    "small.safetensors", "every.safetensors"
)


def test_a_model_tesseract_adapts_every_quantized_kind(tmp_path, rng, monkeypatch):
    """ModelTesseract(lora_rank=2) on a ConvTranspose1d, an Embedding, a
    GRUCell and a SpectralConv: the request's adapters have
    qnn.adapter_shapes' shapes (the cell two, the spectral complex), y is
    the in-process adapted model's, and the VJP w.r.t. every a and b is
    jax.vjp's of it (y is linear in each b: also against NumPy differences
    of served outputs)."""
    import importlib.util
    import sys

    from qarray.checkpoint import save_tree

    monkeypatch.delenv("QARRAY_MODEL", raising=False)
    (tmp_path / "every_model.py").write_text(EVERY_MODEL)
    (tmp_path / "every_api.py").write_text(EVERY_API)
    spec = importlib.util.spec_from_file_location(
        "every_model", tmp_path / "every_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["every_model"] = module
    spec.loader.exec_module(module)
    stored = qnn.quantize(eqx.filter_jit(module.Every)(jax.random.key(5)))
    save_tree(tmp_path / "every.safetensors", stored)
    shapes = qnn.adapter_shapes(stored, 2)
    assert shapes == [
        ((2, 2, 4), (3, 2)),  # up
        ((2, 5), (3, 2)),  # embed: a (rank, V)
        ((2, 3), (9, 2)),  # gru.weight_ih
        ((2, 3), (9, 2)),  # gru.weight_hh
        ((2, 3, 3, 2), (2, 2, 2)),  # spectral: complex parts last
    ]
    lora = [{"a": net.normal(rng, a) / 2, "b": net.normal(rng, b) / 2}
            for a, b in shapes]  # fmt: skip
    pairs = [(e["a"], e["b"]) for e in lora]
    adapted = qnn.with_adapters(stored, pairs, alpha=4.0)
    x = net.normal(rng, (3, 2, 8))
    want = np.asarray(vcall(adapted, x))
    base = np.asarray(vcall(stored, x))
    assert np.abs(want - base).max() > 0.1 * np.abs(base).max()
    g = net.normal(rng, want.shape)
    cotangents = adapter_cotangents(stored, pairs, x, g, 4.0)
    with Tesseract.from_tesseract_api(str(tmp_path / "every_api.py")) as t:
        got = t.apply({"x": x, "lora": lora})["y"]
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(t.apply({"x": x})["y"], base, rtol=RTOL, atol=ATOL)
        paths = {f"lora.[{i}].{k}" for i in range(len(lora)) for k in "ab"}
        grads = t.vector_jacobian_product(
            {"x": x, "lora": lora}, paths, {"y"}, {"y": g}
        )
        for i, pair in enumerate(cotangents):
            for name, value in zip("ab", pair, strict=True):
                assert np.abs(value).max() > 0
                np.testing.assert_allclose(
                    grads[f"lora.[{i}].{name}"], value, rtol=RTOL, atol=ATOL
                )
        # the spectral adapter's b: y is linear in it, so each entry's
        # cotangent is sum(g * (y(b = unit) - y(b = 0))) of served outputs
        zero = [*lora[:4], {**lora[4], "b": 0 * lora[4]["b"]}]
        at_zero = t.apply({"x": x, "lora": zero})["y"]
        for idx in [(0, 0, 0), (1, 1, 1), (0, 1, 1)]:
            unit = np.zeros_like(lora[4]["b"])
            unit[idx] = 1.0
            moved = t.apply({"x": x, "lora": [*lora[:4], {**lora[4], "b": unit}]})
            np.testing.assert_allclose(
                grads["lora.[4].b"][idx], np.sum(g * (moved["y"] - at_zero)),
                rtol=1e-3, atol=1e-4,
            )  # fmt: skip
        with pytest.raises(Exception, match=r"lora.\[4\].b must be \(2, 2, 2\)"):
            t.apply(
                {"x": x, "lora": [*lora[:4], {**lora[4], "b": lora[4]["b"][..., 0]}]}
            )
