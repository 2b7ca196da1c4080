"""Write test_cases/*.json: regression specs for `tesseract-runtime test`.

Expected outputs come from the independent NumPy reference (tests/reference.py),
never from the Tesseract itself. Inputs are drawn from a fixed seed, so running
this script again reproduces the files byte for byte (a test checks that):

    .venv/bin/python scripts/make_test_cases.py [OUT_DIR]   # default: test_cases/
"""

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import reference as ref  # noqa: E402
from tests.tesseract.server import b64  # noqa: E402

RTOL, ATOL = 1e-4, 1e-4


def encode(tree):
    if isinstance(tree, dict):
        return {k: encode(v) for k, v in tree.items()}
    if isinstance(tree, np.ndarray | np.generic):
        return b64(np.asarray(tree))
    return tree


def spec(endpoint, payload, expected=None, exception=None, regex=None):
    out = {"endpoint": endpoint, "payload": encode(payload)}
    if exception is None:
        out |= {"expected_outputs": encode(expected), "rtol": RTOL, "atol": ATOL}
    else:
        out |= {"expected_exception": exception, "expected_exception_regex": regex}
    return out


def main(out: Path):
    rng = np.random.default_rng(20261129)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    bias = rng.standard_normal(4).astype(np.float32)
    qvalue, scale = ref.quantize(w)
    wq = ref.dequantize(qvalue, scale).astype(np.float64)
    y = (ref.matmul_q(x, qvalue, scale) + bias).astype(np.float32)
    w64 = w.astype(np.float64)
    weight_error = np.float32(np.linalg.norm(w64 - wq) / np.linalg.norm(w64))
    g = rng.standard_normal(y.shape).astype(np.float32)
    tx = rng.standard_normal(x.shape).astype(np.float32)
    tw = rng.standard_normal(w.shape).astype(np.float32)
    gx, gw = ref.dense_vjp(x, wq, g)
    w_q = {"qvalue": qvalue, "scale": scale}

    cases = {
        "apply_dense_weights": spec(
            "apply",
            {"inputs": {"x": x, "w": w, "bias": bias}},
            {"y": y, "w_q": w_q, "weight_error": weight_error},
        ),
        "apply_quantized_weights_int8_activations": spec(
            "apply",
            {"inputs": {"x": x, "w_q": w_q, "activations": "int8"}},
            {
                "y": ref.matmul_q(x, qvalue, scale, "int8").astype(np.float32),
                "w_q": None,
                "weight_error": np.float32(0),
            },
        ),
        "vjp_quantized_weights": spec(
            "vector_jacobian_product",
            {
                "inputs": {"x": x, "w_q": w_q, "bias": bias},
                "vjp_inputs": ["x", "w_q.scale", "bias"],
                "vjp_outputs": ["y"],
                "cotangent_vector": {"y": g},
            },
            {
                "x": gx.astype(np.float32),
                "w_q.scale": np.sum(gw * qvalue, axis=1).astype(np.float32),
                "bias": g.sum(axis=0),
            },
        ),
        "vjp_dense_weights_straight_through": spec(
            "vector_jacobian_product",
            {
                "inputs": {"x": x, "w": w},
                "vjp_inputs": ["w"],
                "vjp_outputs": ["y"],
                "cotangent_vector": {"y": g},
            },
            {"w": gw.astype(np.float32)},
        ),
        "jvp_dense_weights": spec(
            "jacobian_vector_product",
            {
                "inputs": {"x": x, "w": w, "bias": bias},
                "jvp_inputs": ["x", "w"],
                "jvp_outputs": ["y"],
                "tangent_vector": {"x": tx, "w": tw},
            },
            {"y": ref.dense_jvp(x, wq, tx, tw).astype(np.float32)},
        ),
        "jacobian_x": spec(
            "jacobian",
            {"inputs": {"x": x, "w": w}, "jac_inputs": ["x"], "jac_outputs": ["y"]},
            {"y": {"x": np.einsum("ij,an->inja", np.eye(3), wq).astype(np.float32)}},
        ),
        "abstract_eval": spec(
            "abstract_eval",
            {
                "inputs": {
                    "x": {"shape": [5, 2, 8], "dtype": "float32"},
                    "w": {"shape": [8, 4], "dtype": "float32"},
                }
            },
            {
                "y": {"shape": [5, 2, 4], "dtype": "float32"},
                "w_q": {
                    "qvalue": {"shape": [8, 4], "dtype": "int8"},
                    "scale": {"shape": [8], "dtype": "float32"},
                },
                "weight_error": {"shape": [], "dtype": "float32"},
            },
        ),
        "error_both_weights": spec(
            "apply",
            {"inputs": {"x": x, "w": w, "w_q": w_q}},
            exception="pydantic.ValidationError",
            regex="give exactly one of w and w_q, got both",
        ),
        "error_contraction_mismatch": spec(
            "apply",
            {"inputs": {"x": x[:, :5], "w": w}},
            exception="pydantic.ValidationError",
            regex=r"x.shape\[-1\] must equal w.shape\[0\] \(K\), got x \(3, 5\) "
            r"and w \(8, 4\)",
        ),
    }
    out.mkdir(exist_ok=True)
    for name, case in cases.items():
        (out / f"{name}.json").write_text(json.dumps(case, indent=2) + "\n")

    # inputs for `tesseract-runtime check-gradients` (exact-gradient paths)
    gradients = {"inputs": {"x": x, "w_q": w_q, "bias": bias}}
    (out / "check_gradients").mkdir(exist_ok=True)
    (out / "check_gradients" / "inputs.json").write_text(
        json.dumps(encode(gradients), indent=2) + "\n"
    )
    print(f"wrote {len(cases)} cases and check_gradients/inputs.json to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "test_cases")
