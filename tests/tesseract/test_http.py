"""A real `qarray-serve` process: every endpoint over HTTP with base64 arrays,
the residual cache, and tesseract-jax composing the served network into JAX
programs (jit(grad), jvp, jacrev, vmap in one request). Everything is checked
against the NumPy reference network (support/network.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import requests
from tesseract_core import Tesseract
from tesseract_jax import apply_tesseract

from support import network as net
from support.server import ROOT, b64, decode, encode, serve

RTOL = ATOL = 2e-4
TIMEOUT = 60


@pytest.fixture(scope="module")
def counted_server(tmp_path_factory):
    """The Tesseract behind a forward-pass counter (tests/tesseract/counting_api.py),
    with the default cache policy for linear networks and nonlinear ones cached
    at any size (by default only from QARRAY_VJP_CACHE_MIN_FLOPS)."""
    tmp = tmp_path_factory.mktemp("counted")
    counter = tmp / "forward_passes"
    counter.touch()
    env = {
        "QARRAY_TEST_FORWARD_COUNTER": str(counter),
        "QARRAY_VJP_CACHE_SIZE": "8",
        "QARRAY_VJP_CACHE_MIN_FLOPS": "0",
    }
    with serve(tmp, api_path=ROOT / "tests/tesseract/counting_api.py", env=env) as url:
        yield url, counter


def post(url, endpoint, payload, expect=200):
    response = requests.post(f"{url}/{endpoint}", json=payload, timeout=TIMEOUT)
    assert response.status_code == expect, response.text[:2000]
    return decode(response.json())


def count(counter):
    return len(counter.read_text())


def _network(name, rng):
    if name == "three-kn":
        return net.three_layer(rng, "kn")
    if name == "three-nk-int8":
        return net.three_layer(rng, "nk", quantize_activations=True)
    if name == "ensemble":
        return {
            "x": net.normal(rng, (2, 3, 4)),
            "layers": [
                net.make_layer(rng, 4, 5, "nk", "w", True, "gelu", (2,)),
                net.make_layer(rng, 5, 3, "kn", "w_q", True, "none", (1,)),
            ],
        }
    raise ValueError(name)


@pytest.mark.parametrize("name", ["three-kn", "three-nk-int8", "ensemble"])
def test_endpoints_over_http(counted_server, rng, name):
    url, _ = counted_server
    inputs = _network(name, rng)
    payload = encode(inputs)
    paths = net.diff_paths(inputs)
    y = net.forward(inputs)

    out = post(url, "apply", {"inputs": payload})
    np.testing.assert_allclose(out["y"], y, rtol=RTOL, atol=ATOL)
    assert out["y"].dtype == np.float32

    g = net.normal(rng, y.shape)
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
    want = net.vjp(inputs, g)
    for path in paths:
        np.testing.assert_allclose(vjp[path], want[path], rtol=RTOL, atol=ATOL)

    tangents = {p: net.normal(rng, np.shape(net.at(inputs, p))) for p in paths}
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
    # dot-product test across the wire: <J t, g> = <t, J^T g>
    lhs = np.sum(jvp["y"].astype(np.float64) * g)
    rhs = sum(np.sum(tangents[p].astype(np.float64) * want[p]) for p in paths)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-4, atol=1e-4)

    jac = post(
        url,
        "jacobian",
        {"inputs": payload, "jac_inputs": ["x", paths[-1]], "jac_outputs": ["y"]},
    )
    for path in ("x", paths[-1]):
        np.testing.assert_allclose(
            jac["y"][path], net.jacobian(inputs, path), rtol=RTOL, atol=ATOL
        )

    abstract = post(
        url,
        "abstract_eval",
        {
            "inputs": {
                "x": {"shape": [6, 4], "dtype": "float32"},
                "layers": [
                    {"w": {"shape": [4, 5], "dtype": "float32"}, "activation": "relu"},
                    {"w": {"shape": [2, 5], "dtype": "float32"}, "layout": "nk"},
                ],
            }
        },
    )
    assert abstract["y"] == {"shape": [6, 2], "dtype": "float32"}


def test_apply_then_vjp_hits_the_residual_cache_for_a_relu_network(counted_server, rng):
    url, counter = counted_server
    inputs = net.three_layer(rng, "nk", x_shape=(6, 8), widths=(7, 5, 3))
    payload = encode(inputs)
    g = net.normal(rng, (6, 3))
    paths = ["x", "layers.[0].w", "layers.[1].w_q.scale", "layers.[2].bias"]
    vjp_payload = {
        "inputs": payload,
        "vjp_inputs": paths,
        "vjp_outputs": ["y"],
        "cotangent_vector": {"y": b64(g)},
    }

    before = count(counter)
    post(url, "apply", {"inputs": payload})
    after_apply = count(counter)
    assert after_apply == before + 1
    vjp = post(url, "vector_jacobian_product", vjp_payload)
    assert count(counter) == after_apply, "the VJP after apply re-ran the forward"
    want = net.vjp(inputs, g)
    for path in paths:
        np.testing.assert_allclose(vjp[path], want[path], rtol=RTOL, atol=ATOL)

    # different inputs miss the cache and pay for a forward pass
    other = dict(inputs, x=inputs["x"] + 1)
    vjp = post(url, "vector_jacobian_product", dict(vjp_payload, inputs=encode(other)))
    assert count(counter) == after_apply + 1
    np.testing.assert_allclose(vjp["x"], net.vjp(other, g)["x"], rtol=RTOL, atol=ATOL)


def test_linear_network_is_cached_by_default(counted_server, rng):
    """A linear network's VJP does not need the forward pass, but a hit still
    measured faster than recomputing (make bench, suite cache, a training
    loop): by default (QARRAY_VJP_CACHE_MIN_INTENSITY=0) every apply keeps its
    pullback, and the VJP after it computes no forward pass."""
    url, counter = counted_server
    inputs = net.three_layer(rng, activations=("none", "none", "none"))
    payload = encode(inputs)
    post(url, "apply", {"inputs": payload})
    before = count(counter)
    g = net.normal(rng, net.forward(inputs).shape)
    vjp = post(
        url,
        "vector_jacobian_product",
        {
            "inputs": payload,
            "vjp_inputs": ["x"],
            "vjp_outputs": ["y"],
            "cotangent_vector": {"y": b64(g)},
        },
    )
    assert count(counter) == before
    np.testing.assert_allclose(vjp["x"], net.vjp(inputs, g)["x"], rtol=RTOL, atol=ATOL)


def test_interleaved_requests_get_their_own_gradients(counted_server, rng):
    url, counter = counted_server
    a = net.three_layer(rng, x_shape=(4, 6))
    b = dict(a, x=a["x"].copy())
    b["x"][0, 0] = np.nextafter(b["x"][0, 0], np.float32(np.inf))  # one ulp apart
    c = dict(a, x=a["x"].copy())
    a["x"][1, 1] = 0.0
    c["x"][1, 1] = -0.0  # a and c differ only in the sign of one zero
    g = net.normal(rng, (4, 2))

    for inputs in (a, b, c):
        post(url, "apply", {"inputs": encode(inputs)})
    before = count(counter)
    results = {}
    for name, inputs in (("a", a), ("b", b), ("c", c)):
        results[name] = post(
            url,
            "vector_jacobian_product",
            {
                "inputs": encode(inputs),
                "vjp_inputs": ["layers.[0].w"],
                "vjp_outputs": ["y"],
                "cotangent_vector": {"y": b64(g)},
            },
        )
        want = net.vjp(inputs, g)["layers.[0].w"]
        np.testing.assert_allclose(
            results[name]["layers.[0].w"], want, rtol=RTOL, atol=ATOL
        )
    assert count(counter) == before  # all three VJPs came from the cache
    # b's gradient differs from a's: the one-ulp change reached it
    assert not np.array_equal(
        results["a"]["layers.[0].w"], results["b"]["layers.[0].w"]
    )


# --- tesseract-jax: the served network inside JAX programs


def _jax_network(inputs):
    """The request as tesseract-jax's apply_tesseract takes it."""
    return jax.tree.map(
        lambda v: jnp.asarray(v) if isinstance(v, np.ndarray) else v, inputs
    )


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_tesseract_jax_jit_grad_jvp_jacrev(counted_server, rng, layout):
    url, _ = counted_server
    inputs = net.three_layer(rng, layout, kinds=("w", "w_q", "w"))
    target = net.normal(rng, net.forward(inputs).shape)
    tess = Tesseract.from_url(url)

    def run(x, w0, scale1, bias2):
        request = _jax_network(inputs)
        request["x"] = x
        request["layers"][0]["w"] = w0
        request["layers"][1]["w_q"]["scale"] = scale1
        request["layers"][2]["bias"] = bias2
        return apply_tesseract(tess, request)["y"]

    args = (
        inputs["x"],
        inputs["layers"][0]["w"],
        inputs["layers"][1]["w_q"]["scale"],
        inputs["layers"][2]["bias"],
    )
    paths = ("x", "layers.[0].w", "layers.[1].w_q.scale", "layers.[2].bias")

    def loss(*args):
        return jnp.sum((run(*args) - target) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    y = net.forward(inputs)
    want = net.vjp(inputs, 2 * (y - target))
    for got, path in zip(grads, paths, strict=True):
        np.testing.assert_allclose(got, want[path], rtol=RTOL, atol=ATOL, err_msg=path)

    tangents = tuple(net.normal(rng, np.shape(a)) for a in args)
    y_out, jvp = jax.jvp(run, args, tangents)
    np.testing.assert_allclose(y_out, y, rtol=RTOL, atol=ATOL)
    want_jvp = sum(
        np.tensordot(net.jacobian(inputs, p), t, axes=t.ndim)
        for p, t in zip(paths, tangents, strict=True)
    )
    np.testing.assert_allclose(jvp, want_jvp, rtol=RTOL, atol=ATOL)

    jac_x = jax.jacrev(lambda x: run(x, *args[1:]))(args[0])
    np.testing.assert_allclose(jac_x, net.jacobian(inputs, "x"), rtol=RTOL, atol=ATOL)


@pytest.fixture
def request_counter(monkeypatch):
    """Counts HTTP requests per endpoint made through requests.Session."""
    counts = {}
    original = requests.Session.request

    def counted(self, method, url, *args, **kwargs):
        endpoint = url.rstrip("/").rsplit("/", 1)[-1]
        counts[endpoint] = counts.get(endpoint, 0) + 1
        return original(self, method, url, *args, **kwargs)

    monkeypatch.setattr(requests.Session, "request", counted)
    return counts


@pytest.mark.parametrize(
    "vmap_method", ["expand_dims", "auto_experimental", "broadcast_all"]
)
@pytest.mark.parametrize("over", ["x", "weights", "both"])
def test_tesseract_jax_vmap_takes_one_request(
    counted_server, rng, request_counter, vmap_method, over
):
    """vmap over x, over per-example weights (an ensemble) or both: one apply."""
    url, _ = counted_server
    batch = 3
    base = net.three_layer(rng, "nk", x_shape=(2, 6))
    xs = net.normal(rng, (batch, 2, 6))
    w0s = net.normal(rng, (batch, *base["layers"][0]["w"].shape))
    tess = Tesseract.from_url(url)

    def run(x, w0):
        request = _jax_network(base)
        request["x"] = x
        request["layers"][0]["w"] = w0
        request["return_weight_error"] = True  # every output carries the batch
        return apply_tesseract(tess, request, vmap_method=vmap_method)

    in_axes = {"x": (0, None), "weights": (None, 0), "both": (0, 0)}[over]
    x_arg = xs if in_axes[0] == 0 else base["x"]
    w_arg = w0s if in_axes[1] == 0 else base["layers"][0]["w"]
    request_counter.clear()
    out = jax.vmap(run, in_axes=in_axes)(x_arg, w_arg)
    assert request_counter.get("apply") == 1, request_counter

    for b in range(batch):
        one = dict(base, x=xs[b] if in_axes[0] == 0 else base["x"])
        one["layers"] = [dict(layer) for layer in base["layers"]]
        one["layers"][0]["w"] = w0s[b] if in_axes[1] == 0 else base["layers"][0]["w"]
        np.testing.assert_allclose(out["y"][b], net.forward(one), rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(
            out["layers"][0]["weight_error"][b],
            net.weight_error(one["layers"][0]["w"]),
            rtol=1e-4,
        )
