"""Malformed requests of the network contract (several layers, both layouts,
batch axes; x (2, 3) -> [0] w (3, 4) kn relu -> [1] w_q (5, 4) nk tanh ->
[2] w (5, 2) kn) to apply and abstract_eval get a 4xx naming the field by its
path: one of w and w_q per layer, widths that chain, a scale per row, bias
(..., N), layout and activation values, unknown fields, the number of layers
(QARRAY_MAX_LAYERS), batch axes that disagree, values, an output over
QARRAY_MAX_ELEMENTS.

The requests the cases start from, the check and the server:
tests/tesseract/bad_requests.py, conftest.py's bad_input_server.

Covers: qarray/network/_shapes.py, qarray/tesseract/_request.py
"""

import numpy as np
import pytest

from support.server import b64
from tests.tesseract.bad_requests import (
    MAX_LAYERS,
    NET_QV,
    NET_SCALE,
    QV,
    W,
    X,
    batched,
    check_refused,
    f32,
    inputs,
    layer,
    loc,
    network,
    spec,
    w_q,
    with_nan,
)

CASES = [
    # each layer gives exactly one of w and w_q
    (
        "net-both-weights",
        "apply",
        {"inputs": network(1, w=b64(f32(5, 4)))},
        ["layers.[1] must give exactly one of w and w_q, got both"],
    ),
    (
        "net-neither-weights",
        "apply",
        {"inputs": network(1, w_q=None)},
        ["layers.[1] must give exactly one of w and w_q, got neither"],
    ),
    # widths chain: K_{i+1} = N_i
    (
        "net-k-mismatch",
        "apply",
        {"inputs": network(2, w=b64(f32(6, 2)))},
        [
            "layers.[2].w (6, 2) has K = 6 (layout 'kn': (..., K, N))",
            "its input is the output of layers.[1] of width 5",
        ],
    ),
    (
        "net-k-mismatch-nk",
        "apply",
        {"inputs": network(1, w_q=w_q(np.ones((5, 3), np.int8), f32(5)))},
        [
            "layers.[1].w_q.qvalue (5, 3) has K = 3 (layout 'nk': (..., N, K))",
            "its input is the output of layers.[0] of width 4",
        ],
    ),
    (
        # the nk layer's weights sent as kn: (K, N) = (4, 5) read as (N, K)
        "net-layout-transposed",
        "apply",
        {"inputs": network(1, w_q=w_q(np.ones((4, 5), np.int8), f32(4)))},
        [
            "layers.[1].w_q.qvalue (4, 5) has K = 5 (layout 'nk'",
            "the output of layers.[0] of width 4",
        ],
    ),
    # scales: one per row of qvalue
    (
        "net-scale-shape-kn",
        "apply",
        {"inputs": network(0, w=None, w_q=w_q(QV, f32(4)))},
        [
            "layers.[0].w_q.scale must have shape (3,)",
            "one scale per row of layers.[0].w_q.qvalue (3, 4)",
            "got (4,)",
        ],
    ),
    (
        "net-scale-shape-nk",
        "apply",
        {"inputs": network(1, w_q=w_q(np.ones((5, 4), np.int8), f32(4)))},
        ["layers.[1].w_q.scale must have shape (5,)", "(5, 4)", "got (4,)"],
    ),
    (
        "net-scale-2d",
        "apply",
        {"inputs": network(1, w_q=w_q(np.ones((5, 4), np.int8), f32(5, 4)))},
        ["layers.[1].w_q.scale must have shape (5,)", "got (5, 4)"],
    ),
    # bias: (..., N)
    (
        "net-bias-n",
        "apply",
        {"inputs": network(2, bias=b64(f32(5)))},
        [
            "layers.[2].bias must have shape (..., N) with N = 2",
            "layers.[2].w (5, 2) (layout 'kn')",
            "got (5,)",
        ],
    ),
    (
        "net-bias-n-nk",
        "apply",
        {"inputs": network(1, bias=b64(f32(4)))},
        [
            "layers.[1].bias must have shape (..., N) with N = 5",
            "layers.[1].w_q.qvalue (5, 4) (layout 'nk')",
            "got (4,)",
        ],
    ),
    # layout and activation values
    (
        "net-bad-layout",
        "apply",
        {"inputs": network(1, layout="oi")},
        [loc("inputs", "layers", 1, "layout"), "Input should be 'kn' or 'nk'"],
    ),
    (
        "net-layout-null",
        "apply",
        {"inputs": {"x": b64(X), "layers": [{"w": b64(W), "layout": None}]}},
        [loc("inputs", "layers", 0, "layout"), "Input should be 'kn' or 'nk'"],
    ),
    (
        "net-bad-activation",
        "apply",
        {"inputs": network(0, activation="leaky_relu")},
        [
            loc("inputs", "layers", 0, "activation"),
            "'none', 'relu', 'gelu', 'tanh', 'sigmoid' or 'silu'",
        ],
    ),
    (
        "net-bad-quantize-activations",
        "apply",
        {"inputs": {**network(), "quantize_activations": "int8"}},
        [loc("inputs", "quantize_activations"), "valid boolean"],
    ),
    (
        "net-unknown-layer-field",
        "apply",
        {"inputs": network(1, weights=b64(f32(5, 4)))},
        [loc("inputs", "layers", 1, "weights"), "Extra inputs are not permitted"],
    ),
    (
        "net-unknown-w_q-field",
        "apply",
        {"inputs": network(1, w_q={**w_q(NET_QV, NET_SCALE), "zero_point": 0})},
        [loc("inputs", "layers", 1, "w_q", "zero_point"), "Extra inputs"],
    ),
    (
        "net-w_q-without-scale",
        "apply",
        {"inputs": network(1, w_q={"qvalue": b64(np.ones((5, 4), np.int8))})},
        [loc("inputs", "layers", 1, "w_q", "scale"), "Field required"],
    ),
    # the number of layers
    (
        "too-many-layers",
        "apply",
        {"inputs": inputs(*[layer(w=b64(f32(3, 3)))] * (MAX_LAYERS + 1))},
        [
            f"layers has {MAX_LAYERS + 1} layers, over the limit of {MAX_LAYERS} "
            "(QARRAY_MAX_LAYERS)"
        ],
    ),
    (
        "too-many-layers-abstract",
        "abstract_eval",
        {"inputs": {"x": spec(2, 3), "layers": [{"w": spec(3, 3)}] * 100}},
        ["layers has 100 layers, over the limit of", "QARRAY_MAX_LAYERS"],
    ),
    (
        "no-layers",
        "apply",
        {"inputs": inputs(layers=[])},
        [loc("inputs", "layers"), "at least 1 item"],
    ),
    # batch axes: they index x's leading axes; equal or 1
    (
        "batch-layers-disagree",
        "apply",
        {"inputs": batched((2, 7, 3), (2, 3, 4), (3, 4, 5))},
        [
            "layers.[1].w has batch axes (3,), which do not match (2,)",
            "(from layers.[0].w (2,))",
        ],
    ),
    (
        "batch-x-disagrees",
        "apply",
        {"inputs": batched((3, 2, 3), (2, 3, 4))},
        [
            "x (3, 2, 3) has batch axes (3,), which do not match (2,)",
            "(from layers.[0].w (2,))",
        ],
    ),
    (
        "batch-bias-disagrees",
        "apply",
        {
            "inputs": {
                "x": b64(f32(2, 5, 3)),
                "layers": [{"w": b64(f32(2, 3, 4)), "bias": b64(f32(3, 4))}],
            }
        },
        ["layers.[0].bias has batch axes (3,), which do not match (2,)"],
    ),
    (
        "batch-scale-disagrees",
        "apply",
        {
            "inputs": network(
                1,
                x=f32(2, 6, 3),
                w_q=w_q(np.ones((2, 5, 4), np.int8), f32(3, 5)),
            )
        },
        [
            "layers.[1].w_q.scale must have shape (2, 5)",
            "layers.[1].w_q.qvalue (2, 5, 4)",
            "got (3, 5)",
        ],
    ),
    (
        "batch-more-axes-than-x",
        "apply",
        {"inputs": batched((2, 3), (2, 2, 3, 4))},
        [
            "the layers' batch axes (2, 2) (from layers.[0].w (2, 2)) are more than "
            "x (2, 3) has leading axes"
        ],
    ),
    (
        "batch-vector-x",
        "apply",
        {"inputs": batched((3,), (2, 3, 4))},
        ["the layers' batch axes (2,)", "more than x (3,) has leading axes"],
    ),
    (
        "batch-abstract",
        "abstract_eval",
        {"inputs": {"x": spec(3, 2, 3), "layers": [{"w": spec(2, 3, 4)}]}},
        ["x (3, 2, 3) has batch axes (3,), which do not match (2,)"],
    ),
    # values, by path
    (
        "net-nan-bias",
        "apply",
        {"inputs": network(1, bias=b64(with_nan(f32(5), 3)))},
        [
            "layers.[1].bias must be finite, got nan at index (3,) of "
            "layers.[1].bias (5,)"
        ],
    ),
    (
        "net-inf-w",
        "apply",
        {"inputs": network(2, w=b64(with_nan(f32(5, 2), (4, 1), -np.inf)))},
        [
            "layers.[2].w must be finite, got -inf at index (4, 1) of "
            "layers.[2].w (5, 2)"
        ],
    ),
    (
        "net-negative-scale",
        "apply",
        {"inputs": network(1, w_q=w_q(np.ones((5, 4), np.int8), -f32(5) - 2))},
        ["layers.[1].w_q.scale must be >= 0", "of layers.[1].w_q.scale (5,)"],
    ),
    (
        "net-int8-minus-128",
        "apply",
        {"inputs": network(1, w_q=w_q(np.full((5, 4), -128, np.int8), f32(5)))},
        ["layers.[1].w_q.qvalue must lie in [-127, 127]", "(5, 4)"],
    ),
    (
        "abstract-huge-y",
        "abstract_eval",
        {"inputs": {"x": spec(1000, 3), "layers": [{"w": spec(3, 1001)}]}},
        ["y would have shape (1000, 1001) (1001000 elements)", "QARRAY_MAX_ELEMENTS"],
    ),
    (
        "huge-y",
        "apply",
        {"inputs": inputs(layer(w=b64(f32(3, 1001))), x=b64(f32(1000, 3)))},
        ["y would have shape (1000, 1001) (1001000 elements)", "QARRAY_MAX_ELEMENTS"],
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
