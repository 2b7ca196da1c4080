"""Malformed encodings get a 4xx naming the field by its path, not
tesseract-core's "Could not parse value as a numeric array": base64 arrays
truncated, of an unknown encoding, of a buffer that does not fit their shape,
of a wrong rank or a dtype that does not cast (complex, float int8s,
bfloat16); declared shapes over QARRAY_MAX_ELEMENTS, refused before decoding;
abstract_eval's array specs (an unknown dtype, a negative dimension); and
bodies that are no request (missing, a list, malformed JSON, empty, a JSON
array, text/plain).

The requests the cases start from, the check and the server:
tests/tesseract/bad_requests.py, conftest.py's bad_input_server.

Covers: qarray/tesseract/_limits.py
"""

import numpy as np
import pytest

from support.server import b64
from tests.tesseract.bad_requests import (
    ABSTRACT_W,
    ABSTRACT_X,
    NET_QV,
    NET_SCALE,
    Raw,
    W,
    X,
    check_refused,
    declared,
    f32,
    inputs,
    layer,
    loc,
    network,
    spec,
    truncated,
    w_q,
    with_data,
)

CASES = [
    # declared shapes over QARRAY_MAX_ELEMENTS: refused before decoding
    (
        # y (200000, 1) is small: x's own size is what is refused
        "huge-declared-x",
        "apply",
        {"inputs": inputs(layer(w=declared(200000, 1)), x=declared(200000, 200000))},
        [
            loc("inputs", "x"),
            "declared shape (200000, 200000) has 40000000000 elements",
            "QARRAY_MAX_ELEMENTS",
        ],
    ),
    (
        "huge-declared-w",
        "apply",
        {"inputs": inputs(layer(w=declared(3, 400000)))},
        [
            loc("inputs", "layers", 0, "w"),
            "declared shape (3, 400000) has 1200000 elements",
            "QARRAY_MAX_ELEMENTS",
        ],
    ),
    (
        "huge-abstract",
        "abstract_eval",
        {
            "inputs": {
                "x": {"shape": [200000, 200000], "dtype": "float32"},
                "layers": [{"w": {"shape": [200000, 3], "dtype": "float32"}}],
            }
        },
        ["declared shape (200000, 200000)", "QARRAY_MAX_ELEMENTS"],
    ),
    # encodings and transport
    (
        "truncated-base64",
        "apply",
        {"inputs": inputs(x=truncated(X))},
        [loc("inputs", "x"), "base64"],
    ),
    (
        "unknown-encoding",
        "apply",
        {"inputs": inputs(x=with_data(X, encoding="b65"))},
        [loc("inputs", "x")],
    ),
    (
        "buffer-shape-mismatch",
        "apply",
        {"inputs": inputs(x={**b64(X), "shape": [4, 3]})},
        [loc("inputs", "x"), "into shape (4,3)"],
    ),
    (
        "complex-dtype",
        "apply",
        {"inputs": inputs(x=b64(X.astype(np.complex64)))},
        [
            loc("inputs", "x"),
            "declared shape (2, 3)) has dtype 'complex64', which does not cast to "
            "float32",
        ],
    ),
    ("x-is-a-string", "apply", {"inputs": inputs(x="hello")}, [loc("inputs", "x")]),
    ("missing-inputs", "apply", {}, [loc("inputs"), "Field required"]),
    ("inputs-is-a-list", "apply", {"inputs": [1, 2]}, [loc("inputs")]),
    ("malformed-json", "apply", Raw(b'{"inputs": {"x": [[1, 2'), ["json_invalid"]),
    ("empty-body", "apply", Raw(b""), ['"loc":["body"]']),
    ("json-array-body", "apply", Raw(b"[1, 2, 3]"), ['"loc":["body"]']),
    (
        "text-content-type",
        "apply",
        Raw(b'{"inputs": {}}', "text/plain"),
        ['"loc":["body"]'],
    ),
    # abstract_eval's array specs
    (
        "abstract-unknown-dtype",
        "abstract_eval",
        {"inputs": {"x": spec(2, 3, dtype="float99"), "layers": [{"w": ABSTRACT_W}]}},
        [loc("inputs", "x"), "dtype"],
    ),
    (
        "abstract-negative-dim",
        "abstract_eval",
        {"inputs": {"x": spec(-2, 3), "layers": [{"w": ABSTRACT_W}]}},
        [loc("inputs", "x"), "declared shape (-2, 3) has a negative dimension"],
    ),
    # rank errors of base64 arrays: the path and the shapes, not NON_NUMERIC
    (
        "b64-w-1d",
        "apply",
        {"inputs": inputs(layer(w=b64(f32(3))))},
        ["layers.[0].w must have shape (..., K, N) (layout 'kn'), got (3,)"],
    ),
    (
        "b64-w-0d",
        "apply",
        {"inputs": network(2, w=b64(np.float32(2)))},
        ["layers.[2].w must have shape (..., K, N) (layout 'kn'), got ()"],
    ),
    (
        "b64-qvalue-1d",
        "apply",
        {"inputs": network(1, w_q=w_q(np.ones(4, np.int8), f32(1)))},
        ["layers.[1].w_q.qvalue must have shape (..., N, K) (layout 'nk'), got (4,)"],
    ),
    (
        "b64-scale-0d",
        "apply",
        {"inputs": network(1, w_q=w_q(np.ones((5, 4), np.int8), np.float32(1)))},
        ["layers.[1].w_q.scale must have shape (5,)", "got ()"],
    ),
    (
        "b64-bias-0d",
        "apply",
        {"inputs": network(2, bias=b64(np.float32(1)))},
        ["layers.[2].bias must have shape (..., N) with N = 2", "got ()"],
    ),
    (
        "abstract-w-1d",
        "abstract_eval",
        {"inputs": {"x": ABSTRACT_X, "layers": [{"w": spec(4)}]}},
        ["layers.[0].w must have shape (..., K, N) (layout 'kn'), got (4,)"],
    ),
    # dtypes of base64 arrays: the path and the dtypes, not NON_NUMERIC
    (
        "b64-float-qvalue",
        "apply",
        {
            "inputs": network(
                1, w_q={**w_q(NET_QV, NET_SCALE), "qvalue": b64(f32(5, 4))}
            )
        },
        [
            loc("inputs", "layers", 1, "w_q", "qvalue"),
            "(declared shape (5, 4)) has dtype 'float32', which does not cast to "
            "int8 or uint8 without loss",
        ],
    ),
    (
        "b64-complex-bias",
        "apply",
        {"inputs": network(2, bias=b64(f32(2).astype(np.complex64)))},
        [loc("inputs", "layers", 2, "bias"), "'complex64'", "float32"],
    ),
    (
        "b64-unknown-dtype",
        "apply",
        {"inputs": network(0, w={**b64(W), "dtype": "bfloat16"})},
        [loc("inputs", "layers", 0, "w"), "dtype 'bfloat16'"],
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
