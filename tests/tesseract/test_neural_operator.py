"""examples/neural_operator: a Fourier neural operator served int8 and int4
by qarray.tesseract.ModelTesseract, against a NumPy FNO (numpy.fft) with the
committed weights; and the example's pipeline, short."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import requests
from safetensors.numpy import load_file

from qarray.checkpoint import load_quantized
from support import reference as ref
from support.server import ROOT, b64, decode, serve
from tests.tesseract.test_cnn_surrogate import gelu, run_pipeline_quick

EXAMPLE = ROOT / "examples" / "neural_operator"
sys.path.insert(0, str(EXAMPLE))
from fno import BLOCKS, FNO, GRID, MODES, PAD  # noqa: E402

RTOL = ATOL = 2e-4


def stored_weights(tensors, name, precision):
    """A layer's weights (out, K) in float64 as the quantized model holds
    them: int8 roundtripped from a float file, or a stored file's parts."""
    if f"{name}.qvalue" in tensors:
        qvalue, scale = tensors[f"{name}.qvalue"], tensors[f"{name}.scale"]
        if qvalue.dtype == np.uint8:
            return ref.dequantize4(ref.unpack4(qvalue), scale)
        return ref.dequantize(qvalue, scale)
    w = tensors[f"{name}.weight"]
    return ref.roundtrip(w.reshape(w.shape[0], -1))


def spectral_weights(tensors, name):
    """The complex (in, out, *modes) weights of a spectral layer."""
    if f"{name}.weight" in tensors:
        return ref.spectral_roundtrip(tensors[f"{name}.weight"])
    rows = stored_weights(tensors, name, None)  # (out * modes^2, 2 in)
    width = rows.shape[1] // 2
    parts = np.moveaxis(rows.reshape(-1, MODES, MODES, width, 2), -2, 0)
    return parts[..., 0] + 1j * parts[..., 1]


def numpy_fno(tensors, log_k):
    """u (G, G) for one field (G, G): fno.FNO in NumPy, the quantized weights."""

    def pointwise(name, h):
        w = stored_weights(tensors, name, None)
        return np.einsum("oc,c...->o...", w, h) + tensors[f"{name}.bias"].reshape(
            -1, 1, 1
        )

    centres = (np.arange(GRID) + 0.5) / GRID
    coords = np.stack(np.meshgrid(centres, centres, indexing="ij"))
    h = pointwise("lift", np.concatenate([log_k[None], coords]).astype(np.float64))
    h = np.pad(h, ((0, 0), (0, PAD), (0, PAD)))
    for i in range(BLOCKS):
        w = spectral_weights(tensors, f"spectral.{i}")
        h = ref.spectral_conv(h, w, (MODES, MODES)) + pointwise(f"pointwise.{i}", h)
        h = h if i == BLOCKS - 1 else gelu(h)
    h = h[:, :GRID, :GRID]
    u = pointwise("project", gelu(pointwise("hidden", h)))
    return u[0] * tensors["u_scale"].astype(np.float64)


@pytest.fixture(scope="module", params=["int8", "int4"])
def served(request, tmp_path_factory):
    """(precision, url, the model file's tensors): the committed float32
    weights served int8, and the stored int4 file."""
    name = {"int8": "fno.safetensors", "int4": "fno_int4.safetensors"}[request.param]
    tmp = tmp_path_factory.mktemp(f"fno_{request.param}")
    env = {"QARRAY_MODEL": str(EXAMPLE / name)}
    with serve(tmp, api_path=EXAMPLE / "tesseract_api.py", env=env) as url:
        yield request.param, url, load_file(str(EXAMPLE / name))


def post(url, endpoint, payload):
    return requests.post(f"{url}/{endpoint}", json=payload, timeout=120)


def test_the_api_file_is_short():
    lines = (EXAMPLE / "tesseract_api.py").read_text().splitlines()
    assert len(lines) < 80, len(lines)


def test_apply_matches_numpy_and_the_vjp_the_quantized_model(served, rng):
    precision, url, tensors = served
    log_k = rng.standard_normal((2, GRID, GRID)).astype(np.float32)
    g = rng.standard_normal((2, GRID, GRID)).astype(np.float32)
    inputs = {"log_k": b64(log_k)}
    r = post(url, "apply", {"inputs": inputs})
    assert r.status_code == 200, r.text[:2000]
    u = decode(r.json())["u"]
    for i in range(2):
        want = numpy_fno(tensors, log_k[i])
        np.testing.assert_allclose(
            u[i], want, rtol=RTOL, atol=ATOL * np.abs(want).max()
        )
    request = {
        "inputs": inputs,
        "vjp_inputs": ["log_k"],
        "vjp_outputs": ["u"],
        "cotangent_vector": {"u": b64(g)},
    }
    r = post(url, "vector_jacobian_product", request)
    assert r.status_code == 200, r.text[:2000]
    file = EXAMPLE / (
        "fno.safetensors" if precision == "int8" else "fno_int4.safetensors"
    )
    model = load_quantized(file, FNO(jax.random.key(0)))
    if precision == "int4":
        assert model.spectral[0].precision == "int4"
    _, pullback = jax.vjp(lambda f: jax.vmap(model)(f[:, None])[:, 0], log_k)
    (want,) = pullback(g)
    got = decode(r.json())["log_k"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * np.abs(want).max())
    bad = post(
        url, "apply", {"inputs": {"log_k": b64(np.zeros((1, 16, 16), np.float32))}}
    )
    assert bad.status_code == 422 and "log_k" in bad.text and len(bad.content) < 4096


def test_pipeline_short(tmp_path):
    """Data, training, int8 and int4 test errors, the inverse problem through
    both served operators and in float32: finite, int8 within a point of
    float32, the bytes in order, the served recoveries near the float32 one."""
    results = run_pipeline_quick(EXAMPLE, tmp_path)
    f32 = results["test relative L2, float32"]
    assert abs(results["test relative L2, int8"] - f32) < 0.01, results
    sizes = [results[f"model bytes, {p}"] for p in ("float32", "int8", "int4")]
    assert sizes[0] > 3 * sizes[1] and sizes[1] > 1.4 * sizes[2], sizes
    local = results["inverse, float32, in JAX: final loss"]
    for precision in ("int8", "int4"):
        assert results[f"inverse, {precision}, served: final loss"] < 1.5 * local + 1e-2
    assert "| int4 |" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "neural_operator.png").stat().st_size > 10_000


def test_qlora_short(tmp_path):
    """qlora.py, a few steps on a few fields: the int4 FNO resident, its
    adapters (the spectral ones complex) trained over HTTP through
    tesseract-jax, the served outputs those of the adapted model in-process,
    the test error down, at most a tenth of the full fine-tune's trainable
    parameters, and the table written."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE / "qlora.py"), "--steps", "8",
         "--train-count", "8", "--test-count", "4", "--batch", "4",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
        env=env | {"JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "qlora.json").read_text())
    rows = summary["rows"]
    qlora = rows["QLoRA (int4 base + adapters, HTTP)"]
    assert qlora["served vs in-process max |du|"] < 1e-4
    assert qlora["wire bytes / full-weight step"] < 0.2
    assert summary["QLoRA trainable share"] <= 0.1
    before = rows["int4 base (before)"]["test error (shifted family)"]
    assert qlora["test error (shifted family)"] < before
    assert "| QLoRA" in (tmp_path / "qlora.md").read_text()
    assert (tmp_path / "qlora.png").stat().st_size > 10_000
