"""The CNN surrogate's image (examples/cnn_surrogate/Dockerfile, built by
``make test-image`` on top of qarray's): served, with the committed weights,
against the float64 NumPy CNN; and its tesseract_config.yaml as
``tesseract build`` reads it."""

import os
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import requests

from qarray.checkpoint import load_tree
from support.server import ROOT, b64, decode
from tests.image.docker import docker, generate_build_context, running
from tests.tesseract.test_cnn_surrogate import EXAMPLE, forward_and_vjp

sys.path.insert(0, str(EXAMPLE))
from heat_surrogate import GRID, Surrogate

IMAGE = os.environ.get("QARRAY_TEST_CNN_IMAGE", "qarray-cnn-surrogate:test")
TESSERACT = Path(sys.executable).with_name("tesseract")


@pytest.fixture(scope="module")
def served():
    if docker("image", "inspect", IMAGE, check=False).returncode != 0:
        pytest.fail(f"no image {IMAGE}: `make test-image` builds it")
    with running(IMAGE) as (url, container):
        yield url, container


def test_apply_and_vjp_with_the_committed_weights(served, rng):
    url, _ = served
    model = load_tree(EXAMPLE / "surrogate.safetensors", Surrogate(jax.random.key(0)))
    log_k = rng.standard_normal((1, GRID, GRID)).astype(np.float32)
    g = rng.standard_normal((1, GRID, GRID)).astype(np.float32)
    inputs = {"log_k": b64(log_k)}
    r = requests.post(f"{url}/apply", json={"inputs": inputs}, timeout=120)
    assert r.status_code == 200, r.text[:2000]
    request = {
        "inputs": inputs,
        "vjp_inputs": ["log_k"],
        "vjp_outputs": ["u"],
        "cotangent_vector": {"u": b64(g)},
    }
    v = requests.post(f"{url}/vector_jacobian_product", json=request, timeout=120)
    assert v.status_code == 200, v.text[:2000]
    want_u, want_g = forward_and_vjp(model, log_k[0], g[0])
    u, gk = decode(r.json())["u"][0], decode(v.json())["log_k"][0]
    np.testing.assert_allclose(u, want_u, rtol=2e-4, atol=2e-4 * np.abs(want_u).max())
    np.testing.assert_allclose(gk, want_g, rtol=2e-4, atol=2e-4 * np.abs(want_g).max())
    # a bad request is a small 422 naming the field, and the server lives on
    bad = {"inputs": {"log_k": b64(np.zeros((1, 8, 8), np.float32))}}
    r = requests.post(f"{url}/apply", json=bad, timeout=60)
    assert r.status_code == 422 and "log_k" in r.text and len(r.content) < 4096
    assert requests.get(f"{url}/health", timeout=10).ok


def test_serves_as_a_non_root_user_behind_the_guard(served):
    _, container = served
    assert docker("exec", container, "id", "-u").stdout.strip() == "10001"
    cmdline = docker("exec", container, "cat", "/proc/1/cmdline").stdout
    assert "qarray-serve" in cmdline


def test_tesseract_config_generates_a_build_context(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in (
        "tesseract_api.py",
        "tesseract_config.yaml",
        "heat_surrogate.py",
        "surrogate.safetensors",
        "tesseract_requirements.txt",
    ):
        shutil.copy(EXAMPLE / name, source / name)  # the requirements: followed
    shutil.copytree(
        ROOT / "qarray",
        source / "qarray",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.jaxlib"),
    )
    dockerfile = generate_build_context(source, tmp_path / "ctx", TESSERACT).read_text()
    assert 'TESSERACT_NAME="cnn-surrogate"' in dockerfile
    for target in (
        "/tesseract/heat_surrogate.py",
        "/tesseract/surrogate.safetensors",
        "/tesseract/qarray",
        "/python-env/bin/tesseract-runtime",
    ):
        assert target in dockerfile, target
