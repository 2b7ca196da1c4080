"""test_cases/*.json through `tesseract-runtime test`, and check-gradients."""

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.server import ROOT, RUNTIME, b64, decode

CASES = sorted((ROOT / "test_cases").glob("*.json"))


def runtime(tmp_path, *args):
    env = {
        **os.environ,
        "TESSERACT_API_PATH": str(ROOT / "tesseract_api.py"),
        "TESSERACT_OUTPUT_PATH": str(tmp_path),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",
    }
    return subprocess.run(
        [str(RUNTIME), *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_golden_files_are_what_the_generator_writes(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_test_cases.py"), str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.json"))
    committed = sorted(
        p.relative_to(ROOT / "test_cases")
        for p in (ROOT / "test_cases").rglob("*.json")
    )
    assert written == committed
    for rel in written:
        assert filecmp.cmp(tmp_path / rel, ROOT / "test_cases" / rel, shallow=False), (
            rel
        )


def test_cases_cover_the_contract():
    specs = {p.stem: json.loads(p.read_text()) for p in CASES}
    assert {s["endpoint"] for s in specs.values()} == {
        "apply",
        "vector_jacobian_product",
        "jacobian_vector_product",
        "jacobian",
        "abstract_eval",
    }
    errors = [s for s in specs.values() if s.get("expected_exception")]
    regexes = [s["expected_exception_regex"] for s in errors]
    assert any("exactly one of w and w_q" in regex for regex in regexes)
    assert len(errors) >= 2
    networks = [
        s["payload"]["inputs"]
        for s in specs.values()
        if not s.get("expected_exception") and s["endpoint"] != "abstract_eval"
    ]
    assert all(len(inputs["layers"]) == 3 for inputs in networks)
    layouts = {layer["layout"] for inputs in networks for layer in inputs["layers"]}
    assert layouts == {"kn", "nk"}
    assert any(inputs.get("quantize_activations") for inputs in networks)


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_regression_case(tmp_path, case):
    result = runtime(tmp_path, "test", f"@{case}")
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout)
    assert outcome["status"] == "passed", outcome["message"]


GRADIENTS = ROOT / "test_cases/check_gradients"


def exact_paths(inputs):
    """The exact-gradient paths of a request: x, every bias and w_q.scale."""
    paths = ["x"]
    for i, layer in enumerate(inputs["layers"]):
        if "w_q" in layer:
            paths.append(f"layers.[{i}].w_q.scale")
        if "bias" in layer:
            paths.append(f"layers.[{i}].bias")
    return paths


def check_gradients(tmp_path, inputs: Path, eps: dict[str, float], *extra):
    """check-gradients of ``inputs`` on the paths of ``eps``, each with its step.

    The steps are the generator's (scripts/make_test_cases.py): larger than
    tesseract-core's default (1e-4), which float32 rounding of y swamps.
    """
    args = ["check-gradients", f"@{inputs}", "--seed", "0", "--no-show-progress"]
    for path, step in eps.items():
        args += ["--input-paths", path, "--eps-for", f"{path}={step}"]
    return runtime(tmp_path, *args, *extra)


def test_check_gradients_passes_for_exact_gradient_inputs(tmp_path):
    inputs = json.loads((GRADIENTS / "inputs.json").read_text())["inputs"]
    eps = json.loads((GRADIENTS / "eps.json").read_text())
    # a 3-layer network, both layouts, a nonlinearity after every layer, and
    # every exact path checked: x, each layer's bias and scale
    assert len(inputs["layers"]) == 3
    assert {layer["layout"] for layer in inputs["layers"]} == {"kn", "nk"}
    assert "none" not in {layer["activation"] for layer in inputs["layers"]}
    assert sorted(eps) == sorted(exact_paths(inputs))
    assert len(eps) == 7
    result = check_gradients(tmp_path, GRADIENTS / "inputs.json", eps)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = result.stdout + result.stderr  # the runtime prints to stderr
    for endpoint in ("jacobian", "jacobian_vector_product", "vector_jacobian_product"):
        assert f"Gradient check for {endpoint} passed" in report


def test_check_gradients_flags_the_straight_through_weights(tmp_path):
    """Negative control: w's gradient is straight-through, not the derivative of
    the quantized function (flat between quantization steps), so finite
    differences must disagree with it. The same network as above, its first
    layer given as the dense weights its w_q dequantizes to."""
    inputs = json.loads((GRADIENTS / "inputs.json").read_text())["inputs"]
    w_q = decode(inputs["layers"][0].pop("w_q"))
    inputs["layers"][0]["w"] = b64(w_q["qvalue"] * w_q["scale"][..., None])
    path = tmp_path / "inputs.json"
    path.write_text(json.dumps({"inputs": inputs}))
    # steps below the quantization step (the scales, ~0.01)
    result = check_gradients(tmp_path, path, {"layers.[0].w": 1e-4})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Some gradient checks failed" in result.stdout + result.stderr
