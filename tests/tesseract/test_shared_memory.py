"""One host over shared memory: ``qarray.tesseract.shared_memory_tesseract``
serves the Tesseract with qarray-serve (the guard) and passes arrays as binref
files through the binref pool; answers against the NumPy reference network."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import requests
from tesseract_core.sdk import local_client
from tesseract_jax import apply_tesseract

from qarray.tesseract import _workarounds, shared_memory_tesseract
from support import network as net
from support.server import ROOT

RTOL = ATOL = 2e-4


@pytest.fixture(scope="module")
def tess(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shm")
    environment = {"QARRAY_MAX_LAYERS": "3"}
    with shared_memory_tesseract(
        ROOT / "tesseract_api.py", folder, environment=environment
    ) as t:
        yield t, folder


def _binref(buffer, shape):
    data = {"buffer": buffer, "encoding": "binref"}
    return {"object_type": "array", "shape": shape, "dtype": "float32", "data": data}


def test_apply_and_vjp_through_binref_files(tess, rng):
    t, folder = tess
    inputs = net.three_layer(rng, "nk", kinds=("w", "w_q", "w"))
    out = t.apply(inputs)
    np.testing.assert_allclose(out["y"], net.forward(inputs), rtol=RTOL, atol=ATOL)
    g = net.normal(rng, out["y"].shape)
    paths = ["x", "layers.[0].w", "layers.[1].w_q.scale"]
    grads = t.vector_jacobian_product(inputs, paths, ["y"], {"y": g})
    want = net.vjp(inputs, g)
    for path in paths:
        np.testing.assert_allclose(grads[path], want[path], rtol=RTOL, atol=ATOL)
    # the arrays went as files into the folder's inputs, not in the body
    assert any((folder / "inputs").iterdir())


def test_tesseract_jax_gradient(tess, rng):
    t, _ = tess
    inputs = net.three_layer(rng, "kn")
    g = net.normal(rng, net.forward(inputs).shape)

    def loss(w0, x):
        layers = [{**inputs["layers"][0], "w": w0}, *inputs["layers"][1:]]
        y = apply_tesseract(t, {**inputs, "x": x, "layers": layers})["y"]
        return jnp.sum(y * g)

    w0 = jnp.asarray(inputs["layers"][0]["w"])
    grad_w0, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(w0, inputs["x"])
    want = net.vjp(inputs, g)
    np.testing.assert_allclose(grad_w0, want["layers.[0].w"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad_x, want["x"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("buffer", ["/etc/passwd", "../outputs/a.bin:0"])
def test_the_guard_refuses_binrefs_outside_the_input_folder(tess, buffer):
    t, _ = tess
    body = {"inputs": {"x": _binref(buffer, [1, 2]), "layers": [{"w": [[1.0]]}]}}
    response = requests.post(f"{t._client.url}/apply", json=body, timeout=30)
    assert response.status_code == 422
    assert "binref buffer" in response.json()["detail"]  # the guard's answer


def test_environment_reaches_the_server(tess, rng):
    t, _ = tess
    inputs = net.three_layer(rng)
    inputs["layers"].append(net.make_layer(rng, 2, 2))
    with pytest.raises(Exception, match="QARRAY_MAX_LAYERS"):
        t.apply(inputs)


def test_upstream_runs_the_runtime_script_beside_the_interpreter(tmp_path):
    """Workaround 2: from_source runs ``tesseract-runtime`` found beside
    ``python_executable``; fails when tesseract-core stops doing so."""
    python = _workarounds.guarded_interpreter(tmp_path / "bin")
    command = local_client._runtime_command(str(python))
    assert command == [str(tmp_path / "bin" / "tesseract-runtime")]
    script = Path(command[0]).read_text()
    assert "from qarray.tesseract import main" in script


def test_binref_outputs_go_to_the_run_folder_and_base64_makes_none(tess):
    """A json+binref answer is written under ``run_<run_id>`` (a fresh name
    without one); a json+base64 answer writes no run folder."""
    t, folder = tess
    outputs = folder / "outputs"
    body = {"inputs": {"x": [[1.0, 2.0]], "layers": [{"w": [[1.0], [3.0]]}]}}
    url = f"{t._client.url}/apply"
    before = set(outputs.iterdir())
    response = requests.post(
        url, json=body, headers={"accept": "application/json+base64"}, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.json()["y"]["data"]["encoding"] == "base64"
    assert set(outputs.iterdir()) == before
    for run_id, params in (("given", {"run_id": "given"}), (None, {})):
        response = requests.post(
            url,
            json=body,
            params=params,
            headers={"accept": "application/json+binref"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        buffer = response.json()["y"]["data"]["buffer"]
        run = buffer.split("/")[0]
        assert run == "run_given" if run_id else run.startswith("run_"), buffer
        path = outputs / buffer.split(":")[0]
        assert np.frombuffer(path.read_bytes(), np.float32).tolist() == [7.0]
