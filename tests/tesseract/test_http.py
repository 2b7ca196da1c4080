"""A real `tesseract-runtime serve` process: every endpoint over HTTP, base64 arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import requests
from tesseract_core import Tesseract
from tesseract_jax import apply_tesseract

from tests import reference as ref
from tests.tesseract.server import ROOT, b64, decode, serve
from tests.tesseract.test_inprocess import (
    dense_weights,
    make_inputs,
    reference_vjp,
    reference_y,
)

RTOL = ATOL = 2e-4
TIMEOUT = 60


@pytest.fixture(scope="module")
def counted_server(tmp_path_factory):
    """The Tesseract behind a forward-pass counter (tests/tesseract/counting_api.py)."""
    tmp = tmp_path_factory.mktemp("counted")
    counter = tmp / "forward_passes"
    counter.touch()
    env = {
        "QARRAY_TEST_FORWARD_COUNTER": str(counter),
        "QARRAY_VJP_CACHE_SIZE": "8",
        "QARRAY_VJP_CACHE_MIN_INTENSITY": "0",
    }
    with serve(tmp, api_path=ROOT / "tests/tesseract/counting_api.py", env=env) as url:
        yield url, counter


def post(url, endpoint, payload, expect=200):
    response = requests.post(f"{url}/{endpoint}", json=payload, timeout=TIMEOUT)
    assert response.status_code == expect, response.text[:2000]
    return decode(response.json())


def encode_inputs(inputs):
    out = {}
    for key, value in inputs.items():
        if isinstance(value, dict):
            out[key] = {k: b64(v) for k, v in value.items()}
        elif isinstance(value, np.ndarray):
            out[key] = b64(value)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("kind", ["w", "w_q"])
def test_endpoints_over_http(counted_server, rng, kind):
    url, _ = counted_server
    inputs = make_inputs(rng, kind)
    payload = encode_inputs(inputs)
    paths = ["x", "bias", "w" if kind == "w" else "w_q.scale"]

    out = post(url, "apply", {"inputs": payload})
    np.testing.assert_allclose(out["y"], reference_y(inputs), rtol=RTOL, atol=ATOL)

    g = rng.standard_normal(out["y"].shape).astype(np.float32)
    vjp = post(
        url,
        "vector_jacobian_product",
        {
            "inputs": payload,
            "vjp_inputs": paths,
            "vjp_outputs": ["y"],
            "cotangent_vector": {"y": b64(g)},
        },
    )
    want = reference_vjp(inputs, g)
    for path in paths:
        np.testing.assert_allclose(vjp[path], want[path], rtol=RTOL, atol=ATOL)

    tangents = {
        p: rng.standard_normal(np.shape(vjp[p])).astype(np.float32) for p in paths
    }
    jvp = post(
        url,
        "jacobian_vector_product",
        {
            "inputs": payload,
            "jvp_inputs": paths,
            "jvp_outputs": ["y"],
            "tangent_vector": {p: b64(t) for p, t in tangents.items()},
        },
    )
    # dot-product test across the wire
    lhs = np.sum(jvp["y"].astype(np.float64) * g)
    rhs = sum(np.sum(tangents[p].astype(np.float64) * want[p]) for p in paths)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-4, atol=1e-4)

    jac = post(
        url, "jacobian", {"inputs": payload, "jac_inputs": ["x"], "jac_outputs": ["y"]}
    )
    want_jx = np.einsum("ij,an->inja", np.eye(3), dense_weights(inputs))
    np.testing.assert_allclose(jac["y"]["x"], want_jx, rtol=RTOL, atol=ATOL)

    abstract = post(
        url,
        "abstract_eval",
        {
            "inputs": {
                "x": {"shape": [6, 4], "dtype": "float32"},
                "w": {"shape": [4, 5], "dtype": "float32"},
            }
        },
    )
    assert abstract["y"] == {"shape": [6, 5], "dtype": "float32"}


def count(counter):
    return len(counter.read_text())


def test_apply_then_vjp_hits_the_residual_cache(counted_server, rng):
    url, counter = counted_server
    inputs = make_inputs(rng, "w", x_shape=(6, 8), n=7)
    payload = encode_inputs(inputs)
    g = rng.standard_normal((6, 7)).astype(np.float32)
    vjp_payload = {
        "inputs": payload,
        "vjp_inputs": ["x", "w"],
        "vjp_outputs": ["y"],
        "cotangent_vector": {"y": b64(g)},
    }

    before = count(counter)
    post(url, "apply", {"inputs": payload})
    after_apply = count(counter)
    assert after_apply == before + 1
    vjp = post(url, "vector_jacobian_product", vjp_payload)
    assert count(counter) == after_apply, "the VJP after apply re-ran the forward"
    want = reference_vjp(inputs, g)
    np.testing.assert_allclose(vjp["w"], want["w"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(vjp["x"], want["x"], rtol=RTOL, atol=ATOL)

    # different inputs miss the cache and pay for a forward pass
    other = dict(inputs, x=inputs["x"] + 1)
    post(url, "vector_jacobian_product", dict(vjp_payload, inputs=encode_inputs(other)))
    assert count(counter) == after_apply + 1


def test_interleaved_requests_get_their_own_gradients(counted_server, rng):
    url, counter = counted_server
    a = make_inputs(rng, "w", x_shape=(4, 8), n=6)
    b = dict(a, x=a["x"].copy())
    b["x"][0, 0] = np.nextafter(b["x"][0, 0], np.float32(np.inf))  # one ulp apart
    c = dict(a, x=np.where(a["x"] == 0, -0.0, a["x"]).astype(np.float32))
    c["x"][1, 1] = -0.0
    a["x"][1, 1] = 0.0  # a and c differ only in the sign of one zero
    g = rng.standard_normal((4, 6)).astype(np.float32)

    for inputs in (a, b, c):
        post(url, "apply", {"inputs": encode_inputs(inputs)})
    before = count(counter)
    results = {}
    for name, inputs in (("a", a), ("b", b), ("c", c)):
        results[name] = post(
            url,
            "vector_jacobian_product",
            {
                "inputs": encode_inputs(inputs),
                "vjp_inputs": ["w"],
                "vjp_outputs": ["y"],
                "cotangent_vector": {"y": b64(g)},
            },
        )
        want = reference_vjp(inputs, g)["w"]
        np.testing.assert_allclose(results[name]["w"], want, rtol=RTOL, atol=ATOL)
    assert count(counter) == before  # all three VJPs came from the cache
    # b's gradient differs from a's in exactly the row touched by x[0, 0]
    assert not np.array_equal(results["a"]["w"], results["b"]["w"])


def test_tesseract_jax_grad_through_the_served_tesseract(counted_server, rng):
    url, _ = counted_server
    x = rng.standard_normal((3, 4)).astype(np.float32)
    w = rng.standard_normal((4, 5)).astype(np.float32)
    target = rng.standard_normal((3, 5)).astype(np.float32)
    tess = Tesseract.from_url(url)

    def loss(x, w):
        y = apply_tesseract(tess, {"x": x, "w": w})["y"]
        return jnp.sum((y - target) ** 2)

    gx, gw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    wq = ref.roundtrip(w)
    y = x.astype(np.float64) @ wq
    want_gx, want_gw = ref.dense_vjp(x, wq, 2 * (y - target))
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(gw, want_gw, rtol=RTOL, atol=ATOL)
