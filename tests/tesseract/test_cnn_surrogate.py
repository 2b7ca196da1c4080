"""examples/cnn_surrogate: a user's own equinox model served by
qarray.tesseract.ModelTesseract, over HTTP against a float64 NumPy CNN; and
the example's pipeline, short.

Covers: qarray/tesseract/_model.py"""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
import requests

from qarray.checkpoint import save_tree
from support import reference as ref
from support.server import ROOT, b64, decode, serve

EXAMPLE = ROOT / "examples" / "cnn_surrogate"
sys.path.insert(0, str(EXAMPLE))
from heat_surrogate import DILATIONS, GRID, Surrogate  # noqa: E402

RTOL = ATOL = 2e-4


def gelu(x):  # jax.nn.gelu's default, the tanh approximation
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def gelu_grad(x):
    t = np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))
    dt = (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x**2)
    return 0.5 * (1 + t) + 0.5 * x * dt


def layers_of(model):
    """(int8-roundtripped weights, bias, dilation) per conv, in order."""
    convs = [model.lift, *model.blocks, model.project]
    dilations = (1, *DILATIONS, 1)
    out = []
    for conv, d in zip(convs, dilations, strict=True):
        w = np.asarray(conv.weight)
        wq = ref.roundtrip(w.reshape(w.shape[0], -1)).reshape(w.shape)
        out.append((wq, np.asarray(conv.bias).reshape(-1), d))
    return out


def conv(h, layer):
    w, b, d = layer
    return ref.conv(h, w, (1, 1), ((d, d), (d, d)), (d, d)) + b[:, None, None]


def forward_and_vjp(model, log_k, g):
    """u for one field (G, G), and the cotangent of log_k for u's cotangent g."""
    layers, scale = layers_of(model), float(model.u_scale)
    h = log_k[None].astype(np.float64)
    pre = conv(h, layers[0])
    tape = [(h, pre)]
    h = gelu(pre)
    for layer in layers[1:-1]:
        z = conv(h, layer)
        tape.append((h, z))
        h = h + gelu(z)
    u = (conv(h, layers[-1]) * scale)[0]
    # backward, by hand
    gh, _ = ref.conv_vjp(
        h, layers[-1][0], g[None] * scale, (1, 1), ((1, 1),) * 2, (1, 1)
    )
    for layer, (h_in, z) in zip(layers[-2:0:-1], tape[:0:-1], strict=True):
        d = layer[2]
        gz, _ = ref.conv_vjp(
            h_in, layer[0], gh * gelu_grad(z), (1, 1), ((d, d),) * 2, (d, d)
        )
        gh = gh + gz
    h_in, z = tape[0]
    gx, _ = ref.conv_vjp(
        h_in, layers[0][0], gh * gelu_grad(z), (1, 1), ((1, 1),) * 2, (1, 1)
    )
    return u, gx[0]


@pytest.fixture(scope="module")
def model():
    return Surrogate(jax.random.key(3), u_scale=0.05)


@pytest.fixture(scope="module")
def url(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("cnn_surrogate")
    save_tree(tmp / "model.safetensors", model)  # float32: quantized at load
    env = {
        "QARRAY_MODEL": str(tmp / "model.safetensors"),
        "QARRAY_MAX_ELEMENTS": "600000",
    }
    with serve(tmp, api_path=EXAMPLE / "tesseract_api.py", env=env) as url:
        yield url


def post(url, endpoint, payload):
    return requests.post(f"{url}/{endpoint}", json=payload, timeout=120)


def test_the_api_file_is_short():
    lines = (EXAMPLE / "tesseract_api.py").read_text().splitlines()
    assert len(lines) < 80, len(lines)


def test_apply_and_vjp_match_numpy(url, model, rng):
    log_k = rng.standard_normal((2, GRID, GRID)).astype(np.float32)
    g = rng.standard_normal((2, GRID, GRID)).astype(np.float32)
    inputs = {"log_k": b64(log_k)}
    r = post(url, "apply", {"inputs": inputs})
    assert r.status_code == 200, r.text[:2000]
    u = decode(r.json())["u"]
    r = post(
        url,
        "vector_jacobian_product",
        {
            "inputs": inputs,
            "vjp_inputs": ["log_k"],
            "vjp_outputs": ["u"],
            "cotangent_vector": {"u": b64(g)},
        },
    )
    assert r.status_code == 200, r.text[:2000]
    gk = decode(r.json())["log_k"]
    for i in range(2):
        want_u, want_g = forward_and_vjp(model, log_k[i], g[i])
        scale = np.abs(want_u).max()
        np.testing.assert_allclose(u[i], want_u, rtol=RTOL, atol=ATOL * scale)
        np.testing.assert_allclose(
            gk[i], want_g, rtol=RTOL, atol=ATOL * np.abs(want_g).max()
        )
    # the same VJP again on other inputs: no cached pullback to reuse
    r = post(
        url,
        "vector_jacobian_product",
        {
            "inputs": {"log_k": b64(log_k[:1])},
            "vjp_inputs": ["log_k"],
            "vjp_outputs": ["u"],
            "cotangent_vector": {"u": b64(g[:1])},
        },
    )
    np.testing.assert_allclose(
        decode(r.json())["log_k"][0], gk[0], rtol=1e-4, atol=1e-6
    )


def test_jvp_is_the_adjoint_of_the_vjp(url, rng):
    log_k = rng.standard_normal((1, GRID, GRID)).astype(np.float32)
    t = rng.standard_normal((1, GRID, GRID)).astype(np.float32)
    g = rng.standard_normal((1, GRID, GRID)).astype(np.float32)
    inputs = {"log_k": b64(log_k)}
    jvp = decode(
        post(
            url,
            "jacobian_vector_product",
            {
                "inputs": inputs,
                "jvp_inputs": ["log_k"],
                "jvp_outputs": ["u"],
                "tangent_vector": {"log_k": b64(t)},
            },
        ).json()
    )["u"]
    vjp = decode(
        post(
            url,
            "vector_jacobian_product",
            {
                "inputs": inputs,
                "vjp_inputs": ["log_k"],
                "vjp_outputs": ["u"],
                "cotangent_vector": {"u": b64(g)},
            },
        ).json()
    )["log_k"]
    np.testing.assert_allclose(np.sum(jvp * g), np.sum(t * vjp), rtol=1e-4)


def test_jacobian_and_abstract_eval(url, rng, model):
    log_k = rng.standard_normal((1, GRID, GRID)).astype(np.float32)
    r = post(
        url,
        "abstract_eval",
        {"inputs": {"log_k": {"shape": [3, GRID, GRID], "dtype": "float32"}}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["u"] == {"shape": [3, GRID, GRID], "dtype": "float32"}
    # (1, 32, 32) x (1, 32, 32): 1,048,576 elements, over the server's limit
    r = post(
        url,
        "jacobian",
        {
            "inputs": {"log_k": b64(log_k)},
            "jac_inputs": ["log_k"],
            "jac_outputs": ["u"],
        },
    )
    assert r.status_code == 422, r.text
    assert "the Jacobian of u (1, 32, 32) with respect to log_k (1, 32, 32)" in r.text
    assert "QARRAY_MAX_ELEMENTS" in r.text


def _field(shape=(1, GRID, GRID), value=0.0):
    return b64(np.full(shape, value, np.float32))


def _vjp(cotangent, paths=("log_k",)):
    return {
        "inputs": {"log_k": _field()},
        "vjp_inputs": list(paths),
        "vjp_outputs": ["u"],
        "cotangent_vector": {"u": cotangent},
    }


HUGE = {
    "object_type": "array",
    "shape": [4, 800, 800],
    "dtype": "float32",
    "data": {"buffer": "", "encoding": "base64"},
}
BAD_REQUESTS = {
    "wrong-grid": ("apply", {"inputs": {"log_k": _field((1, 16, 16))}}, "log_k"),
    "too-large": ("apply", {"inputs": {"log_k": HUGE}}, "QARRAY_MAX_ELEMENTS"),
    "missing": ("apply", {"inputs": {}}, "log_k"),
    "cotangent-shape": (
        "vector_jacobian_product",
        _vjp(_field((2, GRID, GRID))),
        r"cotangent_vector\['u'\] must have the shape of u \(1, 32, 32\)",
    ),
    "unknown-path": ("vector_jacobian_product", _vjp(_field(), ["k"]), "vjp_inputs"),
    "nan-tangent": (
        "jacobian_vector_product",
        {
            "inputs": {"log_k": _field()},
            "jvp_inputs": ["log_k"],
            "jvp_outputs": ["u"],
            "tangent_vector": {"log_k": _field(value=np.nan)},
        },
        "must be finite",
    ),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_requests_are_small_422s(url, case):
    endpoint, payload, match = BAD_REQUESTS[case]
    r = post(url, endpoint, payload)
    assert r.status_code == 422, r.text[:2000]
    assert re.search(match, r.text), r.text[:2000]
    assert len(r.content) < 4096
    assert requests.get(f"{url}/health", timeout=10).ok


def run_pipeline_quick(example, out) -> dict:
    """``example``/pipeline.py --quick, its results (all finite)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, str(example / "pipeline.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env | {"JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert all(np.isfinite(v) for v in results.values())
    return results


def test_pipeline_short(tmp_path):
    """Data, training, int8 test error, the inverse problem through the
    served surrogate (its own server) and in float32: all finite, the int8
    surrogate within a point of float32's error, the served inverse problem
    as good as the float32 one."""
    results = run_pipeline_quick(EXAMPLE, tmp_path)
    f32, q = results["test relative L2, float32"], results["test relative L2, int8"]
    assert abs(q - f32) < 0.01, results
    assert results["model bytes, int8"] < 0.3 * results["model bytes, float32"]
    served = "inverse, int8, served (tesseract-jax)"
    local = "inverse, float32, in JAX"
    # the short run's surrogate is barely trained: the two recoveries agree
    # with each other, whatever their distance to the truth
    assert (
        results[f"{served}: final loss"] < 1.5 * results[f"{local}: final loss"] + 1e-3
    )
    assert (tmp_path / "cnn_surrogate.png").stat().st_size > 10_000


def test_qlora_short(tmp_path):
    """qlora.py, a few steps on a few fields: the int4 base resident, its
    adapters trained over HTTP through tesseract-jax (the served outputs
    those of the adapted model in-process), the training loss down, fewer
    wire bytes than a full-weight step, and the table written."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE / "qlora.py"), "--steps", "12",
         "--train-count", "24", "--test-count", "8", "--batch", "8",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
        env=env | {"JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "qlora.json").read_text())
    rows = summary["rows"]
    qlora = rows["QLoRA (int4 base + adapters, HTTP)"]
    assert qlora["served vs in-process max |du|"] < 1e-4
    assert qlora["wire bytes / full-weight step"] < 0.6
    assert qlora["trainable parameters"] < 0.2 * rows[
        "full fine-tune (float32, in-process)"]["trainable parameters"]  # fmt: skip
    # a dozen steps already move the adapted model towards the new family
    before = rows["int4 base (before)"]["test error (shifted family)"]
    assert qlora["test error (shifted family)"] < before
    assert (tmp_path / "qlora.png").stat().st_size > 10_000
