"""Malformed one-layer requests (x (2, 3) through w (3, 4), the v0.1 contract
as a one-layer network) to apply and abstract_eval get a 4xx whose message
names the field by its path (``layers.[0].w_q.scale``) and the shapes: which
weights a layer gives, their values (finite, scales >= 0, int8 in
[-127, 127]), the shapes of x, scales and bias, unknown fields, LoRA adapters.

The requests the cases start from, the check and the server:
tests/tesseract/bad_requests.py, conftest.py's bad_input_server.

Covers: qarray/tesseract/_request.py, qarray/tesseract/_limits.py
"""

import numpy as np
import pytest

from support.server import b64
from tests.tesseract.bad_requests import (
    ABSTRACT_W,
    ABSTRACT_X,
    QV,
    SCALE,
    W,
    X,
    check_refused,
    f32,
    inputs,
    layer,
    loc,
    spec,
    w_q,
    with_nan,
)

CASES = [
    # the weights, their values and shapes; unknown fields
    (
        "k-mismatch",
        "apply",
        {"inputs": inputs(x=b64(np.ones((2, 5), np.float32)))},
        ["layers.[0].w (3, 4) has K = 3", "its input is x (2, 5) of width 5"],
    ),
    (
        "both-weights",
        "apply",
        {"inputs": inputs(layer(w_q=w_q()))},
        ["layers.[0] must give exactly one of w and w_q, got both"],
    ),
    (
        "neither-weights",
        "apply",
        {"inputs": inputs(layer(w=None))},
        ["layers.[0] must give exactly one of w and w_q, got neither"],
    ),
    (
        "nan-x",
        "apply",
        {"inputs": inputs(x=b64(with_nan(X)))},
        ["x must be finite, got nan at index (0, 0) of x (2, 3)"],
    ),
    (
        "inf-w",
        "apply",
        {"inputs": inputs(layer(w=b64(with_nan(W, (1, 2), np.inf))))},
        ["layers.[0].w must be finite, got inf at index (1, 2) of layers.[0].w (3, 4)"],
    ),
    (
        "inf-scale",
        "apply",
        {"inputs": inputs(layer(w=None, w_q=w_q(scale=with_nan(SCALE, 1, np.inf))))},
        ["layers.[0].w_q.scale must be finite", "index (1,)", "(3,)"],
    ),
    (
        "negative-scale",
        "apply",
        {"inputs": inputs(layer(w=None, w_q=w_q(scale=-SCALE)))},
        [
            "layers.[0].w_q.scale must be >= 0",
            "index (0,) of layers.[0].w_q.scale (3,)",
        ],
    ),
    (
        "int8-minus-128",
        "apply",
        {"inputs": inputs(layer(w=None, w_q=w_q(qvalue=with_nan(QV, (2, 1), -128))))},
        [
            "layers.[0].w_q.qvalue must lie in [-127, 127]",
            "-128 at index (2, 1) of layers.[0].w_q.qvalue (3, 4)",
        ],
    ),
    (
        "fractional-int8",
        "apply",
        {
            "inputs": inputs(
                layer(w=None, w_q={"qvalue": [[0.5, 1, 2, 3]] * 3, "scale": b64(SCALE)})
            )
        },
        [loc("inputs"), "layers.[0].w_q.qvalue must be int8", "got float64 (3, 4)"],
    ),
    (
        "scale-shape",
        "apply",
        {"inputs": inputs(layer(w=None, w_q=w_q(scale=SCALE[:2])))},
        [
            "layers.[0].w_q.scale must have shape (3,)",
            "layers.[0].w_q.qvalue (3, 4)",
            "got (2,)",
        ],
    ),
    (
        "bias-shape",
        "apply",
        {"inputs": inputs(layer(bias=b64(np.ones(3, np.float32))))},
        [
            "layers.[0].bias must have shape (..., N) with N = 4",
            "layers.[0].w (3, 4)",
            "got (3,)",
        ],
    ),
    (
        "unknown-field",
        "apply",
        {"inputs": inputs(z=1)},
        [loc("inputs", "z"), "Extra inputs"],
    ),
    (
        # v0.1's int8 switch is quantize_activations now; activation is per layer
        "old-activations-field",
        "apply",
        {"inputs": inputs(activations="int8")},
        [loc("inputs", "activations"), "Extra inputs are not permitted"],
    ),
    (
        "scalar-x",
        "apply",
        {"inputs": inputs(x=b64(np.float32(1)))},
        ["x must have shape (..., K) with at least one axis, got ()"],
    ),
    # LoRA adapters (x (2, 3) -> w (3, 4): a (rank, 3), b (4, rank))
    (
        "lora-a-shape",
        "apply",
        {"inputs": inputs(lora=[{"a": b64(f32(2, 4)), "b": b64(f32(4, 2))}])},
        ["lora.[0].a must be (..., rank, 3) for layers.[0] (K = 3", "got (2, 4)"],
    ),
    (
        "lora-b-shape",
        "apply",
        {"inputs": inputs(lora=[{"a": b64(f32(2, 3)), "b": b64(f32(2, 4))}])},
        ["lora.[0].b must be (..., 4, 2) for layers.[0] (N = 4)", "got (2, 4)"],
    ),
    (
        "lora-count",
        "apply",
        {"inputs": inputs(lora=[None, None])},
        ["lora has 2 entries for a network of 1 layers"],
    ),
    (
        "lora-nan",
        "apply",
        {"inputs": inputs(lora=[{"a": b64(with_nan(f32(2, 3))), "b": b64(f32(4, 2))}])},
        ["lora.[0].a must be finite"],
    ),
    # the same fields through abstract_eval
    (
        "abstract-k-mismatch",
        "abstract_eval",
        {"inputs": {"x": spec(2, 5), "layers": [{"w": ABSTRACT_W}]}},
        ["layers.[0].w (3, 4) has K = 3", "its input is x (2, 5) of width 5"],
    ),
    (
        "abstract-both-weights",
        "abstract_eval",
        {
            "inputs": {
                "x": ABSTRACT_X,
                "layers": [
                    {
                        "w": ABSTRACT_W,
                        "w_q": {
                            "qvalue": spec(3, 4, dtype="int8"),
                            "scale": spec(3),
                        },
                    }
                ],
            }
        },
        ["layers.[0] must give exactly one of w and w_q, got both"],
    ),
]


@pytest.mark.parametrize(
    ("name", "endpoint", "payload", "fragments"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_is_a_4xx_naming_the_field(
    bad_input_server, name, endpoint, payload, fragments
):
    url, _ = bad_input_server
    check_refused(url, name, endpoint, payload, fragments)
