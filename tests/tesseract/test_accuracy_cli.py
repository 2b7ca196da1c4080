"""qarray-serve evaluate and plan on a float32 model file: the report, the
mixed-precision file written, and the errors a user meets.

Covers: qarray/tesseract/_cli.py"""

import importlib.util
import json
import subprocess
import sys

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

import qarray.nn as qnn
from qarray.checkpoint import (
    load_model,
    load_network,
    load_quantized,
    save_model,
    save_tree,
)
from qarray.checkpoint.pytorch import convert_state_dict
from support import reference as ref
from support.server import SERVE


def float_model(rng, path):
    ws = [rng.standard_normal((32, 16)) / 4, rng.standard_normal((8, 32)) / 6]
    layers = [
        {
            "w": w.astype(np.float32),
            "layout": "nk",
            "activation": a,
            "bias": np.zeros(w.shape[0], np.float32),
        }
        for w, a in zip(ws, ("relu", "none"), strict=True)
    ]
    save_model(path, layers)
    return [w.astype(np.float32) for w in ws]


def run(*args):
    return subprocess.run(
        [str(SERVE), *map(str, args)], capture_output=True, text=True, timeout=300
    )


def test_evaluate_and_plan(tmp_path, rng):
    ws = float_model(rng, tmp_path / "m.safetensors")
    x = rng.standard_normal((50, 16)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x)
    out = run(
        "evaluate",
        tmp_path / "m.safetensors",
        tmp_path / "data.npz",
        "--precision",
        "int4",
        "--group-size",
        "8",
        "--json",
        tmp_path / "e.json",
    )
    assert out.returncode == 0, out.stderr
    assert "model: output rel L2" in out.stdout and "dB" in out.stdout
    report = json.loads((tmp_path / "e.json").read_text())
    assert [layer["precision"] for layer in report["layers"]] == ["int4", "int4"]
    w = ws[0].astype(np.float64)
    sqnr = 10 * np.log10(np.sum(w**2) / np.sum((w - ref.roundtrip4(ws[0], 8)) ** 2))
    assert abs(report["layers"][0]["weight_sqnr_db"] - sqnr) < 1e-2
    whole = report["model"]["output_rel_l2"]

    # a budget under all-int4's error: the plan spends bytes to meet it
    budget = whole / 2
    out = run(
        "plan",
        tmp_path / "m.safetensors",
        tmp_path / "data.npz",
        "--budget",
        budget,
        "--group-size",
        "8",
        "--out",
        tmp_path / "p.safetensors",
        "--json",
        tmp_path / "p.json",
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["model"]["output_rel_l2"] <= budget
    assert "plan: " in out.stdout and "wrote" in out.stdout
    stored = load_model(tmp_path / "p.safetensors")
    assert [layer.precision for layer in stored] == plan["precisions"]
    assert plan["precisions"] != ["int4", "int4"]
    # the file serves what the plan measured
    network = load_network(tmp_path / "p.safetensors")
    y_ref = np.maximum(x @ ws[0].T, 0) @ ws[1].T
    err = np.linalg.norm(np.asarray(network(x)) - y_ref) / np.linalg.norm(y_ref)
    assert abs(err - plan["model"]["output_rel_l2"]) < 1e-3 * max(err, 1e-3)


def test_clear_errors(tmp_path, rng):
    float_model(rng, tmp_path / "m.safetensors")
    np.savez(tmp_path / "bad.npz", inputs=np.zeros((2, 16), np.float32))
    np.savez(tmp_path / "narrow.npz", x=np.zeros((2, 5), np.float32))
    out = run("evaluate", tmp_path / "m.safetensors", tmp_path / "bad.npz")
    assert out.returncode == 2 and "no array 'x'" in out.stderr
    out = run("evaluate", tmp_path / "m.safetensors", tmp_path / "narrow.npz")
    assert (
        out.returncode == 2
        and "x (2, 5) does not fit the model" in out.stderr
        and "K = 16" in out.stderr
    )
    q, s = ref.quantize(rng.standard_normal((4, 16)).astype(np.float32))
    save_model(
        tmp_path / "q.safetensors", [{"w_q": {"qvalue": q, "scale": s}, "layout": "nk"}]
    )
    out = run(
        "plan",
        tmp_path / "q.safetensors",
        tmp_path / "narrow.npz",
        "--budget",
        "0.1",
        "--out",
        tmp_path / "o.safetensors",
    )
    assert out.returncode == 2 and "stored quantized" in out.stderr


TREE_MODEL = """
import equinox as eqx
import jax


class Small(eqx.Module):
    conv: eqx.nn.Conv1d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv1d(2, 4, 3, padding=1, key=k1)
        self.head = eqx.nn.Linear(4 * 8, 3, key=k2)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.conv(x)).ravel())
"""


TOKEN_MODEL = """
import equinox as eqx
import jax
import jax.numpy as jnp


class Tokens(eqx.Module):
    embed: eqx.nn.Embedding
    gru: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(12, 8, key=k1)
        self.gru = eqx.nn.GRUCell(8, 8, key=k2)
        self.head = eqx.nn.Linear(8, 2, key=k3)

    def __call__(self, tokens):
        step = lambda h, t: (self.gru(self.embed(t), h), None)
        h, _ = jax.lax.scan(step, jnp.zeros(8), tokens)
        return self.head(h)
"""


def _small_module(tmp_path, source=TREE_MODEL, name="small"):
    """TREE_MODEL (written to tmp_path/small.py) imported."""
    (tmp_path / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(
        f"{name}_for_test", tmp_path / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"{name}_for_test"] = module
    spec.loader.exec_module(module)
    return module


def test_plan_of_a_token_model_file(tmp_path, rng):
    """Integer data (indices into an embedding) through evaluate and plan: a
    recurrent cell and the table searched over, the gradient not measured."""
    module = _small_module(tmp_path, TOKEN_MODEL, "tokens")
    model = module.Tokens(jax.random.key(2))
    save_tree(tmp_path / "f.safetensors", model)
    tokens = rng.integers(0, 12, (16, 5)).astype(np.int32)
    np.savez(tmp_path / "d.npz", x=tokens)
    like = f"{tmp_path / 'tokens.py'}:Tokens"
    args = [tmp_path / "f.safetensors", tmp_path / "d.npz", "--like", like]
    out = run(
        "plan", *args, "--budget", "10", "--group-size", "8",
        "--out", tmp_path / "p.safetensors", "--json", tmp_path / "p.json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "gradient rel L2 -" in out.stdout
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["precisions"] == ["int4"] * 3
    served = load_quantized(
        tmp_path / "p.safetensors", module.Tokens(jax.random.key(0))
    )
    want = qnn.apply_plan(model, report)
    np.testing.assert_allclose(
        jax.vmap(served)(tokens), jax.vmap(want)(tokens), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        np.asarray(served.embed.scale),
        ref.quantize4(np.asarray(model.embed.weight), 8)[1],
        rtol=1e-6,
    )
    out = run("plan", *args, "--budget", "0.1", "--metric", "gradient",
              "--out", tmp_path / "q.safetensors")  # fmt: skip
    assert out.returncode == 2 and "integer ones" in out.stderr


def test_plan_of_any_equinox_model_file(tmp_path, rng):
    """--like FILE.py:NAME: a float tree file in, a mixed-precision tree file
    out that load_quantized serves as planned."""
    module = _small_module(tmp_path)
    model = module.Small(jax.random.key(5))
    save_tree(tmp_path / "f.safetensors", model)
    x = rng.standard_normal((20, 2, 8)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    like = f"{tmp_path / 'small.py'}:Small"
    args = [tmp_path / "f.safetensors", tmp_path / "d.npz", "--like", like]
    out = run("evaluate", *args, "--precision", "int4", "--group-size", "6")
    assert out.returncode == 0, out.stderr
    # conv K = 6, head K = 32: the head cannot take groups of 6
    assert "int4" in out.stdout.splitlines()[1] and "int8" in out.stdout.splitlines()[2]
    out = run(
        "plan", *args, "--budget", "1e-9", "--out", tmp_path / "p.safetensors",
        "--json", tmp_path / "p.json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "p.json").read_text())["precisions"] == [
        "float32",
        "float32",
    ]
    out = run(
        "plan", *args, "--budget", "10", "--group-size", "6",
        "--out", tmp_path / "p.safetensors", "--json", tmp_path / "p.json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "p.json").read_text())["precisions"] == [
        "int4",
        "int8",
    ]
    served = load_quantized(tmp_path / "p.safetensors", module.Small(jax.random.key(0)))
    assert (served.conv.precision, served.head.precision) == ("int4", "int8")
    w = np.asarray(model.conv.weight).reshape(4, -1)
    np.testing.assert_allclose(
        np.asarray(served.conv.quantized().scale), ref.quantize4(w, 6)[1], rtol=1e-6
    )
    # errors a user meets: a bad spec, a quantized file, data that does not fit
    out = run("evaluate", tmp_path / "f.safetensors", tmp_path / "d.npz", "--like", "x")
    assert out.returncode == 2 and "FILE.py:NAME or module:NAME" in out.stderr
    out = run(
        "evaluate", tmp_path / "p.safetensors", tmp_path / "d.npz", "--like", like
    )
    assert out.returncode == 2 and "do not match the model's leaves" in out.stderr
    np.savez(tmp_path / "wide.npz", x=np.zeros((2, 3, 8), np.float32))
    out = run(
        "evaluate", tmp_path / "f.safetensors", tmp_path / "wide.npz", "--like", like
    )
    assert out.returncode == 2 and "x (2, 3, 8) does not fit the model" in out.stderr


def test_a_gptq_plan_of_an_equinox_model_file(tmp_path, rng):
    """--method gptq --calibration: the plan's layers quantized by GPTQ, the
    method recorded in the written file, and a network refused."""
    model = _small_module(tmp_path).Small(jax.random.key(5))
    save_tree(tmp_path / "f.safetensors", model)
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((20, 2, 8)).astype(np.float32))
    np.savez(tmp_path / "c.npz", x=rng.standard_normal((40, 2, 8)).astype(np.float32))
    like = f"{tmp_path / 'small.py'}:Small"
    args = [tmp_path / "f.safetensors", tmp_path / "d.npz", "--like", like]
    out = run(
        "plan", *args, "--budget", "10", "--group-size", "6", "--method", "gptq",
        "--calibration", tmp_path / "c.npz", "--out", tmp_path / "p.safetensors",
        "--json", tmp_path / "p.json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["method"] == "gptq" and report["precisions"] == ["int4", "int8"]
    with safe_open(str(tmp_path / "p.safetensors"), framework="numpy") as f:
        assert f.metadata()["method"] == "gptq"
    served = load_quantized(tmp_path / "p.safetensors", _small_module(tmp_path).Small(
        jax.random.key(0)))  # fmt: skip
    # the file holds what apply_plan builds in-process from the same data
    calibration = np.load(tmp_path / "c.npz")["x"]
    want = qnn.apply_plan(model, report, data=calibration)
    np.testing.assert_array_equal(served.conv.qvalue, want.conv.qvalue)
    np.testing.assert_allclose(served.conv.scale, want.conv.scale, rtol=1e-6)


def test_evaluate_a_pytorch_state_dict(tmp_path, rng):
    """--layers: the state dict converted in memory gives the report of the
    converted float32 file."""
    save_file(
        {
            "fc1.weight": rng.standard_normal((32, 16)).astype(np.float32) / 4,
            "fc1.bias": np.zeros(32, np.float32),
            "fc2.weight": rng.standard_normal((8, 32)).astype(np.float32) / 6,
        },
        str(tmp_path / "torch.safetensors"),
    )
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((10, 16)).astype(np.float32))
    out = run(
        "evaluate", tmp_path / "torch.safetensors", tmp_path / "d.npz",
        "--layers", "fc1:relu,fc2", "--json", tmp_path / "a.json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    layers = [("fc1", "relu"), ("fc2", "none")]
    convert_state_dict(
        tmp_path / "torch.safetensors", tmp_path / "f.safetensors", layers, "float32"
    )
    out = run(
        "evaluate", tmp_path / "f.safetensors", tmp_path / "d.npz",
        "--json", tmp_path / "b.json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a["model"] == b["model"] and len(a["layers"]) == 2
    out = run(
        "evaluate", tmp_path / "torch.safetensors", tmp_path / "d.npz",
        "--layers", "fc1:relu,fc9",
    )  # fmt: skip
    assert out.returncode == 2 and "no tensor fc9.weight" in out.stderr


def test_a_calibrated_convert(tmp_path, rng):
    """convert --tree --like --method awq --data: the file holds what
    qnn.quantize(method="awq") builds in-process, its method recorded; W8A8
    with --smoothquant --static keeps the input scales; the options need
    --like."""
    model = _small_module(tmp_path).Small(jax.random.key(5))
    save_tree(tmp_path / "f.safetensors", model)
    x = rng.standard_normal((20, 2, 8)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    like = f"{tmp_path / 'small.py'}:Small"
    src = [tmp_path / "f.safetensors", tmp_path / "q.safetensors", "--tree"]
    out = run(
        "convert", *src, "--like", like, "--method", "awq", "--data",
        tmp_path / "c.npz", "--precision", "int4", "--group-size", "6",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    with safe_open(str(tmp_path / "q.safetensors"), framework="numpy") as f:
        assert f.metadata()["method"] == "awq"
    skeleton = _small_module(tmp_path).Small(jax.random.key(0))
    served = load_quantized(tmp_path / "q.safetensors", skeleton)
    want = qnn.quantize(model, precision="int4", group_size=6, method="awq", data=x)
    np.testing.assert_array_equal(served.conv.qvalue, want.conv.qvalue)
    np.testing.assert_allclose(served.conv.channel_scale, want.conv.channel_scale)
    out = run(
        "convert", *src, "--like", like, "--activations", "int8",
        "--smoothquant", "0.5", "--static", "tensor", "--data", tmp_path / "c.npz",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    served = load_quantized(tmp_path / "q.safetensors", skeleton)
    assert served.head.activations == "int8"
    assert served.head.activation_scale is not None
    out = run("convert", *src, "--method", "gptq")
    assert out.returncode == 2 and "with --tree need --like" in out.stderr
    out = run("convert", *src, "--like", like, "--method", "gptq")
    assert out.returncode == 2 and "needs data=X" in out.stderr


def _float_forward(ws, x):
    """The float network of ``float_model`` in NumPy (relu, then linear)."""
    h = np.maximum(x.astype(np.float64) @ ws[0].T.astype(np.float64), 0)
    return h @ ws[1].T.astype(np.float64)


def test_network_files_calibrated(tmp_path, rng):
    """evaluate / plan / convert --method gptq on the contract's network file:
    GPTQ's int4 output error below round-to-nearest's (NumPy), its plan no
    dearer than RTN's, and the converted file QARRAY_MODEL serves computing
    the float network within GPTQ's error."""
    # correlated inputs with skewed channels: where GPTQ's error feedback pays
    mix = rng.standard_normal((16, 16)) * np.geomspace(0.1, 3, 16)
    x = (rng.standard_normal((200, 16)) @ mix).astype(np.float32)
    ws = float_model(rng, tmp_path / "m.safetensors")
    np.savez(tmp_path / "x.npz", x=x)
    model, data = tmp_path / "m.safetensors", tmp_path / "x.npz"
    want = _float_forward(ws, x)
    rtn = _float_forward([ref.roundtrip4(w, 8) for w in ws], x)
    rtn_error = np.linalg.norm(rtn - want) / np.linalg.norm(want)

    out = run(
        "evaluate", model, data, "--precision", "int4", "--group-size", "8",
        "--method", "gptq", "--json", tmp_path / "gptq.json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    gptq_error = json.loads((tmp_path / "gptq.json").read_text())["model"]
    assert gptq_error["output_rel_l2"] < 0.9 * rtn_error, (gptq_error, rtn_error)

    out = run(
        "plan", model, data, "--budget", rtn_error / 2, "--group-size", "8",
        "--method", "gptq", "--out", tmp_path / "p.safetensors",
        "--json", tmp_path / "plan.json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["compared"]["gptq"] <= plan["compared"]["rtn"]
    assert plan["bytes"] == min(plan["compared"].values())
    got = np.asarray(load_network(tmp_path / "p.safetensors")(x), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= rtn_error / 2

    # a PyTorch state dict converted with GPTQ: a network file that serves
    save_file({"fc1.weight": ws[0], "fc2.weight": ws[1]}, str(tmp_path / "sd.st"))
    dst = tmp_path / "g.safetensors"
    out = run(
        "convert", tmp_path / "sd.st", dst, "--layers", "fc1:relu,fc2",
        "--precision", "int4", "--group-size", "8", "--method", "gptq",
        "--data", data,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert [layer.precision for layer in load_model(dst)] == ["int4", "int4"]
    got = np.asarray(load_network(dst)(x), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.9 * rtn_error
    out = run(
        "convert", tmp_path / "sd.st", tmp_path / "q.safetensors",
        "--layers", "fc1:relu,fc2", "--method", "gptq",
    )  # fmt: skip
    assert out.returncode == 2 and "calibrate on --data" in out.stderr
