"""The neural operator's image (examples/neural_operator/Dockerfile, built by
``make test-image`` on top of qarray's): the committed weights served int8,
and the stored int4 file selected by QARRAY_MODEL, against the NumPy FNO."""

import os

import numpy as np
import pytest
import requests
from safetensors.numpy import load_file

from support.server import b64, decode
from tests.image.docker import docker, running
from tests.tesseract.test_neural_operator import EXAMPLE, GRID, numpy_fno

IMAGE = os.environ.get("QARRAY_TEST_OPERATOR_IMAGE", "qarray-neural-operator:test")


@pytest.mark.parametrize("name", ["fno.safetensors", "fno_int4.safetensors"])
def test_apply_with_the_committed_weights(rng, name):
    if docker("image", "inspect", IMAGE, check=False).returncode != 0:
        pytest.fail(f"no image {IMAGE}: `make test-image` builds it")
    env = ("-e", f"QARRAY_MODEL=/tesseract/neural_operator/{name}")
    log_k = rng.standard_normal((1, GRID, GRID)).astype(np.float32)
    with running(IMAGE, *env) as (url, _):
        r = requests.post(
            f"{url}/apply", json={"inputs": {"log_k": b64(log_k)}}, timeout=120
        )
        assert r.status_code == 200, r.text[:2000]
    want = numpy_fno(load_file(str(EXAMPLE / name)), log_k[0])
    got = decode(r.json())["u"][0]
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
