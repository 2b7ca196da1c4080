"""Resident models (QARRAY_MODEL): model files, the PyTorch converter, and a
server whose requests carry only x. Checked against the NumPy reference.

Covers: qarray/tesseract/_resident.py, qarray/tesseract/_runtime.py,
qarray/checkpoint/_network_file.py, qarray/checkpoint/_convert.py,
qarray/checkpoint/_errors.py"""

import json
import os
import subprocess

import numpy as np
import pytest
import requests
from tesseract_core import Tesseract

from qarray.checkpoint import ModelFileError, load_model, load_network, save_model
from qarray.checkpoint.pytorch import convert_state_dict
from support import network as net
from support import reference as ref
from support.server import (
    ROOT,
    SERVE,
    b64,
    decode,
    free_port,
    serve,
    server_rss,
)
from tests.qarray.test_tree_checkpoint import pytorch_cnn_state_dict

RTOL = ATOL = 2e-4


def model_layers(rng):
    """A 3-layer network as a model file holds it: dense and quantized layers,
    both layouts, nonlinearities."""
    return [
        net.make_layer(rng, 6, 5, "nk", "w", True, "gelu"),
        net.make_layer(rng, 5, 4, "kn", "w_q", True, "relu"),
        net.make_layer(rng, 4, 3, "nk", "w_q", False, "none"),
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    rng = np.random.default_rng(7)
    layers = model_layers(rng)
    path = tmp_path_factory.mktemp("model") / "model.safetensors"
    save_model(path, layers)
    return path, layers


@pytest.fixture(scope="module")
def resident_tess(model):
    """The Tesseract in-process, in a fresh interpreter state per module: the
    resident model is read from QARRAY_MODEL when tesseract_api is imported."""
    path, _ = model
    os.environ["QARRAY_MODEL"] = str(path)
    try:
        with Tesseract.from_tesseract_api(str(ROOT / "tesseract_api.py")) as t:
            yield t
    finally:
        del os.environ["QARRAY_MODEL"]


def test_model_file_round_trip(model):
    path, layers = model
    loaded = load_model(path)
    assert [(m.layout, m.activation) for m in loaded] == [
        (layer["layout"], layer["activation"]) for layer in layers
    ]
    np.testing.assert_array_equal(loaded[0].w, layers[0]["w"])
    np.testing.assert_array_equal(loaded[1].qvalue, layers[1]["w_q"]["qvalue"])
    np.testing.assert_array_equal(loaded[1].scale, layers[1]["w_q"]["scale"])
    assert loaded[2].bias is None


def test_resident_apply_and_gradients_for_x(resident_tess, model, rng):
    _, layers = model
    x = net.normal(rng, (4, 6))
    inputs = {"x": x, "layers": layers}
    out = resident_tess.apply({"x": x, "return_weight_error": True})
    np.testing.assert_allclose(out["y"], net.forward(inputs), rtol=RTOL, atol=ATOL)
    assert len(out["layers"]) == 3
    # the dense layer reports the error of its quantization at load; the file's
    # quantized layers, 0
    errors = [float(layer["weight_error"]) for layer in out["layers"]]
    assert errors[0] == pytest.approx(net.weight_error(layers[0]["w"]), rel=1e-4)
    assert errors[1:] == [0.0, 0.0]

    g = net.normal(rng, out["y"].shape)
    vjp = resident_tess.vector_jacobian_product({"x": x}, ["x"], ["y"], {"y": g})
    np.testing.assert_allclose(vjp["x"], net.vjp(inputs, g)["x"], rtol=RTOL, atol=ATOL)
    t = net.normal(rng, x.shape)
    jvp = resident_tess.jacobian_vector_product({"x": x}, ["x"], ["y"], {"x": t})
    jac = net.jacobian(inputs, "x")
    np.testing.assert_allclose(
        jvp["y"], np.tensordot(jac, t, axes=2), rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(
        resident_tess.jacobian({"x": x}, ["x"], ["y"])["y"]["x"],
        jac,
        rtol=RTOL,
        atol=ATOL,
    )
    abstract = resident_tess.abstract_eval(
        {"x": {"shape": [2, 9, 6], "dtype": "float32"}}
    )
    assert abstract["y"] == {"shape": (2, 9, 3), "dtype": "float32"}


def test_resident_with_int8_activations_and_batch_axes(resident_tess, model, rng):
    _, layers = model
    x = net.normal(rng, (2, 3, 6))
    inputs = {"x": x, "layers": layers, "quantize_activations": True}
    out = resident_tess.apply({"x": x, "quantize_activations": True})
    np.testing.assert_allclose(out["y"], net.forward(inputs), rtol=RTOL, atol=ATOL)


def test_request_layers_still_run_instead_of_the_resident_model(resident_tess, rng):
    inputs = net.three_layer(rng)
    out = resident_tess.apply(inputs)
    np.testing.assert_allclose(out["y"], net.forward(inputs), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "call, expected",
    [
        (
            lambda t, x, g: t.vector_jacobian_product(
                {"x": x}, ["layers.[0].w"], ["y"], {"y": g}
            ),
            ["layers.[0].w", "resident model"],
        ),
        (
            lambda t, x, g: t.jacobian({"x": x}, ["layers.[1].bias"], ["y"]),
            ["layers.[1].bias", "resident model"],
        ),
        (
            lambda t, x, g: t.apply({"x": x[:, :5]}),
            ["resident model", "width 5", "layers.[0]"],
        ),
    ],
    ids=["vjp-weights", "jacobian-bias", "x-width"],
)
def test_resident_refusals_name_the_field(resident_tess, rng, call, expected):
    x = net.normal(rng, (4, 6))
    g = net.normal(rng, (4, 3))
    with pytest.raises(Exception) as error:  # the client's pydantic ValidationError
        call(resident_tess, x, g)
    for text in expected:
        assert text in str(error.value), str(error.value)


def test_resident_arrays_are_int8_and_scales_only(model):
    """The device holds the int8 payload and one scale per row: ~25% of f32."""
    from qarray.tesseract.internal import load_resident

    path, layers = model
    resident = load_resident(str(path))
    held = sum(a.qvalue.nbytes + a.scale.nbytes for a in resident.layers)
    shapes = [layer.weights.shape for layer in load_model(path)]
    # exactly one int8 per weight and one float32 per row: 25% + 1/n of f32
    assert held == sum(rows * n + 4 * rows for rows, n in shapes)
    assert all(layer.qvalue.dtype == np.int8 for layer in resident.layers)
    assert all(layer.weight is None for layer in resident.layers)
    # the dense layer was quantized at load with qarray's numerics
    qvalue, scale = ref.quantize(layers[0]["w"])
    np.testing.assert_array_equal(resident.layers[0].qvalue, qvalue)
    np.testing.assert_allclose(resident.layers[0].scale, scale, rtol=1.2e-7)


def test_resident_network_shape_is_found_once_per_shape_of_x(model, monkeypatch):
    """Every request on the resident model checks x against it: the shapes
    are found once per shape of x, equal to network_shape's, and a shape
    that does not fit is refused every time."""
    from qarray.network import _shapes
    from qarray.tesseract import Runtime, Settings, _runtime

    path, _ = model
    runtime = Runtime.from_settings(Settings.from_env({"QARRAY_MODEL": str(path)}))
    calls = []

    def counted(x, layers, adapters=None):
        calls.append(x)
        return _shapes.network_shape(x, layers, adapters)

    monkeypatch.setattr(_runtime, "network_shape", counted)
    first = runtime.resident_network_shape((2, 6))
    assert runtime.resident_network_shape((2, 6)) is first
    assert first == _shapes.network_shape((2, 6), runtime.resident_shapes)
    assert first.y == (2, 3)
    assert runtime.resident_network_shape((4, 1, 6)).y == (4, 1, 3)
    assert calls == [(2, 6), (4, 1, 6)]
    for _ in range(2):
        with pytest.raises(ValueError, match="K = 6"):
            runtime.resident_network_shape((2, 5))
    assert calls[2:] == [(2, 5), (2, 5)]


# --- the loader's errors name the tensor at fault


def _write(path, tensors, metadata=None):
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata=metadata)
    return path


F32 = np.ones((4, 3), np.float32)


@pytest.mark.parametrize(
    "tensors, metadata, expected",
    [
        ({}, None, "no layers"),
        ({"layers.1.w": F32}, None, "layers.0.w is missing"),
        ({"layers.0.w": F32.astype(np.float64)}, None, "layers.0.w must be float32"),
        ({"layers.0.w": F32[0]}, None, "layers.0.w must be float32 of rank 2"),
        (
            {"layers.0.w_q.qvalue": np.ones((4, 3), np.int8)},
            None,
            "layers.0.w_q.scale is missing",
        ),
        (
            {
                "layers.0.w_q.qvalue": np.ones((4, 3), np.int8),
                "layers.0.w_q.scale": np.ones(3, np.float32),
            },
            None,
            "layers.0.w_q.scale must have shape (4,)",
        ),
        (
            {"layers.0.w": F32, "layers.0.w_q.qvalue": np.ones((4, 3), np.int8)},
            None,
            "exactly one of layers.0.w and",
        ),
        (
            {"layers.0.w": F32, "layers.1.w": np.ones((5, 2), np.float32)},
            None,
            "layers.1 has input width 5",
        ),
        (
            {"layers.0.w": F32, "layers.0.bias": np.ones(4, np.float32)},
            None,
            "layers.0.bias must have shape (3,)",
        ),
        ({"layers.0.w": F32}, {"layers.0.layout": "mn"}, "layers.0.layout"),
        ({"layers.0.w": F32}, {"layers.0.activation": "elu"}, "layers.0.activation"),
        ({"layers.0.weight": F32}, None, "unexpected tensor 'layers.0.weight'"),
        (
            {"layers.0.w": np.full((4, 3), np.nan, np.float32)},
            None,
            "layers.0.w has NaN",
        ),
    ],
    ids=[
        "empty",
        "gap",
        "dtype",
        "rank",
        "missing-scale",
        "scale-shape",
        "both",
        "chain",
        "bias",
        "layout",
        "activation",
        "unknown",
        "nan",
    ],
)
def test_loader_errors_name_the_tensor(tmp_path, tensors, metadata, expected):
    path = _write(tmp_path / "bad.safetensors", tensors, metadata)
    with pytest.raises(ModelFileError) as error:
        load_model(path)
    assert expected in str(error.value)


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"not a model")
    with pytest.raises(ModelFileError, match="not a readable safetensors file"):
        load_model(path)
    with pytest.raises(ModelFileError, match="does not exist"):
        load_model(tmp_path / "missing.safetensors")


def test_server_with_a_bad_model_does_not_start(tmp_path):
    """Start-up fails naming the tensor: never a half-loaded server."""
    path = _write(
        tmp_path / "bad.safetensors",
        {"layers.0.w": F32, "layers.1.w": np.ones((5, 2), np.float32)},
    )
    env = {
        **os.environ,
        "TESSERACT_API_PATH": str(ROOT / "tesseract_api.py"),
        "TESSERACT_OUTPUT_PATH": str(tmp_path),
        "QARRAY_MODEL": str(path),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",
    }
    result = subprocess.run(
        [str(SERVE), "serve", "--host", "127.0.0.1", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "layers.1 has input width 5" in result.stdout + result.stderr


# --- the converter: a PyTorch-style state dict written here (no torch needed)


def pytorch_state_dict(rng, path):
    """nn.Sequential-like naming and layout: fc1 (6 -> 8), fc2 (8 -> 3)."""
    tensors = {
        "fc1.weight": rng.standard_normal((8, 6)).astype(np.float32),
        "fc1.bias": rng.standard_normal(8).astype(np.float32),
        "fc2.weight": rng.standard_normal((3, 8)).astype(np.float32),
        "fc2.bias": rng.standard_normal(3).astype(np.float32),
        "num_batches_tracked": np.zeros((), np.int64),  # ignored: not a layer
    }
    _write(path, tensors)
    return tensors


def test_convert_a_pytorch_state_dict(tmp_path, rng):
    sd = pytorch_state_dict(rng, tmp_path / "sd.safetensors")
    errors = convert_state_dict(
        tmp_path / "sd.safetensors",
        tmp_path / "model.safetensors",
        [("fc1", "relu"), ("fc2", "none")],
    )
    loaded = load_model(tmp_path / "model.safetensors")
    assert [(m.layout, m.activation) for m in loaded] == [
        ("nk", "relu"),
        ("nk", "none"),
    ]
    for layer, name, error in zip(loaded, ("fc1", "fc2"), errors, strict=True):
        # one scale per output channel: the rows of (out, in)
        qvalue, scale = ref.quantize(sd[f"{name}.weight"])
        np.testing.assert_array_equal(layer.qvalue, qvalue)
        np.testing.assert_allclose(layer.scale, scale, rtol=1.2e-7)
        np.testing.assert_array_equal(layer.bias, sd[f"{name}.bias"])
        assert error == pytest.approx(net.weight_error(sd[f"{name}.weight"]), rel=1e-4)
        assert 0 < error < 0.01

    # the converted model computes PyTorch's forward pass: relu(x W1^T + b1) W2^T + b2
    x = rng.standard_normal((5, 6)).astype(np.float32)
    w1 = ref.dequantize(loaded[0].qvalue, loaded[0].scale).astype(np.float64)
    w2 = ref.dequantize(loaded[1].qvalue, loaded[1].scale).astype(np.float64)
    torch_like = np.maximum(x @ w1.T + sd["fc1.bias"], 0) @ w2.T + sd["fc2.bias"]
    layers = [
        {"w_q": {"qvalue": m.qvalue, "scale": m.scale}, "bias": m.bias,
         "layout": "nk", "activation": m.activation}
        for m in loaded
    ]  # fmt: skip
    np.testing.assert_allclose(
        net.forward({"x": x, "layers": layers}), torch_like, rtol=1e-6, atol=1e-6
    )


def test_convert_command_line(tmp_path, rng):
    pytorch_state_dict(rng, tmp_path / "sd.safetensors")
    command = [str(SERVE), "convert", str(tmp_path / "sd.safetensors")]
    ok = subprocess.run(
        [*command, str(tmp_path / "m.safetensors"), "--layers", "fc1:relu,fc2:none"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "layers.0 <- fc1 (relu): weight error" in ok.stdout
    assert load_model(tmp_path / "m.safetensors")[1].activation == "none"
    for layers, expected in (
        ("fc1:relu,fc3:none", "no tensor fc3.weight (weights found: fc1.weight"),
        ("fc2:relu,fc1:none", "layers.1 has input width 6"),
        ("fc1:elu", "activation must be one of"),
    ):
        bad = subprocess.run(
            [*command, str(tmp_path / "x.safetensors"), "--layers", layers],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 2
        assert expected in bad.stderr, bad.stderr
    assert not (tmp_path / "x.safetensors").exists()


def test_convert_tree_command_line(tmp_path, rng):
    pytorch_cnn_state_dict(rng, tmp_path / "sd.safetensors")
    command = [
        str(SERVE),
        "convert",
        str(tmp_path / "sd.safetensors"),
        str(tmp_path / "m.safetensors"),
    ]
    ok = subprocess.run(
        [*command, "--tree", "--fold", "conv1+bn1,features.0+bn2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "conv1: int8, weight error" in ok.stdout
    bad = subprocess.run(
        [*command, "--tree", "--fold", "conv1+bn9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "cannot fold 'bn9' into 'conv1'" in bad.stderr
    both = subprocess.run(
        [*command, "--fold", "conv1+bn1", "--layers", "a:relu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert both.returncode == 2 and "need --tree" in both.stderr


# --- over HTTP: requests carry only x


@pytest.fixture(scope="module")
def served_model(tmp_path_factory, model):
    path, layers = model
    tmp = tmp_path_factory.mktemp("resident-server")
    with serve(tmp, env={"QARRAY_MODEL": str(path)}) as url:
        yield url, layers


def test_resident_over_http_with_only_x(served_model, rng):
    url, layers = served_model
    x = net.normal(rng, (16, 6))
    inputs = {"x": x, "layers": layers}
    body = json.dumps({"inputs": {"x": b64(x)}})
    response = requests.post(
        f"{url}/apply",
        data=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 200, response.text[:2000]
    np.testing.assert_allclose(
        decode(response.json())["y"], net.forward(inputs), rtol=RTOL, atol=ATOL
    )
    g = net.normal(rng, (16, 3))
    response = requests.post(
        f"{url}/vector_jacobian_product",
        json={
            "inputs": {"x": b64(x)},
            "vjp_inputs": ["x"],
            "vjp_outputs": ["y"],
            "cotangent_vector": {"y": b64(g)},
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text[:2000]
    np.testing.assert_allclose(
        decode(response.json())["x"], net.vjp(inputs, g)["x"], rtol=RTOL, atol=ATOL
    )
    refused = requests.post(
        f"{url}/vector_jacobian_product",
        json={
            "inputs": {"x": b64(x)},
            "vjp_inputs": ["layers.[0].w"],
            "vjp_outputs": ["y"],
            "cotangent_vector": {"y": b64(g)},
        },
        timeout=60,
    )
    assert refused.status_code == 422
    assert "layers.[0].w" in refused.text and "resident model" in refused.text
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_resident_memory_is_a_quarter_of_float32(tmp_path):
    """A server that loads 4 x (2048, 2048) dense float32 layers (64 MiB) holds
    about their int8 payload (16 MiB) once started, not the float32 weights:
    its resident memory against the same server loading a one-layer model
    (both started jax's backend and ran the same loader)."""
    rng = np.random.default_rng(11)
    big = [
        {"w": net.normal(rng, (2048, 2048)), "layout": "nk", "activation": "relu"}
        for _ in range(4)
    ]
    dense = sum(layer["w"].nbytes for layer in big)
    save_model(tmp_path / "big.safetensors", big)
    del big
    save_model(tmp_path / "tiny.safetensors", [{"w": net.normal(rng, (8, 8))}])
    rss = {}
    for name in ("tiny", "big"):
        (tmp_path / name).mkdir()
        env = {"QARRAY_MODEL": str(tmp_path / f"{name}.safetensors")}
        with serve(tmp_path / name, env=env) as url:
            rss[name] = server_rss(url)
    grew = rss["big"] - rss["tiny"]
    print(
        f"resident model: RSS +{grew / 2**20:.1f} MiB for {dense / 2**20:.0f} MiB "
        f"of float32 weights (int8 payload {dense / 4 / 2**20:.0f} MiB)"
    )
    assert 0.15 * dense < grew < 0.4 * dense, (grew, dense)


def test_convert_to_int4_and_float32_layers(tmp_path, rng):
    """--precision int4 --group-size 2 for every layer, fc2 kept float32 by
    its own entry: the file's network computes PyTorch's forward pass on the
    int4 (per group) and float32 weights."""
    sd = pytorch_state_dict(rng, tmp_path / "sd.safetensors")
    command = [
        str(SERVE),
        "convert",
        str(tmp_path / "sd.safetensors"),
        str(tmp_path / "m.safetensors"),
    ]
    ok = subprocess.run(
        [
            *command,
            "--layers",
            "fc1:relu,fc2:none:float32",
            "--precision",
            "int4",
            "--group-size",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "layers.0 <- fc1 (relu, int4): weight error" in ok.stdout
    assert "layers.1 <- fc2 (none, float32): weight error 0.000e+00" in ok.stdout
    stored = load_model(tmp_path / "m.safetensors")
    assert stored[0].precision == "int4" and stored[0].qvalue.dtype == np.uint8
    assert stored[0].qvalue.shape == (8, 3) and stored[0].scale.shape == (8, 3)
    assert stored[1].precision == "float32" and stored[1].w is not None
    network = load_network(tmp_path / "m.safetensors")
    x = rng.standard_normal((5, 6)).astype(np.float32)
    w1 = ref.roundtrip4(sd["fc1.weight"], 2).astype(np.float64)
    want = (
        np.maximum(x @ w1.T + sd["fc1.bias"], 0) @ sd["fc2.weight"].T + sd["fc2.bias"]
    )
    np.testing.assert_allclose(network(x), want, rtol=1e-5, atol=1e-5)
    bad = subprocess.run(
        [*command, "--layers", "fc1:relu", "--precision", "int4", "--group-size", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "which --group-size 4 does not divide" in bad.stderr


def test_int4_model_files_are_checked(tmp_path, rng):
    w = rng.standard_normal((4, 8)).astype(np.float32)
    values, scale = ref.quantize4(w, 4)
    good = {"layers.0.w_q.qvalue": ref.pack4(values), "layers.0.w_q.scale": scale}
    meta = {
        "layers.0.layout": "nk",
        "layers.0.precision": "int4",
        "layers.0.group_size": "4",
    }
    cases = [
        (good, {**meta, "layers.0.layout": "kn"}, "needs layout 'nk'"),
        (good, {**meta, "layers.0.group_size": "3"}, "positive even int"),
        (good, {**meta, "layers.0.precision": "int2"}, "precision must be one of"),
        ({**good, "layers.0.w_q.scale": scale[:, :1]}, meta, r"w_q.scale \(4, 2\)"),
        ({**good, "layers.0.w_q.qvalue": values}, meta, "must be uint8"),
        (
            {"layers.0.w_q.qvalue": values, "layers.0.w_q.scale": scale[:, 0]},
            {**meta, "layers.0.precision": "float32"},
            "stores dense",
        ),
    ]
    for i, (tensors, metadata, match) in enumerate(cases):
        path = tmp_path / f"bad{i}.safetensors"
        _write(path, tensors, metadata)
        with pytest.raises(ModelFileError, match=match):
            load_model(path)
    path = tmp_path / "good.safetensors"
    _write(path, good, meta)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    want = x @ ref.dequantize4(values, scale).T
    np.testing.assert_allclose(load_network(path)(x), want, rtol=1e-5, atol=1e-5)


def test_a_resident_int4_model_keeps_a_seventh_of_float32s_bytes(tmp_path, rng):
    """4 x (4096, 4096) int4 layers (G = 128) with biases, loaded by
    QARRAY_MODEL's loader: at most 14% of the float32 model's device bytes."""
    import jax

    from qarray.tesseract.internal import load_resident

    n, layers = 4096, []
    for _ in range(4):
        packed = rng.integers(0, 256, (n, n // 2), dtype=np.uint8)
        packed[packed & 0xF == 8] ^= 1  # nibble -8 is outside [-7, 7]
        packed[packed >> 4 == 8] ^= 16
        scale = rng.uniform(0.01, 0.1, (n, n // 128)).astype(np.float32)
        layers.append({"w_q": {"qvalue": packed, "scale": scale}, "layout": "nk",
                       "precision": "int4", "group_size": 128, "activation": "relu",
                       "bias": rng.standard_normal(n).astype(np.float32)})  # fmt: skip
    save_model(tmp_path / "m.safetensors", layers)
    network = load_resident(str(tmp_path / "m.safetensors"))
    device = sum(a.nbytes for a in jax.tree.leaves(network))
    float32 = 4 * (n * n + n) * 4
    assert device <= 0.14 * float32, device / float32
    assert network.layers[0].qvalue.dtype == np.uint8
