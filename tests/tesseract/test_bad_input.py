"""Malformed requests get a 4xx whose message names the field, and the server lives."""

import numpy as np
import pytest
import requests

from tests.tesseract.server import b64, serve

X = np.arange(6, dtype=np.float32).reshape(2, 3)
W = np.arange(12, dtype=np.float32).reshape(3, 4) / 12
QV = np.arange(12, dtype=np.int8).reshape(3, 4)
SCALE = np.full(3, 0.1, np.float32)
G = np.ones((2, 4), np.float32)


def with_nan(a, index=(0, 0), value=np.nan):
    a = a.copy()
    a[index] = value
    return a


def inputs(**overrides):
    base = {"x": b64(X), "w": b64(W)}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def w_q(qvalue=QV, scale=SCALE):
    return {"qvalue": b64(qvalue), "scale": b64(scale)}


def vjp(payload_inputs=None, **fields):
    payload = {
        "inputs": payload_inputs or inputs(),
        "vjp_inputs": ["x"],
        "vjp_outputs": ["y"],
        "cotangent_vector": {"y": b64(G)},
    }
    payload.update(fields)
    return payload


def jvp(payload_inputs=None, **fields):
    payload = {
        "inputs": payload_inputs or inputs(),
        "jvp_inputs": ["x"],
        "jvp_outputs": ["y"],
        "tangent_vector": {"x": b64(X)},
    }
    payload.update(fields)
    return payload


HUGE = {
    "object_type": "array",
    "shape": [200000, 200000],
    "dtype": "float32",
    "data": {"buffer": "AAAAAA==", "encoding": "base64"},
}

# (id, endpoint, JSON payload, fragments the error message must contain)
CASES = [
    (
        "k-mismatch",
        "apply",
        {"inputs": inputs(x=b64(np.ones((2, 5), np.float32)))},
        ["x.shape[-1] must equal w.shape[0] (K)", "(2, 5)", "(3, 4)"],
    ),
    (
        "both-weights",
        "apply",
        {"inputs": inputs(w_q=w_q())},
        ["exactly one of w and w_q, got both"],
    ),
    (
        "neither-weights",
        "apply",
        {"inputs": inputs(w=None)},
        ["exactly one of w and w_q, got neither"],
    ),
    (
        "nan-x",
        "apply",
        {"inputs": inputs(x=b64(with_nan(X)))},
        ["x must be finite", "nan", "(0, 0)"],
    ),
    (
        "inf-w",
        "apply",
        {"inputs": inputs(w=b64(with_nan(W, (1, 2), np.inf)))},
        ["w must be finite", "inf", "(1, 2)"],
    ),
    (
        "inf-scale",
        "apply",
        {"inputs": inputs(w=None, w_q=w_q(scale=with_nan(SCALE, 1, np.inf)))},
        ["w_q.scale must be finite"],
    ),
    (
        "negative-scale",
        "apply",
        {"inputs": inputs(w=None, w_q=w_q(scale=-SCALE))},
        ["w_q.scale must be >= 0"],
    ),
    (
        "int8-minus-128",
        "apply",
        {"inputs": inputs(w=None, w_q=w_q(qvalue=with_nan(QV, (0, 0), -128)))},
        ["w_q.qvalue must lie in [-127, 127]"],
    ),
    (
        "fractional-int8",
        "apply",
        {
            "inputs": inputs(
                w=None, w_q={"qvalue": [[0.5, 1, 2, 3]] * 3, "scale": b64(SCALE)}
            )
        },
        ["qvalue", "int8"],
    ),
    (
        "scale-shape",
        "apply",
        {"inputs": inputs(w=None, w_q=w_q(scale=SCALE[:2]))},
        ["w_q.scale must have shape (K,) = (3,)", "(2,)"],
    ),
    (
        "bias-shape",
        "apply",
        {"inputs": inputs(bias=b64(np.ones(3, np.float32)))},
        ["bias must have shape (N,) = (4,)", "(3,)"],
    ),
    ("unknown-field", "apply", {"inputs": inputs(z=1)}, ["z", "Extra inputs"]),
    (
        "bad-activations",
        "apply",
        {"inputs": inputs(activations="int4")},
        ["activations", "float32", "int8"],
    ),
    (
        "scalar-x",
        "apply",
        {"inputs": inputs(x=b64(np.float32(1)))},
        ["x must have shape (..., K)"],
    ),
    (
        "huge-declared-x",
        "apply",
        {"inputs": inputs(x=HUGE)},
        ["declared shape (200000, 200000)", "QARRAY_MAX_ELEMENTS"],
    ),
    (
        "huge-declared-w",
        "apply",
        {"inputs": inputs(w=HUGE)},
        ["w", "declared shape (200000, 200000)"],
    ),
    (
        "huge-abstract",
        "abstract_eval",
        {
            "inputs": {
                "x": {"shape": [200000, 200000], "dtype": "float32"},
                "w": {"shape": [200000, 3], "dtype": "float32"},
            }
        },
        ["QARRAY_MAX_ELEMENTS"],
    ),
    (
        "vjp-nondiff-path",
        "vector_jacobian_product",
        vjp(vjp_inputs=["activations"]),
        ["vjp_inputs"],
    ),
    (
        "vjp-unknown-path",
        "vector_jacobian_product",
        vjp(vjp_inputs=["nope"]),
        ["vjp_inputs"],
    ),
    (
        "vjp-path-not-given",
        "vector_jacobian_product",
        vjp(inputs(w=None, w_q=w_q()), vjp_inputs=["w"]),
        ["vjp_inputs names 'w', which this request did not give (it gave w_q)"],
    ),
    (
        "vjp-cotangent-shape",
        "vector_jacobian_product",
        vjp(cotangent_vector={"y": b64(np.ones((2, 3), np.float32))}),
        ["cotangent_vector['y'] must have the shape of y (2, 4), got (2, 3)"],
    ),
    (
        "vjp-output-path",
        "vector_jacobian_product",
        vjp(vjp_outputs=["weight_error"]),
        ["vjp_outputs"],
    ),
    (
        "jvp-path-not-given",
        "jacobian_vector_product",
        jvp(jvp_inputs=["bias"], tangent_vector={"bias": b64(np.ones(4, np.float32))}),
        ["tangent_vector", "Tangent vector 'bias'"],
    ),
    (
        "jvp-path-not-given-scalar-tangent",
        "jacobian_vector_product",
        jvp(jvp_inputs=["bias"], tangent_vector={"bias": 1.0}),
        ["jvp_inputs names 'bias', which this request did not give"],
    ),
    (
        "jvp-tangent-shape",
        "jacobian_vector_product",
        jvp(tangent_vector={"x": b64(np.ones((2, 2), np.float32))}),
        ["tangent_vector", "x"],
    ),
    (
        "jacobian-path-not-given",
        "jacobian",
        {"inputs": inputs(), "jac_inputs": ["w_q.scale"], "jac_outputs": ["y"]},
        ["jac_inputs names 'w_q.scale', which this request did not give (it gave w)"],
    ),
]


def truncated(array):
    encoded = b64(array)
    encoded["data"]["buffer"] = encoded["data"]["buffer"][:-6]
    return encoded


def with_data(array, **data):
    encoded = b64(array)
    encoded["data"].update(data)
    return encoded


class Raw(bytes):
    """A request body sent as is, with its own content type."""

    def __new__(cls, body: bytes, content_type="application/json"):
        obj = super().__new__(cls, body)
        obj.content_type = content_type
        return obj


ABSTRACT_X = {"shape": [2, 3], "dtype": "float32"}
ABSTRACT_W = {"shape": [3, 4], "dtype": "float32"}

CASES += [
    # encodings and transport
    ("truncated-base64", "apply", {"inputs": inputs(x=truncated(X))}, ["x", "base64"]),
    (
        "unknown-encoding",
        "apply",
        {"inputs": inputs(x=with_data(X, encoding="b65"))},
        ['"loc":["body","inputs","x"]', "numeric array"],
    ),
    (
        "buffer-shape-mismatch",
        "apply",
        {"inputs": inputs(x={**b64(X), "shape": [4, 3]})},
        ["x"],
    ),
    (
        "complex-dtype",
        "apply",
        {"inputs": inputs(x=b64(X.astype(np.complex64)))},
        ['"loc":["body","inputs","x"]', "numeric array"],
    ),
    ("x-is-a-string", "apply", {"inputs": inputs(x="hello")}, ["x"]),
    ("missing-inputs", "apply", {}, ["inputs", "Field required"]),
    ("inputs-is-a-list", "apply", {"inputs": [1, 2]}, ["inputs"]),
    ("malformed-json", "apply", Raw(b'{"inputs": {"x": [[1, 2'), ["json"]),
    ("empty-body", "apply", Raw(b""), ["body"]),
    ("json-array-body", "apply", Raw(b"[1, 2, 3]"), ["body"]),
    ("text-content-type", "apply", Raw(b'{"inputs": {}}', "text/plain"), ["body"]),
    # abstract_eval
    (
        "abstract-unknown-dtype",
        "abstract_eval",
        {"inputs": {"x": {"shape": [2, 3], "dtype": "float99"}, "w": ABSTRACT_W}},
        ["dtype"],
    ),
    (
        "abstract-negative-dim",
        "abstract_eval",
        {"inputs": {"x": {"shape": [-2, 3], "dtype": "float32"}, "w": ABSTRACT_W}},
        ["x", "shape"],
    ),
    (
        "abstract-k-mismatch",
        "abstract_eval",
        {"inputs": {"x": {"shape": [2, 5], "dtype": "float32"}, "w": ABSTRACT_W}},
        ["x.shape[-1] must equal w.shape[0] (K)"],
    ),
    (
        "abstract-both-weights",
        "abstract_eval",
        {
            "inputs": {
                "x": ABSTRACT_X,
                "w": ABSTRACT_W,
                "w_q": {
                    "qvalue": {"shape": [3, 4], "dtype": "int8"},
                    "scale": {"shape": [3], "dtype": "float32"},
                },
            }
        },
        ["exactly one of w and w_q"],
    ),
    # jacobian
    (
        "jacobian-unknown-input",
        "jacobian",
        {"inputs": inputs(), "jac_inputs": ["z"], "jac_outputs": ["y"]},
        ["jac_inputs"],
    ),
    (
        "jacobian-no-inputs",
        "jacobian",
        {"inputs": inputs(), "jac_inputs": [], "jac_outputs": ["y"]},
        ["jac_inputs"],
    ),
    (
        "jacobian-nondiff-output",
        "jacobian",
        {"inputs": inputs(), "jac_inputs": ["x"], "jac_outputs": ["w_q.qvalue"]},
        ["jac_outputs"],
    ),
    (
        "jacobian-too-large",
        "jacobian",
        {
            "inputs": inputs(x=b64(np.ones((1000, 3), np.float32))),
            "jac_inputs": ["x"],
            "jac_outputs": ["y"],
        },
        ["Jacobian of y (1000, 4) with respect to x (1000, 3)", "QARRAY_MAX_ELEMENTS"],
    ),
    # vjp / jvp vectors
    (
        "vjp-cotangent-complex",
        "vector_jacobian_product",
        vjp(cotangent_vector={"y": b64(G.astype(np.complex64))}),
        ["cotangent_vector"],
    ),
    (
        "vjp-cotangent-truncated",
        "vector_jacobian_product",
        vjp(cotangent_vector={"y": truncated(G)}),
        ["cotangent_vector", "base64"],
    ),
    (
        "vjp-cotangent-wrong-key",
        "vector_jacobian_product",
        vjp(cotangent_vector={"x": b64(G)}),
        ["cotangent_vector"],
    ),
    (
        "vjp-cotangent-nan",
        "vector_jacobian_product",
        vjp(cotangent_vector={"y": b64(with_nan(G))}),
        ["cotangent_vector['y'] must be finite"],
    ),
    (
        "jvp-tangent-string",
        "jacobian_vector_product",
        jvp(tangent_vector={"x": "nope"}),
        ["tangent_vector"],
    ),
    (
        "jvp-tangent-extra-key",
        "jacobian_vector_product",
        jvp(tangent_vector={"x": b64(X), "bias": b64(np.ones(4, np.float32))}),
        ["tangent_vector"],
    ),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    with serve(tmp, env={"QARRAY_MAX_ELEMENTS": "1000000"}) as url:
        yield url, tmp


@pytest.mark.parametrize(
    ("endpoint", "payload", "fragments"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_input_is_a_4xx_naming_the_field(server, endpoint, payload, fragments):
    url, _ = server
    if isinstance(payload, Raw):
        response = requests.post(
            f"{url}/{endpoint}",
            data=bytes(payload),
            timeout=60,
            headers={"Content-Type": payload.content_type},
        )
    else:
        response = requests.post(f"{url}/{endpoint}", json=payload, timeout=60)
    assert 400 <= response.status_code < 500, (
        response.status_code,
        response.text[:2000],
    )
    message = response.text
    for fragment in fragments:
        assert fragment in message, (fragment, message[:2000])
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_the_suite_is_broad():
    assert len(CASES) >= 40
    assert {c[1] for c in CASES} == {
        "apply",
        "abstract_eval",
        "jacobian",
        "jacobian_vector_product",
        "vector_jacobian_product",
    }


def test_nothing_was_written_outside_the_output_folder(server):
    """Runs after the bad-input cases (same module server)."""
    _, tmp = server
    stray = [
        p
        for p in tmp.rglob("*")
        if not p.is_relative_to(tmp / "outputs") and not p.name.startswith("server-")
    ]
    assert stray == []
