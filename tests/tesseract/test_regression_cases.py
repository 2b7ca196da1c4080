"""test_cases/*.json through `tesseract-runtime test`, and check-gradients."""

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tesseract.server import ROOT, RUNTIME

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


def test_cases_include_an_expected_exception():
    specs = [json.loads(p.read_text()) for p in CASES]
    assert any(s.get("expected_exception") for s in specs)
    assert {s["endpoint"] for s in specs} == {
        "apply",
        "vector_jacobian_product",
        "jacobian_vector_product",
        "jacobian",
        "abstract_eval",
    }


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_regression_case(tmp_path, case):
    result = runtime(tmp_path, "test", f"@{case}")
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout)
    assert outcome["status"] == "passed", outcome["message"]


EXACT = ["x", "bias", "w_q.scale"]


def check_gradients(tmp_path, inputs: Path, paths):
    # tesseract-core's default step (1e-4): weight-only products keep the
    # activations at float32 precision, so finite differences see a smooth layer
    args = ["check-gradients", f"@{inputs}", "--seed", "0", "--no-show-progress"]
    for path in paths:
        args += ["--input-paths", path]
    return runtime(tmp_path, *args)


def test_check_gradients_passes_for_exact_gradient_inputs(tmp_path):
    result = check_gradients(
        tmp_path, ROOT / "test_cases/check_gradients/inputs.json", EXACT
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = result.stdout + result.stderr  # the runtime prints to stderr
    for endpoint in ("jacobian", "jacobian_vector_product", "vector_jacobian_product"):
        assert f"Gradient check for {endpoint} passed" in report


def test_check_gradients_flags_the_straight_through_weights(tmp_path):
    """Negative control: w's gradient is straight-through, not the derivative of
    the quantized function, so finite differences must disagree with it."""
    spec = json.loads((ROOT / "test_cases/apply_dense_weights.json").read_text())
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({"inputs": spec["payload"]["inputs"]}))
    result = check_gradients(tmp_path, inputs, ["w"])
    assert result.returncode == 1
    assert "Some gradient checks failed" in result.stdout + result.stderr
