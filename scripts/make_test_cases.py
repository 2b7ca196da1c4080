"""Write test_cases/*.json: regression specs for `tesseract-runtime test`.

Expected outputs come from the independent NumPy reference network
(support/network.py, built on support/reference.py), never from the
Tesseract itself. Inputs are drawn from a fixed seed, so running this script
again reproduces the files byte for byte (a test checks that):

    .venv/bin/python scripts/make_test_cases.py [OUT_DIR]   # default: test_cases/

The cases: a 3-layer network in each layout ("kn" and "nk", dense w and
pre-quantized w_q layers mixed, every nonlinearity somewhere), the int8 x int8
path (quantize_activations), vjp / jvp / jacobian / abstract_eval, and
requests the Tesseract must refuse. check_gradients/inputs.json is a 3-layer
network with smooth nonlinearities for `tesseract-runtime check-gradients`
on the exact-gradient paths (x, biases, w_q.scale).
"""

import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from support import network as net  # noqa: E402
from support import reference as ref  # noqa: E402
from support.server import b64  # noqa: E402

RTOL, ATOL = 1e-4, 1e-4
# int8 activations: the server rounds float32 activations, the reference
# float64 ones; a value this close (in quantization steps) to a rounding tie
# could round either way, so such draws are redrawn
TIE_MARGIN = 1e-3


def encode(tree):
    if isinstance(tree, dict):
        return {k: encode(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [encode(v) for v in tree]
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


def f32(a):
    return np.asarray(a, np.float32)


# --- expected outputs, from the reference network


def apply_outputs(inputs):
    """What apply returns: y and, when asked, per layer weight_error and w_q."""
    if not (inputs.get("return_w_q") or inputs.get("return_weight_error")):
        return {"y": f32(net.forward(inputs)), "layers": None}
    layers = []
    for layer in inputs["layers"]:
        if "w" not in layer:
            layers.append({"weight_error": np.float32(0), "w_q": None})
            continue
        w_q = None
        if inputs.get("return_w_q", False):
            qvalue, scale = ref.quantize(layer["w"])
            w_q = {"qvalue": qvalue, "scale": scale}
        error = np.float32(net.weight_error(layer["w"]))
        layers.append({"weight_error": error, "w_q": w_q})
    return {"y": f32(net.forward(inputs)), "layers": layers}


def jvp_output(inputs, tangents):
    """Tangent of y: sum over paths of the reference Jacobian times the tangent."""
    total = 0
    for path, t in tangents.items():
        jac = net.jacobian(inputs, path)
        total = total + np.tensordot(jac, t.astype(np.float64), axes=t.ndim)
    return {"y": f32(total)}


def tie_distance(inputs):
    """Smallest distance (in quantization steps) of any int8-quantized
    activation from a rounding tie, through the reference's forward pass."""
    x, layers = inputs["x"], inputs["layers"]
    _, trace = net.forward_one(x, layers, quantize_activations=True)
    closest = math.inf
    for layer, (h, _) in zip(layers, trace, strict=True):
        _, scale = net.quantized(layer)
        # "kn" folds the weights' per-row scales into h before quantizing it
        v = h * scale if layer.get("layout", "kn") == "kn" else h
        v = v.astype(np.float32).astype(np.float64)
        step = np.max(np.abs(v), axis=-1, keepdims=True) / 127
        ratio = v / np.where(step > 0, step, 1)
        closest = min(closest, np.min(np.abs(ratio - np.floor(ratio) - 0.5)))
    return closest


# --- check-gradients: a network whose finite differences resolve its Jacobian
#
# `tesseract-runtime check-gradients` compares each Jacobian entry with a
# central difference of the float32 server, elementwise at rtol 0.1. A
# difference carries the step's truncation error and float32 rounding of y
# divided by the step, so an entry near zero (a saturated unit, a product of
# small weights) fails whatever the gradient. The network is scaled like a
# trained one (weights ~ 1/sqrt(K), small biases: no saturation), x and
# biases are stepped by 0.03 and the scales (~0.01) by 3e-4, and the draw is
# kept only when, for every entry, the float64 reference's central difference
# plus a float32 rounding bound stays within FD_ERROR of the reference
# Jacobian: a fifth of check-gradients' tolerance.

GRADIENT_EPS = {"x": 0.03, "bias": 0.03, "scale": 3e-4}
FD_ERROR = 0.02


def gradient_network(rng):
    """A 3-layer network of w_q layers (both layouts) with smooth
    nonlinearities (relu's kink defeats finite differences)."""
    inputs = net.three_layer(
        rng,
        "kn",
        x_shape=(2, 4),
        widths=(4, 3, 2),
        kinds=("w_q", "w_q", "w_q"),
        activations=("tanh", "gelu", "silu"),
    )
    inputs["layers"][1] = net.make_layer(rng, 4, 3, "nk", "w_q", True, "gelu")
    for layer, k in zip(inputs["layers"], (4, 4, 3), strict=True):
        layer["w_q"]["scale"] = f32(layer["w_q"]["scale"] / np.sqrt(k))
        layer["bias"] = f32(layer["bias"] / 4)
    return inputs


def exact(inputs):
    """The exact-gradient paths of a request: x, biases and w_q.scale."""
    return [p for p in net.diff_paths(inputs) if not p.endswith(".w")]


def replaced(inputs, path, value):
    """A copy of a request with the array at ``path`` replaced."""
    out = {**inputs, "layers": [dict(layer) for layer in inputs["layers"]]}
    if path == "x":
        return out | {"x": value}
    i = int(path.split("[")[1].split("]")[0])
    layer = out["layers"][i]
    if path.endswith(".bias"):
        layer["bias"] = value
    else:
        layer["w_q"] = {**layer["w_q"], "scale": value}
    return out


def fd_error(inputs, eps):
    """The largest relative error check-gradients can see on any entry."""
    y = net.forward(inputs)
    worst = 0.0
    for path in exact(inputs):
        step = eps[path.rsplit(".", 1)[-1]]
        # ~4 float32 roundings of y, in the difference of two evaluations
        rounding = 2.0**-22 * max(1.0, np.abs(y).max()) / step
        a, jac = net.at(inputs, path), net.jacobian(inputs, path)
        for idx in np.ndindex(a.shape):
            plus, minus = a.copy(), a.copy()
            plus[idx] += np.float32(step)  # in float32, as the runtime steps
            minus[idx] -= np.float32(step)
            fd = (
                net.forward(replaced(inputs, path, plus))
                - net.forward(replaced(inputs, path, minus))
            ) / (2 * step)
            column = jac[(..., *idx)]
            nonzero = column != 0
            if nonzero.any():
                error = np.abs(fd - column)[nonzero] + rounding
                worst = max(worst, np.max(error / np.abs(column[nonzero])))
    return worst


def abstract(shape, dtype="float32"):
    return {"shape": list(shape), "dtype": dtype}


# --- the cases


def main(out: Path):
    rng = np.random.default_rng(20261129)

    # 3-layer networks: (3, 6) -> 5 -> 4 -> 2, dense and quantized layers mixed
    kn = net.three_layer(
        rng, "kn", kinds=("w", "w_q", "w"), activations=("relu", "tanh", "none")
    )
    kn["return_w_q"] = True
    nk = net.three_layer(
        rng, "nk", kinds=("w_q", "w", "w_q"), activations=("gelu", "sigmoid", "silu")
    )
    nk["return_weight_error"] = True
    while True:  # deterministic: the same rng draws again until no near-ties
        int8 = net.three_layer(
            rng,
            "kn",
            kinds=("w", "w_q", "w"),
            activations=("relu", "silu", "none"),
            quantize_activations=True,
        )
        int8["layers"][1] = net.make_layer(rng, 5, 4, "nk", "w_q", True, "silu")
        if tie_distance(int8) > TIE_MARGIN:
            break

    g_kn = net.normal(rng, net.forward(kn).shape)
    g_nk = net.normal(rng, net.forward(nk).shape)
    nk_tangents = {
        path: net.normal(rng, np.shape(net.at(nk, path)))
        for path in ("x", "layers.[0].w_q.scale", "layers.[1].w", "layers.[2].bias")
    }
    jac_paths = ["x", "layers.[1].w_q.scale", "layers.[2].bias"]

    def vjp_case(inputs, g):
        paths = net.diff_paths(inputs)
        want = net.vjp(inputs, g)
        return spec(
            "vector_jacobian_product",
            {
                "inputs": inputs,
                "vjp_inputs": paths,
                "vjp_outputs": ["y"],
                "cotangent_vector": {"y": g},
            },
            {path: f32(want[path]) for path in paths},
        )

    # one abstract network: an ensemble axis of 4 on the first layer's weights
    # (y[b] = net(x[b], params[b])), so every output carries the batch axes (4,)
    abstract_layers = [
        {"w": abstract((4, 6, 5)), "activation": "relu"},
        {
            "w_q": {"qvalue": abstract((3, 5), "int8"), "scale": abstract((3,))},
            "layout": "nk",
            "bias": abstract((3,)),
            "activation": "gelu",
        },
        {"w": abstract((2, 3)), "layout": "nk"},
    ]
    batch = (4,)

    both = net.three_layer(rng, "kn")
    both["layers"][1]["w"] = ref.dequantize(**both["layers"][1]["w_q"])
    mismatch = net.three_layer(rng, "nk", kinds=("w", "w", "w_q"))
    mismatch["layers"][2] = net.make_layer(rng, 3, 2, "nk", "w_q")
    no_bias = net.three_layer(rng, "kn")
    del no_bias["layers"][0]["bias"]

    cases = {
        "apply_three_layer_kn": spec("apply", {"inputs": kn}, apply_outputs(kn)),
        "apply_three_layer_nk": spec("apply", {"inputs": nk}, apply_outputs(nk)),
        "apply_three_layer_int8_activations": spec(
            "apply", {"inputs": int8}, apply_outputs(int8)
        ),
        "vjp_three_layer_kn": vjp_case(kn, g_kn),
        "vjp_three_layer_nk": vjp_case(nk, g_nk),
        "jvp_three_layer_nk": spec(
            "jacobian_vector_product",
            {
                "inputs": nk,
                "jvp_inputs": list(nk_tangents),
                "jvp_outputs": ["y"],
                "tangent_vector": nk_tangents,
            },
            jvp_output(nk, nk_tangents),
        ),
        "jacobian_three_layer_kn": spec(
            "jacobian",
            {"inputs": kn, "jac_inputs": jac_paths, "jac_outputs": ["y"]},
            {"y": {path: f32(net.jacobian(kn, path)) for path in jac_paths}},
        ),
        "abstract_eval_ensemble": spec(
            "abstract_eval",
            {
                "inputs": {
                    "x": abstract((4, 7, 6)),
                    "layers": abstract_layers,
                    "return_w_q": True,
                }
            },
            {
                "y": abstract((4, 7, 2)),
                "layers": [
                    {
                        "weight_error": abstract(batch),
                        "w_q": {
                            "qvalue": abstract((4, 6, 5), "int8"),
                            "scale": abstract((4, 6)),
                        },
                    },
                    {"weight_error": abstract(batch), "w_q": None},
                    {
                        "weight_error": abstract(batch),
                        "w_q": {
                            "qvalue": abstract((4, 2, 3), "int8"),
                            "scale": abstract((4, 2)),
                        },
                    },
                ],
            },
        ),
        "error_both_weights": spec(
            "apply",
            {"inputs": both},
            exception="pydantic.ValidationError",
            regex=r"layers\.\[1\] must give exactly one of w and w_q, got both",
        ),
        "error_width_mismatch": spec(
            "apply",
            {"inputs": mismatch},
            exception="pydantic.ValidationError",
            regex=r"layers\.\[2\]\.w_q\.qvalue \(2, 3\) has K = 3 \(layout 'nk': "
            r"\(\.\.\., N, K\)\), but its input is the output of layers\.\[1\] "
            r"of width 4",
        ),
        "error_vjp_path_not_given": spec(
            "vector_jacobian_product",
            {
                "inputs": no_bias,
                "vjp_inputs": ["x", "layers.[0].bias"],
                "vjp_outputs": ["y"],
                "cotangent_vector": {"y": net.normal(rng, (3, 2))},
            },
            # refused by the gradient-path check, before the endpoint runs
            exception="pydantic.ValidationError",
            regex=r"vjp_inputs: 'layers\.\[0\]\.bias' names an array this request "
            r"did not give",
        ),
    }
    out.mkdir(exist_ok=True)
    for name, case in cases.items():
        (out / f"{name}.json").write_text(json.dumps(case, indent=2) + "\n")

    # inputs for `tesseract-runtime check-gradients` on the exact-gradient
    # paths, and the finite-difference step for each path
    while True:
        gradients = gradient_network(rng)
        if fd_error(gradients, GRADIENT_EPS) < FD_ERROR:
            break
    eps = {path: GRADIENT_EPS[path.rsplit(".", 1)[-1]] for path in exact(gradients)}
    (out / "check_gradients").mkdir(exist_ok=True)
    (out / "check_gradients" / "inputs.json").write_text(
        json.dumps(encode({"inputs": gradients}), indent=2) + "\n"
    )
    (out / "check_gradients" / "eps.json").write_text(json.dumps(eps, indent=2) + "\n")
    print(f"wrote {len(cases)} cases and check_gradients/ to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "test_cases")
