"""Every endpoint in-process (tesseract_core.Tesseract.from_tesseract_api),
against the NumPy reference network (support/network.py)."""

import numpy as np
import pytest
from tesseract_core import Tesseract

from support import accuracy
from support import network as net
from support import reference as ref
from support.server import ROOT

RTOL = ATOL = 2e-4


@pytest.fixture(scope="module")
def tess():
    with Tesseract.from_tesseract_api(str(ROOT / "tesseract_api.py")) as t:
        yield t


def single(rng, x_shape=(3, 4), n=5, kind="w", layout="kn", bias=True, **extra):
    """The v0.1 case: one linear layer."""
    layer = net.make_layer(rng, x_shape[-1], n, layout, kind, bias)
    return {"x": net.normal(rng, x_shape), "layers": [layer], **extra}


def _config(name, rng):
    if name == "single-w":
        return single(rng)
    if name == "single-w_q-vector":
        return single(rng, x_shape=(4,), kind="w_q", bias=False)
    if name == "single-nk-rank3":
        return single(rng, x_shape=(2, 3, 4), layout="nk")
    if name == "single-int8":
        return single(rng, quantize_activations=True)
    if name == "three-kn":
        return net.three_layer(rng, "kn")
    if name == "three-nk":
        return net.three_layer(rng, "nk", kinds=("w_q", "w", "w_q"))
    if name == "three-smooth":  # every nonlinearity, mixed layouts
        inputs = net.three_layer(rng, "kn", activations=("gelu", "sigmoid", "silu"))
        inputs["layers"][1] = net.make_layer(rng, 5, 4, "nk", "w", True, "sigmoid")
        return inputs
    if name == "three-int8":
        return net.three_layer(rng, "nk", quantize_activations=True)
    if name == "ensemble":  # per-example weights: batch axis on every array
        inputs = {"x": net.normal(rng, (2, 3, 4)), "layers": []}
        inputs["layers"].append(
            net.make_layer(rng, 4, 5, "kn", "w", True, "relu", (2,))
        )
        inputs["layers"].append(
            net.make_layer(rng, 5, 3, "nk", "w_q", True, "none", (2,))
        )
        return inputs
    if name == "broadcast":  # size-1 batch axes (tesseract-jax's expand_dims)
        inputs = {"x": net.normal(rng, (3, 2, 4)), "layers": []}
        inputs["layers"].append(
            net.make_layer(rng, 4, 5, "kn", "w", True, "tanh", (1,))
        )
        inputs["layers"].append(
            net.make_layer(rng, 5, 3, "nk", "w", False, "none", (3,))
        )
        return inputs
    raise ValueError(name)


CONFIGS = [
    "single-w",
    "single-w_q-vector",
    "single-nk-rank3",
    "single-int8",
    "three-kn",
    "three-nk",
    "three-smooth",
    "three-int8",
    "ensemble",
    "broadcast",
]


@pytest.fixture(params=CONFIGS)
def inputs(request, rng):
    return _config(request.param, rng)


def test_apply(tess, inputs):
    out = tess.apply({**inputs, "return_w_q": True})
    np.testing.assert_allclose(out["y"], net.forward(inputs), rtol=RTOL, atol=ATOL)
    batch = net.batch_shape(inputs)
    assert len(out["layers"]) == len(inputs["layers"])
    for layer, got in zip(inputs["layers"], out["layers"], strict=True):
        # every output carries the network's batch axes
        assert got["weight_error"].shape == batch
        if "w" not in layer:
            assert got["w_q"] is None
            np.testing.assert_array_equal(got["weight_error"], 0)
            continue
        qvalue, scale = ref.quantize(layer["w"])
        lead = batch + qvalue.shape[qvalue.ndim - 2 :]
        np.testing.assert_array_equal(
            got["w_q"]["qvalue"], np.broadcast_to(_pad(qvalue, batch, 2), lead)
        )
        np.testing.assert_allclose(
            got["w_q"]["scale"],
            np.broadcast_to(_pad(scale, batch, 1), lead[:-1]),
            rtol=1.2e-7,
        )
        if not batch:
            np.testing.assert_allclose(
                got["weight_error"], net.weight_error(layer["w"]), rtol=1e-4
            )


def _pad(a, batch, core):
    """``a`` with size-1 axes after its batch axes, up to len(batch) of them."""
    lead = a.ndim - core
    return a.reshape(*a.shape[:lead], *(1,) * (len(batch) - lead), *a.shape[lead:])


def test_per_layer_outputs_only_when_asked(tess, rng):
    inputs = net.three_layer(rng)
    assert tess.apply(inputs)["layers"] is None
    out = tess.apply({**inputs, "return_weight_error": True})
    assert all(layer["w_q"] is None for layer in out["layers"])
    for got, layer in zip(out["layers"], inputs["layers"], strict=True):
        want = net.weight_error(layer["w"]) if "w" in layer else 0.0
        assert float(got["weight_error"]) == pytest.approx(want, rel=1e-4, abs=1e-7)


def test_quantized_weights_round_trip_through_w_q(tess, rng):
    inputs = net.three_layer(rng, "nk", kinds=("w", "w", "w"))
    first = tess.apply({**inputs, "return_w_q": True})
    again = dict(inputs)
    again["layers"] = [
        {k: v for k, v in layer.items() if k != "w"} | {"w_q": out["w_q"]}
        for layer, out in zip(inputs["layers"], first["layers"], strict=True)
    ]
    np.testing.assert_allclose(tess.apply(again)["y"], first["y"], rtol=1e-6)


def test_vector_jacobian_product(tess, inputs, rng):
    g = net.normal(rng, net.forward(inputs).shape)
    paths = net.diff_paths(inputs)
    out = tess.vector_jacobian_product(inputs, paths, ["y"], {"y": g})
    want = net.vjp(inputs, g)
    assert set(out) == set(paths)
    tol = accuracy.for_network(inputs, RTOL)
    for path in paths:
        np.testing.assert_allclose(
            out[path], want[path], rtol=tol, atol=tol, err_msg=path
        )


def test_jacobian_vector_product_and_jacobian_agree_with_reference(tess, inputs, rng):
    """J from the reference VJP; jvp = J t; the jacobian endpoint gives J."""
    paths = net.diff_paths(inputs)
    y_shape = net.forward(inputs).shape
    tangents = {p: net.normal(rng, np.shape(net.at(inputs, p))) for p in paths}
    jvp = tess.jacobian_vector_product(inputs, paths, ["y"], tangents)["y"]
    jacobians = {p: net.jacobian(inputs, p) for p in paths}
    want = sum(
        np.tensordot(jacobians[p], tangents[p], axes=tangents[p].ndim) for p in paths
    )
    tol = accuracy.for_network(inputs, RTOL)
    np.testing.assert_allclose(jvp, want, rtol=tol, atol=tol)
    jac = tess.jacobian(inputs, paths, ["y"])["y"]
    for p in paths:
        assert jac[p].shape == y_shape + np.shape(net.at(inputs, p))
        np.testing.assert_allclose(jac[p], jacobians[p], rtol=tol, atol=tol, err_msg=p)


def test_abstract_eval(tess):
    def spec(*shape, dtype="float32"):
        return {"shape": list(shape), "dtype": dtype}

    out = tess.abstract_eval(
        {
            "x": spec(2, 7, 4),
            "layers": [
                {
                    "w_q": {"qvalue": spec(2, 4, 5, dtype="int8"), "scale": spec(2, 4)},
                    "activation": "relu",
                },
                {"w": spec(3, 5), "layout": "nk", "bias": spec(3)},
            ],
            "return_w_q": True,
        }
    )
    assert out["y"] == {"shape": (2, 7, 3), "dtype": "float32"}
    first, second = out["layers"]
    assert first["w_q"] is None
    assert first["weight_error"] == {"shape": (2,), "dtype": "float32"}
    assert second["w_q"]["qvalue"] == {"shape": (2, 3, 5), "dtype": "int8"}
    assert second["w_q"]["scale"] == {"shape": (2, 3), "dtype": "float32"}


def test_zero_weights_give_zero_error_and_output(tess, rng):
    inputs = {
        "x": net.normal(rng, (2, 3)),
        "layers": [{"w": np.zeros((3, 4), np.float32)}],
        "return_w_q": True,
    }
    out = tess.apply(inputs)
    np.testing.assert_array_equal(out["y"], 0)
    assert out["layers"][0]["weight_error"] == 0
    np.testing.assert_array_equal(out["layers"][0]["w_q"]["qvalue"], 0)


@pytest.fixture
def api_module(monkeypatch):
    """tesseract_api imported directly, caching every apply's pullback."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT))
    import tesseract_api

    monkeypatch.setattr(tesseract_api.RUNTIME.cache, "min_intensity", 0)
    # storing on, as a client's first step finds it: the module may be the
    # ``tess`` fixture's, whose earlier applies with no VJP (inference
    # traffic, test_apply's) turned it off until a VJP request
    monkeypatch.setattr(tesseract_api.RUNTIME.cache, "_applies_without_vjp", 0)
    assert sys.modules["tesseract_api"] is tesseract_api
    return tesseract_api


def test_vjp_after_apply_comes_from_the_cached_pullback(
    api_module, inputs, rng, monkeypatch
):
    from tesseract_core.runtime import jax_recipes

    model = api_module.InputSchema.model_validate(inputs)
    out = api_module.apply(model)
    np.testing.assert_allclose(out["y"], net.forward(inputs), rtol=RTOL, atol=ATOL)

    def recompute(*args, **kwargs):
        raise AssertionError("the VJP recomputed instead of using the cache")

    monkeypatch.setattr(jax_recipes, "jax_vjp", recompute)
    g = net.normal(rng, out["y"].shape)
    paths = net.diff_paths(inputs)
    want = net.vjp(inputs, g)
    tol = accuracy.for_network(inputs, RTOL)
    for _ in range(2):  # the cached pullback serves repeated VJPs
        got = api_module.vector_jacobian_product(model, set(paths), {"y"}, {"y": g})
        for path in paths:
            np.testing.assert_allclose(got[path], want[path], rtol=tol, atol=tol)


def test_cache_policy(api_module, rng, monkeypatch):
    """Nonlinear networks cache from QARRAY_VJP_CACHE_MIN_FLOPS on; linear ones
    only by the intensity rule (never at these sizes); intensity 0 forces all."""
    cache = api_module.RUNTIME.cache
    monkeypatch.setattr(cache, "min_intensity", 2**20)
    relu = api_module.InputSchema.model_validate(net.three_layer(rng))
    linear = api_module.InputSchema.model_validate(
        net.three_layer(rng, activations=("none", "none", "none"))
    )
    big_relu = api_module.InputSchema.model_validate(
        net.three_layer(rng, x_shape=(256, 1024), widths=(1024, 1024, 8))
    )
    assert not relu.cache_pays()  # 6 x 3 -> too small to pay
    assert big_relu.cache_pays()
    monkeypatch.setattr(cache, "min_flops", 0)
    assert relu.cache_pays()
    assert not linear.cache_pays()
    monkeypatch.setattr(cache, "min_intensity", 0)
    assert linear.cache_pays()


def test_inference_traffic_stops_storing_pullbacks(api_module, inputs, rng):
    """After QARRAY_VJP_CACHE_SIZE applies with no VJP, apply stops keeping
    pullbacks (inference traffic pays for nothing); a VJP request resumes it."""
    cache = api_module.RUNTIME.cache
    model = api_module.InputSchema.model_validate(inputs)
    g = net.normal(rng, net.forward(inputs).shape)
    api_module.vector_jacobian_product(model, {"x"}, {"y"}, {"y": g})  # a VJP: on
    assert model.cache_pays()
    for _ in range(cache.size):
        api_module.apply(model)
    assert not model.cache_pays()  # only applies since the last VJP
    api_module.vector_jacobian_product(model, {"x"}, {"y"}, {"y": g})
    assert model.cache_pays()


def test_a_training_loop_keeps_one_pullback(api_module, rng, monkeypatch):
    """New weights every step: once step n's VJP reads its pullback, the
    pullbacks of earlier steps (read already) go; one an apply stored whose
    VJP has not come yet (another client's) stays and still hits."""
    from tesseract_core.runtime import jax_recipes

    cache = api_module.RUNTIME.cache
    cache.resize(0)
    cache.resize(8)

    def recompute(*args, **kwargs):
        raise AssertionError("the VJP recomputed instead of using the cache")

    monkeypatch.setattr(jax_recipes, "jax_vjp", recompute)
    steps = [net.three_layer(rng) for _ in range(4)]
    g = net.normal(rng, net.forward(steps[0]).shape)
    other = net.three_layer(rng)
    pending = api_module.InputSchema.model_validate(other)
    api_module.apply(pending)  # another client's apply, its VJP comes last
    for i, inputs in enumerate(steps):
        model = api_module.InputSchema.model_validate(inputs)
        api_module.apply(model)
        got = api_module.vector_jacobian_product(model, {"x"}, {"y"}, {"y": g})
        np.testing.assert_allclose(
            got["x"], net.vjp(inputs, g)["x"], rtol=RTOL, atol=ATOL
        )
        assert len(cache) == 2, i  # this step's and the pending one
    got = api_module.vector_jacobian_product(pending, {"x"}, {"y"}, {"y": g})
    want = net.vjp(other, g)["x"]
    np.testing.assert_allclose(got["x"], want, rtol=RTOL, atol=ATOL)


def test_a_full_cache_drops_read_pullbacks_before_unread_ones(
    api_module, rng, monkeypatch
):
    """As many open steps as entries: a full cache makes room by dropping a
    pullback whose VJP has come (even one read more recently) rather than the
    oldest still waiting for its VJP (the 8-client test in test_replicas)."""
    from tesseract_core.runtime import jax_recipes

    cache = api_module.RUNTIME.cache
    cache.resize(0)
    cache.resize(2)

    def recompute(*args, **kwargs):
        raise AssertionError("the VJP recomputed instead of using the cache")

    monkeypatch.setattr(jax_recipes, "jax_vjp", recompute)
    waiting, done, new = (net.three_layer(rng) for _ in range(3))
    g = net.normal(rng, net.forward(waiting).shape)
    models = [api_module.InputSchema.model_validate(i) for i in (waiting, done, new)]
    api_module.apply(models[0])  # a slow client's step
    api_module.apply(models[1])
    api_module.vector_jacobian_product(models[1], {"x"}, {"y"}, {"y": g})
    api_module.apply(models[2])  # three entries for two places
    assert len(cache) == 2
    for model, inputs in ((models[0], waiting), (models[2], new)):
        got = api_module.vector_jacobian_product(model, {"x"}, {"y"}, {"y": g})
        want = net.vjp(inputs, g)["x"]
        np.testing.assert_allclose(got["x"], want, rtol=RTOL, atol=ATOL)
