"""QARRAY_MESH: the network on every device of a host (8 virtual CPU devices).

Each mesh's server answers like the one-device server (rtol 1e-5): rows of x
over "data" (any number of rows: padded inside), output channels over "model".

Covers: qarray/tesseract/_mesh.py, qarray/tesseract/_runtime.py
"""

import os
import subprocess

import numpy as np
import pytest
import requests

from qarray.checkpoint import save_model
from support import network as net
from support.server import (
    ROOT,
    SERVE,
    b64,
    decode,
    encode,
    free_port,
    serve,
)

EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
MESHES = ["auto", "data=2,model=4", "data=1,model=8"]
TIMEOUT = 120


def post(url, endpoint, payload):
    response = requests.post(f"{url}/{endpoint}", json=payload, timeout=TIMEOUT)
    assert response.status_code == 200, response.text[:2000]
    return decode(response.json())


def requests_for(rng):
    """(name, inputs): both layouts, dense and quantized weights, int8
    activations, 5 rows (not a multiple of any mesh axis), a vector x."""
    mixed = net.three_layer(rng, "kn", x_shape=(5, 16), widths=(24, 16, 8))
    mixed["layers"][1] = net.make_layer(rng, 24, 16, "nk", "w_q", True, "gelu")
    return [
        ("kn", net.three_layer(rng, "kn", x_shape=(5, 16), widths=(24, 16, 8))),
        ("nk", net.three_layer(rng, "nk", x_shape=(2, 5, 16), widths=(24, 16, 8))),
        ("mixed", mixed),
        (
            "int8",
            net.three_layer(
                rng,
                "nk",
                x_shape=(7, 16),
                widths=(24, 16, 8),
                quantize_activations=True,
            ),
        ),
        ("vector", net.three_layer(rng, "kn", x_shape=(16,), widths=(8, 16, 8))),
    ]


def answers(url, inputs, rng):
    """apply, vjp (every differentiable path), jvp and jacobian (x) answers."""
    payload = encode(inputs)
    paths = net.diff_paths(inputs)
    y = post(url, "apply", {"inputs": payload})["y"]
    g = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
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
    tangents = {
        p: np.random.default_rng(2).standard_normal(np.shape(net.at(inputs, p)))
        for p in paths
    }
    jvp = post(
        url,
        "jacobian_vector_product",
        {
            "inputs": payload,
            "jvp_inputs": paths,
            "jvp_outputs": ["y"],
            "tangent_vector": {
                p: b64(t.astype(np.float32)) for p, t in tangents.items()
            },
        },
    )
    jac = post(
        url, "jacobian", {"inputs": payload, "jac_inputs": ["x"], "jac_outputs": ["y"]}
    )
    return {"y": y, **{f"vjp {p}": vjp[p] for p in paths}, "jvp": jvp["y"],
            "jacobian": jac["y"]["x"]}  # fmt: skip


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    rng = np.random.default_rng(0)
    cases = requests_for(rng)
    with serve(tmp_path_factory.mktemp("one")) as url:
        yield cases, {name: answers(url, inputs, rng) for name, inputs in cases}


@pytest.mark.parametrize("mesh", MESHES)
def test_mesh_answers_like_one_device(one_device, tmp_path, mesh):
    cases, want = one_device
    env = {**EIGHT_DEVICES, "QARRAY_MESH": mesh}
    rng = np.random.default_rng(0)
    with serve(tmp_path, env=env) as url:
        for name, inputs in cases:
            got = answers(url, inputs, rng)
            # the reference network agrees too (independent of both servers)
            np.testing.assert_allclose(
                got["y"], net.forward(inputs), rtol=2e-4, atol=2e-4
            )
            for key, value in want[name].items():
                # rtol 1e-5 of each answer's scale: sharded products take the
                # plain float32 formulation where one device takes three int8
                # parts (both float32-accurate, rounding differently), so
                # entries that cancel to ~0 differ by ~1e-6 of the largest
                scale = np.abs(value).max()
                np.testing.assert_allclose(
                    got[key],
                    value,
                    rtol=1e-5,
                    atol=1e-5 * scale,
                    err_msg=f"{name}: {key}",
                )


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    rng = np.random.default_rng(3)
    layers = [
        net.make_layer(rng, 16, 64, "nk", "w", True, "relu"),
        net.make_layer(rng, 64, 32, "kn", "w_q", True, "tanh"),
        net.make_layer(rng, 32, 8, "nk", "w_q", True, "none"),
    ]
    path = tmp_path_factory.mktemp("mesh-model") / "model.safetensors"
    save_model(path, layers)
    return path, layers


def test_resident_model_is_placed_sharded_once(model_file):
    """With model=8 each device holds 1/8 of every layer's output channels
    (read in-process: this test process has 8 CPU devices)."""
    import jax

    from qarray.tesseract.internal import load_resident, make_mesh

    path, _layers = model_file
    mesh = make_mesh("data=1,model=8")
    resident = load_resident(str(path), mesh)
    for layer in resident.layers:
        qvalue, scale = layer.qvalue, layer.scale
        channels = 0 if layer.layout == "nk" else 1  # axis of output channels
        shards = qvalue.addressable_shards
        assert len(shards) == 8
        for shard in shards:
            want = list(qvalue.shape)
            want[channels] //= 8
            assert shard.data.shape == tuple(want)
            assert shard.data.nbytes * 8 == qvalue.nbytes
        if layer.layout == "nk":  # scales travel with their rows
            assert scale.addressable_shards[0].data.shape == (scale.shape[0] // 8,)
    # the compiled computation takes them sharded, as placed
    x = np.ones((4, 16), np.float32)
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda net, x: net(x)).lower(resident, x).compile()
    args, _ = compiled.input_shardings  # (positional, keyword)
    first = args[0].layers[0].qvalue
    assert first.spec == jax.P("model", None), first


def test_resident_model_on_eight_devices_over_http(model_file, tmp_path):
    path, layers = model_file
    rng = np.random.default_rng(4)
    x = net.normal(rng, (9, 16))
    inputs = {"x": x, "layers": layers}
    env = {**EIGHT_DEVICES, "QARRAY_MESH": "data=1,model=8", "QARRAY_MODEL": str(path)}
    (tmp_path / "mesh").mkdir()
    with serve(tmp_path / "mesh", env=env) as url:
        y = post(url, "apply", {"inputs": {"x": b64(x)}})["y"]
        np.testing.assert_allclose(y, net.forward(inputs), rtol=2e-4, atol=2e-4)
        g = net.normal(rng, y.shape)
        vjp = post(
            url,
            "vector_jacobian_product",
            {
                "inputs": {"x": b64(x)},
                "vjp_inputs": ["x"],
                "vjp_outputs": ["y"],
                "cotangent_vector": {"y": b64(g)},
            },
        )
        np.testing.assert_allclose(
            vjp["x"], net.vjp(inputs, g)["x"], rtol=2e-4, atol=2e-4
        )


def test_residual_cache_still_hits_on_a_mesh(tmp_path):
    counter = tmp_path / "forward_passes"
    counter.touch()
    env = {
        **EIGHT_DEVICES,
        "QARRAY_MESH": "data=2,model=4",
        "QARRAY_TEST_FORWARD_COUNTER": str(counter),
        "QARRAY_VJP_CACHE_MIN_FLOPS": "0",
    }
    rng = np.random.default_rng(5)
    inputs = net.three_layer(rng, "nk", x_shape=(6, 16), widths=(24, 16, 8))
    payload = encode(inputs)
    g = net.normal(rng, (6, 8))
    with serve(
        tmp_path, api_path=ROOT / "tests/tesseract/counting_api.py", env=env
    ) as url:
        post(url, "apply", {"inputs": payload})
        before = len(counter.read_text())
        vjp = post(
            url,
            "vector_jacobian_product",
            {
                "inputs": payload,
                "vjp_inputs": ["x", "layers.[0].w"],
                "vjp_outputs": ["y"],
                "cotangent_vector": {"y": b64(g)},
            },
        )
        assert len(counter.read_text()) == before, "the VJP recomputed"
    want = net.vjp(inputs, g)
    for path in ("x", "layers.[0].w"):
        np.testing.assert_allclose(vjp[path], want[path], rtol=2e-4, atol=2e-4)


def test_a_mesh_that_does_not_fit_stops_start_up(tmp_path):
    env = {
        **os.environ,
        **EIGHT_DEVICES,
        "JAX_PLATFORMS": "cpu",
        "QARRAY_MESH": "data=3,model=2",
        "TESSERACT_API_PATH": str(ROOT / "tesseract_api.py"),
        "TESSERACT_OUTPUT_PATH": str(tmp_path),
    }
    result = subprocess.run(
        [str(SERVE), "serve", "--host", "127.0.0.1", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "QARRAY_MESH=data=3,model=2 needs data * model = 6 devices" in (
        result.stdout + result.stderr
    )
    assert "found 8 local cpu device(s)" in result.stdout + result.stderr
