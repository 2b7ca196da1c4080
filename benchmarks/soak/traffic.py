"""Good requests (fresh random arrays, their reference answers) and the
malformed ones each client mixes in."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from support import network as net
from support.server import (
    b64,
    encode,
)

from .networks import SPECS, Spec
from .references import jvp
from .settings import ATOL, RTOL, SCALE_TOL


class WrongAnswer(Exception):
    pass


def compare(got, want, spec, what, skip_rows=None):
    """The error as a fraction of its tolerance (<= 1 passes); raises
    WrongAnswer otherwise. ``skip_rows`` (mid networks): rows of a y-shaped
    answer left out, being near a tie or a kink."""
    got = np.asarray(got)
    if got.shape != np.shape(want):
        raise WrongAnswer(f"{what}: shape {got.shape}, want {np.shape(want)}")
    if got.dtype != np.float32:
        raise WrongAnswer(f"{what}: dtype {got.dtype}, want float32")
    if not np.all(np.isfinite(got)):
        raise WrongAnswer(f"{what}: non-finite values in the answer")
    diff = np.abs(got.astype(np.float64) - want)
    if spec.size == "small":
        fraction = float(np.max(diff / (ATOL + RTOL * np.abs(want)), initial=0))
        rule = f"rtol = atol = {RTOL}"
    else:
        scale = max(float(np.max(np.abs(want), initial=0)), 1e-30)
        if skip_rows is not None:
            diff = diff[~skip_rows]
        fraction = float(np.max(diff, initial=0)) / (SCALE_TOL * scale)
        rule = f"max |got - want| <= {SCALE_TOL} x max |want| = {SCALE_TOL * scale:.3g}"
    if not fraction <= 1:
        raise WrongAnswer(
            f"{what}: max |got - want| = {float(np.max(diff)):.4g} "
            f"({fraction:.3g} x the tolerance: {rule})"
        )
    return fraction


def weight_errors(inputs):
    """Each layer's weight_error as apply returns it: over the batch axes."""
    shape = net.batch_shape(inputs)
    out = [np.zeros(shape) for _ in inputs["layers"]]
    for b in np.ndindex(*shape):
        _, layers = net.example(inputs, b)
        for i, layer in enumerate(layers):
            if "w" in layer:
                out[i][b] = net.weight_error(layer["w"])
    return out


@dataclass
class Drawn:
    """One draw of a network: its arrays, encoded, and its excused rows."""

    spec: Spec
    inputs: dict
    excused: np.ndarray  # bool, y.shape[:-1]
    encoded: dict

    @classmethod
    def of(cls, spec, rng):
        inputs, excused = spec.draw(rng)
        return cls(spec, inputs, excused, encode(inputs))


@dataclass
class Good:
    """A request with its reference check."""

    drawn: Drawn
    endpoint: str
    payload: dict
    check: object  # decoded answer -> worst error as a fraction of tolerance


def good_request(drawn, endpoint, rng, wrt="all", fault=False):
    """A request to ``endpoint`` on a drawn network, with respect to every
    differentiable path (wrt="all") or x alone (wrt="x"): two compiled
    programs per network and gradient endpoint, not one per subset."""
    spec, inputs, excused = drawn.spec, drawn.inputs, drawn.excused
    paths = net.diff_paths(inputs) if wrt == "all" else ["x"]
    if endpoint == "apply":
        # the per-layer outputs are checked too: asked for
        payload = {"inputs": {**drawn.encoded, "return_weight_error": True}}

        def check(out):
            want = net.forward(inputs)
            if fault:  # --inject-fault wrong-answer: the reference moves a bit
                want = want.copy()
                want.flat[0] += 1.0
            worst = compare(out["y"], want, spec, "y", excused)
            if len(out["layers"]) != len(inputs["layers"]):
                raise WrongAnswer(f"{len(out['layers'])} layers in the answer")
            for i, want_error in enumerate(weight_errors(inputs)):
                got = np.asarray(out["layers"][i]["weight_error"])
                if got.shape != want_error.shape or not np.allclose(
                    got, want_error, rtol=1e-3, atol=1e-6
                ):
                    raise WrongAnswer(
                        f"layers.[{i}].weight_error: {got}, want {want_error}"
                    )
            return worst

    elif endpoint == "vector_jacobian_product":
        g = net.normal(rng, excused.shape + net.forward(inputs).shape[-1:])
        g[excused] = 0  # rows near a tie or kink contribute to no cotangent
        payload = {
            "inputs": drawn.encoded,
            "vjp_inputs": paths,
            "vjp_outputs": ["y"],
            "cotangent_vector": {"y": b64(g)},
        }

        def check(out):
            want = net.vjp(inputs, g)
            if set(out) != set(paths):
                raise WrongAnswer(f"paths {sorted(out)}, want {sorted(paths)}")
            return max(compare(out[p], want[p], spec, p) for p in paths)

    else:
        tangents = {p: net.normal(rng, np.shape(net.at(inputs, p))) for p in paths}
        payload = {
            "inputs": drawn.encoded,
            "jvp_inputs": paths,
            "jvp_outputs": ["y"],
            "tangent_vector": {p: b64(t) for p, t in tangents.items()},
        }

        def check(out):
            want = jvp(inputs, tangents)
            return compare(out["y"], want, spec, "y (tangent)", excused)

    return Good(drawn, endpoint, payload, check)


def _loc(*path):
    """FastAPI's location of a field at ``path`` in a 422."""
    return ",".join(f'"{p}"' if isinstance(p, str) else str(p) for p in path)


def _declared(*shape):
    return {
        "object_type": "array",
        "shape": list(shape),
        "dtype": "float32",
        "data": {"buffer": "AAAAAA==", "encoding": "base64"},
    }


def bad_requests(rng):
    """(name, endpoint, payload, fragments the 4xx must contain), built on a
    fresh valid 3-layer network: x (3, 6) -> [0] w (6, 5) relu ->
    [1] w_q (5, 4) tanh -> [2] w (4, 2), layout "kn", biases everywhere."""
    inputs = SPECS[0].build(rng)
    base = encode(inputs)

    def changed(edit):
        payload = json.loads(json.dumps(base))
        edit(payload)
        return payload

    def layer(i, **fields):
        def edit(p):
            p["layers"][i].update(fields)

        return changed(edit)

    x_nan = inputs["x"].copy()
    x_nan[1, 2] = np.nan
    truncated = b64(inputs["x"])
    truncated["data"]["buffer"] = truncated["data"]["buffer"][:-6]
    g = b64(net.normal(rng, (3, 2)))
    vjp = {"vjp_outputs": ["y"], "cotangent_vector": {"y": g}}
    return [
        (
            "k-mismatch",
            "apply",
            {"inputs": layer(2, w=b64(net.normal(rng, (6, 2))))},
            ["layers.[2].w (6, 2) has K = 6", "output of layers.[1] of width 4"],
        ),
        (
            "scale-shape",
            "apply",
            {
                "inputs": layer(
                    1,
                    w_q={
                        **base["layers"][1]["w_q"],
                        "scale": b64(np.ones(4, np.float32)),
                    },
                )
            },
            ["layers.[1].w_q.scale must have shape (5,)", "got (4,)"],
        ),
        (
            "negative-scale",
            "apply",
            {
                "inputs": layer(
                    1,
                    w_q={
                        **base["layers"][1]["w_q"],
                        "scale": b64(-np.ones(5, np.float32)),
                    },
                )
            },
            ["layers.[1].w_q.scale must be >= 0"],
        ),
        (
            "bias-shape",
            "apply",
            {"inputs": layer(0, bias=b64(net.normal(rng, (3,))))},
            ["layers.[0].bias must have shape (..., N) with N = 5", "got (3,)"],
        ),
        (
            "bad-activation",
            "apply",
            {"inputs": layer(1, activation="leaky_relu")},
            [_loc("inputs", "layers", 1, "activation"), "'relu'"],
        ),
        (
            "both-weights",
            "apply",
            {"inputs": layer(0, w_q=base["layers"][1]["w_q"])},
            ["layers.[0] must give exactly one of w and w_q, got both"],
        ),
        (
            "unknown-field",
            "apply",
            {"inputs": layer(1, weights=1)},
            [_loc("inputs", "layers", 1, "weights"), "Extra inputs are not permitted"],
        ),
        (
            "nan-x",
            "apply",
            {"inputs": dict(base, x=b64(x_nan))},
            ["x must be finite, got nan at index (1, 2) of x (3, 6)"],
        ),
        (
            "truncated-base64",
            "apply",
            {"inputs": dict(base, x=truncated)},
            [_loc("inputs", "x"), "base64"],
        ),
        (
            "too-many-layers",
            "apply",
            {
                "inputs": {
                    "x": b64(np.ones((1, 2), np.float32)),
                    "layers": [{"w": b64(np.eye(2, dtype=np.float32))}] * 65,
                }
            },
            ["layers has 65 layers, over the limit of 64 (QARRAY_MAX_LAYERS)"],
        ),
        (
            "over-work",
            "apply",
            {
                "inputs": {
                    "x": _declared(30000, 1024),
                    "layers": [{"w": _declared(1024, 1024)} for _ in range(4)],
                }
            },
            [
                "layers.[3] brings the request's work to 153600000 elements",
                "QARRAY_MAX_WORK",
            ],
        ),
        (
            "vjp-path-not-given",
            "vector_jacobian_product",
            {"inputs": base, "vjp_inputs": ["layers.[1].w"], **vjp},
            ["vjp_inputs: 'layers.[1].w' names an array this request did not give"],
        ),
        (
            "cotangent-shape",
            "vector_jacobian_product",
            {
                "inputs": base,
                "vjp_inputs": ["x"],
                **vjp,
                "cotangent_vector": {"y": b64(np.ones((3, 3), np.float32))},
            },
            ["cotangent_vector['y'] must have the shape of y (3, 2), got (3, 3)"],
        ),
        (
            "tangent-shape",
            "jacobian_vector_product",
            {
                "inputs": base,
                "jvp_inputs": ["x"],
                "jvp_outputs": ["y"],
                "tangent_vector": {"x": b64(np.ones((3, 5), np.float32))},
            },
            ["Tangent vector 'x'", "incompatible with expected shape (3, 6)"],
        ),
    ]
