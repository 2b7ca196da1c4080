"""Layer precisions in the contract: int4 (packed, per group) and float32
(not quantized) next to int8, through every endpoint in-process, against the
NumPy reference network (support/network.py); and the requests the
contract refuses."""

import numpy as np
import pytest
from tesseract_core import Tesseract

from support import network as net
from support import reference as ref
from support.server import ROOT

RTOL = ATOL = 3e-4


@pytest.fixture(scope="module")
def tess():
    with Tesseract.from_tesseract_api(str(ROOT / "tesseract_api.py")) as t:
        yield t


def int4_w_q(w, group):
    values, scale = ref.quantize4(w, group)
    return {"qvalue": ref.pack4(values), "scale": scale}


def mixed(rng):
    """int4 (dense w), int4 (stored w_q), float32 and int8 layers, nk."""
    x = net.normal(rng, (3, 64))
    w0, w1 = net.normal(rng, (32, 64)), net.normal(rng, (32, 32))
    layers = [
        {"w": w0, "layout": "nk", "precision": "int4", "group_size": 16,
         "bias": net.normal(rng, (32,)), "activation": "tanh"},
        {"w_q": int4_w_q(w1, 8), "layout": "nk", "precision": "int4",
         "group_size": 8, "activation": "silu"},
        {"w": net.normal(rng, (16, 32)), "layout": "nk", "precision": "float32",
         "bias": net.normal(rng, (16,)), "activation": "gelu"},
        {"w": net.normal(rng, (4, 16)), "layout": "nk"},
    ]  # fmt: skip
    return {"x": x, "layers": layers}


def test_apply_matches_numpy_and_returns_packed_w_q(tess, rng):
    inputs = mixed(rng)
    out = tess.apply({**inputs, "return_w_q": True})
    np.testing.assert_allclose(out["y"], net.forward(inputs), rtol=RTOL, atol=ATOL)
    layers = out["layers"]
    w0 = inputs["layers"][0]["w"]
    q0 = layers[0]["w_q"]
    assert q0["qvalue"].dtype == np.uint8 and q0["qvalue"].shape == (32, 32)
    assert q0["scale"].shape == (32, 4)
    np.testing.assert_array_equal(q0["qvalue"], int4_w_q(w0, 16)["qvalue"])
    np.testing.assert_allclose(
        layers[0]["weight_error"], net.weight_error(w0, "int4", 16), rtol=1e-4
    )
    assert layers[1]["w_q"] is None  # given as w_q
    assert layers[2]["w_q"] is None and float(layers[2]["weight_error"]) == 0.0
    assert layers[3]["w_q"]["qvalue"].dtype == np.int8
    # the returned int4 weights, sent back as w_q, give the same y
    again = {**inputs, "layers": [dict(inputs["layers"][0]), *inputs["layers"][1:]]}
    del again["layers"][0]["w"]
    again["layers"][0]["w_q"] = {"qvalue": q0["qvalue"], "scale": q0["scale"]}
    np.testing.assert_allclose(tess.apply(again)["y"], out["y"], rtol=1e-6, atol=1e-6)


def test_gradients_match_numpy(tess, rng):
    inputs = mixed(rng)
    y = net.forward(inputs)
    g = net.normal(rng, y.shape)
    paths = net.diff_paths(inputs)
    got = tess.vector_jacobian_product(inputs, paths, ["y"], {"y": g})
    want = net.vjp(inputs, g)
    for path in paths:
        scale = np.abs(want[path]).max()
        np.testing.assert_allclose(
            got[path], want[path], rtol=RTOL, atol=ATOL * scale, err_msg=path
        )
    # the float32 layer's gradient is exact (nothing straight-through): it is
    # in the list above; the jvp agrees with the vjp (adjoint)
    t = {p: net.normal(rng, np.shape(net.at(inputs, p))) for p in paths}
    jvp = tess.jacobian_vector_product(inputs, paths, ["y"], t)["y"]
    lhs = float(np.sum(jvp * g))
    rhs = sum(float(np.sum(t[p] * got[p])) for p in paths)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-3)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"layout": "kn"}, "layout must be 'nk' for precision 'int4'"),
        ({"group_size": 24}, "group_size = 24 does not divide"),
        ({"group_size": 7}, "positive even int"),
    ],
)
def test_bad_int4_layers_are_refused(tess, rng, change, match):
    inputs = mixed(rng)
    inputs["layers"][0] = {**inputs["layers"][0], **change}
    if change.get("layout") == "kn":
        inputs["layers"][0]["w"] = inputs["layers"][0]["w"].T.copy()
    with pytest.raises(Exception, match=match):
        tess.apply(inputs)


def test_bad_int4_payloads_are_refused(tess, rng):
    inputs = mixed(rng)
    layer = inputs["layers"][1]
    q, scale = layer["w_q"]["qvalue"], layer["w_q"]["scale"]
    cases = [
        ({"qvalue": q.astype(np.float32), "scale": scale}, "must be uint8"),
        (
            {"qvalue": q.astype(np.int16) + 200, "scale": scale},
            r"must lie in \[0, 255\]",
        ),
        ({"qvalue": q[:, :8], "scale": scale}, "has K = 16"),
        ({"qvalue": q, "scale": scale[:, :2]}, r"w_q.scale must have shape \(32, 4\)"),
    ]
    for w_q, match in cases:
        bad = {
            **inputs,
            "layers": [
                inputs["layers"][0],
                {**layer, "w_q": w_q},
                *inputs["layers"][2:],
            ],
        }
        with pytest.raises(Exception, match=match):
            tess.apply(bad)
    float_w_q = {**inputs["layers"][3], "precision": "float32"}
    del float_w_q["w"]
    float_w_q["w_q"] = dict(
        zip(("qvalue", "scale"), ref.quantize(net.normal(rng, (4, 16))), strict=True)
    )
    with pytest.raises(Exception, match="precision 'float32' runs dense w"):
        tess.apply({**inputs, "layers": [*inputs["layers"][:3], float_w_q]})
    with pytest.raises(Exception, match="'int4' is weight-only"):
        tess.apply({**inputs, "quantize_activations": True})


def test_a_cached_int4_pullback_serves_the_vjp(rng):
    """apply then vector_jacobian_product on the same inputs: the VJP comes
    from the pullback apply kept (int4 QArray residuals included)."""
    inputs = mixed(rng)
    g = net.normal(rng, (3, 4))
    paths = net.diff_paths(inputs)
    with Tesseract.from_tesseract_api(str(ROOT / "tesseract_api.py")) as tess:
        tess.apply(inputs)
        got = tess.vector_jacobian_product(inputs, paths, ["y"], {"y": g})
    want = net.vjp(inputs, g)
    for path in paths:
        scale = np.abs(want[path]).max()
        np.testing.assert_allclose(
            got[path], want[path], rtol=RTOL, atol=ATOL * scale, err_msg=path
        )
