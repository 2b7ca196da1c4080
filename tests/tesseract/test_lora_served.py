"""The contract's ``lora`` field: LoRA adapters on the request's or the
resident network, their gradients through every endpoint and the residual
cache, and 4xx's naming the field. Against the NumPy reference network
(tests/tesseract/network.py), which adds (alpha / rank) (h a^T) b^T."""

import os

import numpy as np
import pytest
from tesseract_core import Tesseract

from qarray.checkpoint import save_model
from tests import reference as ref
from tests.tesseract import network as net
from tests.tesseract.server import ROOT

RTOL = ATOL = 2e-4


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
    jac = tess.jacobian(inputs, {"lora.[0].a"}, {"y"})["y"]["lora.[0].a"]
    assert jac.shape == (4, 3, 2, 6)
    np.testing.assert_allclose(
        np.tensordot(g, jac, axes=2), reference["lora.[0].a"], rtol=RTOL, atol=ATOL
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
    for path in paths:
        np.testing.assert_allclose(got[path], want[path], rtol=RTOL, atol=ATOL)


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
          None], r"lora.\[0\].a must be \(rank, 6\)"),
        ([None, {"a": np.zeros((2, 5), np.float32),
                 "b": np.zeros((4, 3), np.float32)}], r"lora.\[1\].b must be \(4, 2\)"),
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
