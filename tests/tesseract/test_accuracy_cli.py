"""qarray-serve evaluate and plan on a float32 model file: the report, the
mixed-precision file written, and the errors a user meets."""

import json
import subprocess

import numpy as np

from qarray.checkpoint import load_model, load_network, save_model
from tests import reference as ref
from tests.tesseract.server import SERVE


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
        out.returncode == 2 and "does not fit the model's input width 16" in out.stderr
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
