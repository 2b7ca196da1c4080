"""Every endpoint in-process (tesseract_core.Tesseract.from_tesseract_api)."""

import numpy as np
import pytest
from tesseract_core import Tesseract

from tests import reference as ref
from tests.tesseract.server import ROOT

RTOL = ATOL = 2e-4


@pytest.fixture(scope="module")
def tess():
    with Tesseract.from_tesseract_api(str(ROOT / "tesseract_api.py")) as t:
        yield t


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def dense_weights(inputs):
    """The W the Tesseract multiplies by, from the reference quantizer."""
    if "w" in inputs:
        return ref.roundtrip(inputs["w"])
    return ref.dequantize(inputs["w_q"]["qvalue"], inputs["w_q"]["scale"])


def reference_y(inputs):
    w = inputs.get("w")
    qvalue, scale = (
        ref.quantize(w)
        if w is not None
        else (inputs["w_q"]["qvalue"], inputs["w_q"]["scale"])
    )
    y = ref.matmul_q(inputs["x"], qvalue, scale, inputs.get("activations", "float32"))
    return y + inputs.get("bias", 0)


def reference_vjp(inputs, g):
    """Cotangents of every differentiable input for output cotangent g."""
    x, w = inputs["x"], dense_weights(inputs)
    gx, gw = ref.dense_vjp(x, w, g)
    out = {"x": gx}
    if "w" in inputs:
        out["w"] = gw  # straight-through
    else:
        out["w_q.scale"] = np.sum(gw * inputs["w_q"]["qvalue"], axis=1)
    if "bias" in inputs:
        out["bias"] = g.reshape(-1, g.shape[-1]).sum(axis=0)
    return out


def make_inputs(rng, kind, x_shape=(3, 4), n=5, bias=True, activations="float32"):
    k = x_shape[-1]
    inputs = {"x": normal(rng, x_shape), "activations": activations}
    w = normal(rng, (k, n))
    if kind == "w":
        inputs["w"] = w
    else:
        qvalue, scale = ref.quantize(w)
        inputs["w_q"] = {"qvalue": qvalue, "scale": scale}
    if bias:
        inputs["bias"] = normal(rng, (n,))
    return inputs


def diff_paths(inputs):
    return ["x", "w" if "w" in inputs else "w_q.scale"] + (
        ["bias"] if "bias" in inputs else []
    )


CONFIGS = [
    ("w", (3, 4), True, "float32"),
    ("w_q", (3, 4), True, "float32"),
    ("w", (4,), False, "float32"),
    ("w", (2, 3, 4), True, "float32"),
    ("w", (3, 4), True, "int8"),
    ("w_q", (2, 4), False, "int8"),
]


@pytest.fixture(params=CONFIGS, ids=lambda c: f"{c[0]}-x{c[1]}-bias{c[2]}-{c[3]}")
def inputs(request, rng):
    kind, x_shape, bias, activations = request.param
    return make_inputs(rng, kind, x_shape, bias=bias, activations=activations)


def test_apply(tess, inputs):
    out = tess.apply(inputs)
    np.testing.assert_allclose(out["y"], reference_y(inputs), rtol=RTOL, atol=ATOL)
    if "w" in inputs:
        qvalue, scale = ref.quantize(inputs["w"])
        np.testing.assert_array_equal(out["w_q"]["qvalue"], qvalue)
        np.testing.assert_allclose(out["w_q"]["scale"], scale, rtol=1.2e-7)
        w = inputs["w"].astype(np.float64)
        want = np.linalg.norm(w - ref.roundtrip(inputs["w"])) / np.linalg.norm(w)
        np.testing.assert_allclose(out["weight_error"], want, rtol=1e-4)
    else:
        assert out["w_q"] is None
        assert out["weight_error"] == 0


def test_quantized_weights_round_trip_through_w_q(tess, rng):
    inputs = make_inputs(rng, "w")
    first = tess.apply(inputs)
    again = tess.apply({"x": inputs["x"], "bias": inputs["bias"], "w_q": first["w_q"]})
    np.testing.assert_allclose(again["y"], first["y"], rtol=1e-6, atol=1e-6)


def test_vector_jacobian_product(tess, inputs, rng):
    g = normal(rng, reference_y(inputs).shape)
    paths = diff_paths(inputs)
    out = tess.vector_jacobian_product(inputs, paths, ["y"], {"y": g})
    want = reference_vjp(inputs, g)
    assert set(out) == set(paths)
    for path in paths:
        np.testing.assert_allclose(out[path], want[path], rtol=RTOL, atol=ATOL)


def test_jacobian_vector_product_and_jacobian_agree_with_vjp(tess, inputs, rng):
    """Dot-product test: <J u, v> = <u, J^T v>, and J matches both."""
    paths = diff_paths(inputs)
    y_shape = reference_y(inputs).shape
    tangents = {p: normal(rng, np.shape(_at(inputs, p))) for p in paths}
    v = normal(rng, y_shape)
    jvp = tess.jacobian_vector_product(inputs, paths, ["y"], tangents)["y"]
    vjp = tess.vector_jacobian_product(inputs, paths, ["y"], {"y": v})
    lhs = np.sum(jvp.astype(np.float64) * v)
    rhs = sum(np.sum(tangents[p].astype(np.float64) * vjp[p]) for p in paths)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-4, atol=1e-4)

    # float32 weights: the JVP follows the dense product, as the VJP does
    want_jvp = sum(
        np.tensordot(_jacobian_ref(inputs, p), tangents[p], axes=tangents[p].ndim)
        for p in paths
    )
    np.testing.assert_allclose(jvp, want_jvp, rtol=RTOL, atol=ATOL)

    jac = tess.jacobian(inputs, paths, ["y"])["y"]
    for p in paths:
        assert jac[p].shape == y_shape + np.shape(_at(inputs, p))
        np.testing.assert_allclose(
            jac[p], _jacobian_ref(inputs, p), rtol=RTOL, atol=ATOL
        )


def _at(inputs, path):
    value = inputs
    for part in path.split("."):
        value = value[part]
    return value


def _jacobian_ref(inputs, path):
    """Reference Jacobian of y w.r.t. ``path``, assembled from the reference VJP."""
    y_shape = reference_y(inputs).shape
    size = int(np.prod(y_shape))
    rows = []
    for i in range(size):
        g = np.zeros(size, np.float32)
        g[i] = 1
        rows.append(reference_vjp(inputs, g.reshape(y_shape))[path])
    return np.stack(rows).reshape(y_shape + np.shape(_at(inputs, path)))


def test_abstract_eval(tess):
    out = tess.abstract_eval(
        {
            "x": {"shape": [2, 7, 4], "dtype": "float32"},
            "w_q": {
                "qvalue": {"shape": [4, 5], "dtype": "int8"},
                "scale": {"shape": [4], "dtype": "float32"},
            },
        }
    )
    assert out["y"] == {"shape": (2, 7, 5), "dtype": "float32"}
    assert out["w_q"] is None
    assert out["weight_error"] == {"shape": (), "dtype": "float32"}


def test_zero_weights_give_zero_error_and_output(tess, rng):
    inputs = {"x": normal(rng, (2, 3)), "w": np.zeros((3, 4), np.float32)}
    out = tess.apply(inputs)
    np.testing.assert_array_equal(out["y"], 0)
    assert out["weight_error"] == 0
    np.testing.assert_array_equal(out["w_q"]["qvalue"], 0)


@pytest.fixture
def api_module(monkeypatch):
    """tesseract_api imported directly, caching every apply's pullback."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT))
    import tesseract_api

    monkeypatch.setattr(tesseract_api, "VJP_CACHE_MIN_INTENSITY", 0)
    assert sys.modules["tesseract_api"] is tesseract_api
    return tesseract_api


def test_vjp_after_apply_comes_from_the_cached_pullback(
    api_module, inputs, rng, monkeypatch
):
    from tesseract_core.runtime import jax_recipes

    model = api_module.InputSchema.model_validate(inputs)
    out = api_module.apply(model)
    np.testing.assert_allclose(out["y"], reference_y(inputs), rtol=RTOL, atol=ATOL)

    def recompute(*args, **kwargs):
        raise AssertionError("the VJP recomputed instead of using the cache")

    monkeypatch.setattr(jax_recipes, "_vjp_jit", recompute)
    g = normal(rng, out["y"].shape)
    paths = diff_paths(inputs)
    for _ in range(2):  # the cached pullback serves repeated VJPs
        got = api_module.vector_jacobian_product(model, set(paths), {"y"}, {"y": g})
        want = reference_vjp(inputs, g)
        for path in paths:
            np.testing.assert_allclose(got[path], want[path], rtol=RTOL, atol=ATOL)
