"""examples/resident_saliency.py end to end, short: train a digits MLP, convert
its PyTorch-style state dict, serve it resident (the example's own server),
accuracy over HTTP with only x, saliency maps through tesseract-jax."""

import os
import re
import subprocess
import sys

import numpy as np
import psutil
import pytest
from safetensors import safe_open

from qarray.checkpoint import load_model
from support.server import ROOT, serve


def number(pattern, text) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in the output:\n{text}"
    return float(match.group(1).replace(",", ""))


def run_example(*args) -> str:
    # the example and its server on one CPU device (not the tests' forced 8)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "resident_saliency.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env | {"JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


SMALL = ("--steps", "300", "--batch", "150", "--digits", "3")


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """One short run with the example's own server: (output, workdir, plot)."""
    tmp_path = tmp_path_factory.mktemp("resident_example")
    plot, workdir = tmp_path / "saliency.png", tmp_path / "work"
    out = run_example(*SMALL, "--workdir", str(workdir), "--plot", str(plot))
    return out, workdir, plot


def test_resident_saliency_example(example):
    out, workdir, plot = example

    # the state dict has PyTorch's names and nn.Linear's (out, in) layout
    with safe_open(str(workdir / "state_dict.safetensors"), "numpy") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    assert shapes == {
        "fc1.weight": [64, 64],
        "fc1.bias": [64],
        "fc2.weight": [10, 64],
        "fc2.bias": [10],
    }
    model = load_model(workdir / "model.safetensors")
    assert [(m.layout, m.activation, m.qvalue.dtype) for m in model] == [
        ("nk", "relu", np.int8),
        ("nk", "none", np.int8),
    ]

    # the converter ran as a CLI and reported each layer's weight error
    errors = re.findall(r"layers\.(\d) <- (fc\d) \((\w+)\): weight error (\S+)", out)
    assert [e[:3] for e in errors] == [("0", "fc1", "relu"), ("1", "fc2", "none")]
    assert all(0 < float(e[3]) < 1e-2 for e in errors)

    # served int8 (requests of only x) classifies as well as float32
    f32 = number(r"float32 test accuracy: (\S+)", out)
    int8 = number(r"served int8 test accuracy: (\S+) ", out)
    assert int8 > 0.85  # chance is 0.1
    assert abs(int8 - f32) <= 0.02
    assert number(r"int8 network in JAX: max \|dy\| (\S+)", out) < 1e-4

    # wire bytes: only x is smaller than the same apply with the weights, and
    # all three give the same y (the server holds the converter's int8 weights)
    for rows in (1, 150):
        line = re.search(rf"wire bytes per apply of {rows} digit\(s\): .*", out)[0]
        only_x = number(r"only x \(resident\) ([\d,]+)", line)
        w_q = number(r"with int8 w_q layers ([\d,]+)", line)
        w = number(r"with float32 w layers ([\d,]+)", line)
        assert only_x < w_q < w
        assert number(r"same y: max \|dy\| (\S+)", line) < 1e-5
        # the int8 weights' payload alone: 4736 int8 + 74 scales + 74 biases
        assert w_q - only_x > (4736 + 4 * 148) * 4 / 3
    assert number(r"of 1 digit\(s\): only x \(resident\) ([\d,]+)", out) < 1000

    # saliency through tesseract-jax: the served int8 network's gradient, close
    # to float32's, and exactly the model file's int8 network's
    assert number(r"served int8 vs float32 min (\S+),", out) > 0.99
    assert number(r"int8 network in JAX: max relative diff (\S+)", out) < 1e-4

    # the figure, and the example's server is gone (stopped by its PID)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pid = int(number(r"server pid (\d+)", out))
    assert f"stopped the server (pid {pid})" in out
    assert not psutil.pid_exists(pid)
    assert re.search(r"^summary: test accuracy float32 \S+, served int8", out, re.M)


def test_resident_saliency_example_against_a_given_server(example, tmp_path):
    """--url: a server started with QARRAY_MODEL = the model file the first
    run wrote; the float32 weights are read back from the state dict."""
    first, workdir, _ = example
    model = workdir / "model.safetensors"
    with serve(tmp_path, env={"QARRAY_MODEL": str(model)}) as url:
        out = run_example(
            *SMALL, "--url", url, "--workdir", str(workdir),
            "--plot", str(tmp_path / "again.png"),
        )  # fmt: skip
    assert f"float32 weights read from {workdir / 'state_dict.safetensors'}" in out
    assert "training" not in out and "server pid" not in out
    summary = re.compile(r"^summary: (test accuracy .*?); wire", re.M)
    assert summary.search(out)[1] == summary.search(first)[1]  # the same network
    assert number(r"served int8 vs float32 min (\S+),", out) > 0.99
