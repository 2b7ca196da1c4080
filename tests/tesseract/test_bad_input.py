"""Malformed requests get a 4xx whose message names the field by its path
(``layers.[2].w_q.scale``) and the shapes, and the server lives.

Every case changes one thing in a request that the server accepts as is
(test_the_requests_the_cases_start_from_are_valid), so each 4xx is for the
reason the case names.
"""

import numpy as np
import pytest
import requests

from support.server import b64, serve

MAX_LAYERS = 4  # QARRAY_MAX_LAYERS of this module's server
MAX_ELEMENTS = 1_000_000  # its QARRAY_MAX_ELEMENTS
# tesseract-core's answer to an array it cannot take for one: for the cases
# below it would mislead (a wrong rank or dtype is not "non-numeric data")
NON_NUMERIC = "Could not parse value as a numeric array"

X = np.arange(6, dtype=np.float32).reshape(2, 3)
W = np.arange(12, dtype=np.float32).reshape(3, 4) / 12
QV = np.arange(12, dtype=np.int8).reshape(3, 4)
SCALE = np.full(3, 0.1, np.float32)
G = np.ones((2, 4), np.float32)


def f32(*shape):
    return np.linspace(-1, 1, int(np.prod(shape)), dtype=np.float32).reshape(shape)


def with_nan(a, index=(0, 0), value=np.nan):
    a = a.copy()
    a[index] = value
    return a


def _drop_none(d):
    return {k: v for k, v in d.items() if v is not None}


def w_q(qvalue=QV, scale=SCALE):
    return {"qvalue": b64(qvalue), "scale": b64(scale)}


# --- one layer: x (2, 3) -> y (2, 4), the v0.1 contract as a one-layer network


def layer(**overrides):
    """The one layer {"w": W (3, 4)}, with fields changed (None removes one)."""
    return _drop_none({"w": b64(W), **overrides})


def inputs(*layers, **overrides):
    """x (2, 3) through ``layers`` (default: one layer()), fields changed."""
    base = {"x": b64(X), "layers": list(layers) or [layer()]}
    return _drop_none({**base, **overrides})


# --- a network: x (2, 3) -> [0] w (3, 4) kn relu -> [1] w_q (5, 4) nk tanh
#     -> [2] w (5, 2) kn -> y (2, 2)


NET_QV = np.arange(-10, 10, dtype=np.int8).reshape(5, 4)  # layer 1, "nk"
NET_SCALE = f32(5) + 2


def network(i=None, x=X, **overrides):
    """The 3-layer network, with fields of layer ``i`` changed."""
    layers = [
        {"w": b64(W), "bias": b64(f32(4)), "activation": "relu"},
        {
            "w_q": w_q(NET_QV, NET_SCALE),
            "layout": "nk",
            "bias": b64(f32(5)),
            "activation": "tanh",
        },
        {"w": b64(f32(5, 2)), "bias": b64(f32(2))},
    ]
    if i is not None:
        layers[i] = _drop_none({**layers[i], **overrides})
    return {"x": b64(x), "layers": layers}


def batched(x_shape, *shapes):
    """x of ``x_shape`` through layers of dense "kn" w of ``shapes`` (batch axes
    included), no biases."""
    return {"x": b64(f32(*x_shape)), "layers": [{"w": b64(f32(*s))} for s in shapes]}


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


def jacobian(payload_inputs=None, **fields):
    payload = {
        "inputs": payload_inputs or inputs(),
        "jac_inputs": ["x"],
        "jac_outputs": ["y"],
    }
    payload.update(fields)
    return payload


def declared(*shape, dtype="float32"):
    """An encoded array that declares ``shape`` (its buffer is 4 bytes: only
    a check made before decoding can answer for it)."""
    return {
        "object_type": "array",
        "shape": list(shape),
        "dtype": dtype,
        "data": {"buffer": "AAAAAA==", "encoding": "base64"},
    }


def loc(*path):
    """The location FastAPI's validation error gives a field at ``path``."""
    parts = ",".join(f'"{p}"' if isinstance(p, str) else str(p) for p in path)
    return f'"loc":["body",{parts}'


# (id, endpoint, JSON payload, fragments the error message must contain)
CASES = [
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
    (
        "vjp-nondiff-path",
        "vector_jacobian_product",
        vjp(vjp_inputs=["layers.[0].w_q.qvalue"]),
        [loc("vjp_inputs", 0), "String should match pattern"],
    ),
    (
        "vjp-unknown-path",
        "vector_jacobian_product",
        vjp(vjp_inputs=["nope"]),
        [loc("vjp_inputs", 0), "Input should be 'x'"],
    ),
    (
        "vjp-path-not-given",
        "vector_jacobian_product",
        vjp(inputs(layer(w=None, w_q=w_q())), vjp_inputs=["layers.[0].w"]),
        [
            "vjp_inputs: 'layers.[0].w' names an array this request did not give "
            "(layers.[0] gave w_q)"
        ],
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
        vjp(vjp_outputs=["layers.[0].weight_error"]),
        [loc("vjp_outputs", 0), "Input should be 'y'"],
    ),
    (
        # tesseract-core checks the tangent before the endpoint runs, against
        # the shape of the absent array (which it took for a scalar: "expected
        # 0D"); tesseract_api's path check now refuses the path first
        "jvp-path-not-given",
        "jacobian_vector_product",
        jvp(
            jvp_inputs=["layers.[0].bias"],
            tangent_vector={"layers.[0].bias": b64(np.ones(4, np.float32))},
        ),
        [
            loc("jvp_inputs", 0),
            "'layers.[0].bias' names an array this request did not give",
        ],
    ),
    (
        "jvp-path-not-given-scalar-tangent",
        "jacobian_vector_product",
        jvp(jvp_inputs=["layers.[0].bias"], tangent_vector={"layers.[0].bias": 1.0}),
        ["jvp_inputs: 'layers.[0].bias' names an array this request did not give"],
    ),
    (
        "jvp-tangent-shape",
        "jacobian_vector_product",
        jvp(tangent_vector={"x": b64(np.ones((2, 2), np.float32))}),
        [
            "Tangent vector 'x'",
            "Array shape (2, 2) is incompatible with expected shape (2, 3)",
        ],
    ),
    (
        "jacobian-path-not-given",
        "jacobian",
        jacobian(jac_inputs=["layers.[0].w_q.scale"]),
        [
            loc("jac_inputs", 0),
            "Could not find jac_inputs path layers.[0].w_q.scale in inputs",
        ],
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
    (
        "lora-path-not-given",
        "vector_jacobian_product",
        vjp(vjp_inputs=["lora.[0].a"]),
        ["vjp_inputs: 'lora.[0].a' names an array this request did not give"],
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


def spec(*shape, dtype="float32"):
    """An abstract array, as abstract_eval takes them."""
    return {"shape": list(shape), "dtype": dtype}


ABSTRACT_X = spec(2, 3)
ABSTRACT_W = spec(3, 4)

CASES += [
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
    # abstract_eval
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
    # jacobian
    (
        "jacobian-unknown-input",
        "jacobian",
        jacobian(jac_inputs=["z"]),
        [loc("jac_inputs", 0), "Input should be 'x'"],
    ),
    (
        "jacobian-no-inputs",
        "jacobian",
        jacobian(jac_inputs=[]),
        [loc("jac_inputs"), "at least 1 item"],
    ),
    (
        "jacobian-nondiff-output",
        "jacobian",
        jacobian(jac_outputs=["layers.[0].weight_error"]),
        [loc("jac_outputs", 0), "Input should be 'y'"],
    ),
    (
        "jacobian-too-large",
        "jacobian",
        jacobian(inputs(x=b64(np.ones((1000, 3), np.float32)))),
        [
            "the Jacobian of y (1000, 4) with respect to x (1000, 3) has 12000000 "
            "elements",
            "QARRAY_MAX_ELEMENTS",
        ],
    ),
    # vjp / jvp vectors
    (
        "vjp-cotangent-complex",
        "vector_jacobian_product",
        vjp(cotangent_vector={"y": b64(G.astype(np.complex64))}),
        [loc("cotangent_vector"), "Cotangent vector 'y'"],
    ),
    (
        "vjp-cotangent-truncated",
        "vector_jacobian_product",
        vjp(cotangent_vector={"y": truncated(G)}),
        [loc("cotangent_vector"), "base64"],
    ),
    (
        "vjp-cotangent-wrong-key",
        "vector_jacobian_product",
        vjp(cotangent_vector={"x": b64(G)}),
        [loc("cotangent_vector", "x"), "Input should be 'y'"],
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
        [loc("tangent_vector", "x")],
    ),
    (
        "jvp-tangent-extra-key",
        "jacobian_vector_product",
        jvp(
            tangent_vector={
                "x": b64(X),
                "layers.[0].bias": b64(np.ones(4, np.float32)),
            }
        ),
        [loc("tangent_vector"), "keys conforming to jvp_inputs"],
    ),
]

# --- the network contract: several layers, both layouts, batch axes

NETWORK_CASES = [
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
    # gradient paths the request did not give
    (
        "grad-w-of-a-w_q-layer",
        "vector_jacobian_product",
        vjp(
            network(),
            vjp_inputs=["layers.[1].w"],
            cotangent_vector={"y": b64(f32(2, 2))},
        ),
        [
            "vjp_inputs: 'layers.[1].w' names an array this request did not give "
            "(layers.[1] gave w_q)"
        ],
    ),
    (
        "grad-w-of-a-w_q-layer-jacobian",
        "jacobian",
        jacobian(inputs(layer(w=None, w_q=w_q())), jac_inputs=["layers.[0].w"]),
        [
            "jac_inputs: 'layers.[0].w' names an array this request did not give "
            "(layers.[0] gave w_q)"
        ],
    ),
    (
        "grad-scale-of-a-w-layer",
        "jacobian_vector_product",
        jvp(
            network(),
            jvp_inputs=["layers.[0].w_q.scale"],
            tangent_vector={"layers.[0].w_q.scale": b64(f32(3))},
        ),
        [
            loc("jvp_inputs", 0),
            "Could not find jvp_inputs path layers.[0].w_q.scale in inputs",
        ],
    ),
    (
        "grad-layer-out-of-range",
        "vector_jacobian_product",
        vjp(
            {**network(), "layers": network()["layers"][:2]},
            vjp_inputs=["layers.[5].bias"],
            cotangent_vector={"y": b64(f32(2, 5))},
        ),
        [
            loc("vjp_inputs", 0),
            "Could not find vjp_inputs path layers.[5].bias in inputs",
        ],
    ),
    (
        "grad-bias-not-given",
        "vector_jacobian_product",
        vjp(
            network(2, bias=None),
            vjp_inputs=["x", "layers.[2].bias"],
            cotangent_vector={"y": b64(f32(2, 2))},
        ),
        ["vjp_inputs: 'layers.[2].bias' names an array this request did not give"],
    ),
    # tangents and cotangents: the shapes of their arrays
    (
        "net-tangent-shape",
        "jacobian_vector_product",
        jvp(
            network(),
            jvp_inputs=["layers.[1].w_q.scale"],
            tangent_vector={"layers.[1].w_q.scale": b64(f32(4))},
        ),
        [
            "Tangent vector 'layers.[1].w_q.scale'",
            "Array shape (4,) is incompatible with expected shape (5,)",
        ],
    ),
    (
        "net-tangent-transposed-w",
        "jacobian_vector_product",
        jvp(
            network(),
            jvp_inputs=["layers.[0].w"],
            tangent_vector={"layers.[0].w": b64(f32(4, 3))},
        ),
        [
            "Tangent vector 'layers.[0].w'",
            "Array shape (4, 3) is incompatible with expected shape (3, 4)",
        ],
    ),
    (
        "net-cotangent-width",
        "vector_jacobian_product",
        vjp(network(), cotangent_vector={"y": b64(f32(2, 4))}),
        ["cotangent_vector['y'] must have the shape of y (2, 2), got (2, 4)"],
    ),
    (
        # y carries the batch axes: (2, 7, 5)
        "net-cotangent-batch-shape",
        "vector_jacobian_product",
        vjp(
            batched((2, 7, 3), (2, 3, 4), (4, 5)),
            cotangent_vector={"y": b64(f32(7, 5))},
        ),
        ["cotangent_vector['y'] must have the shape of y (2, 7, 5), got (7, 5)"],
    ),
    (
        "net-cotangent-nan",
        "vector_jacobian_product",
        vjp(
            network(),
            vjp_inputs=["layers.[1].w_q.scale"],
            cotangent_vector={"y": b64(with_nan(f32(2, 2), (1, 1), np.inf))},
        ),
        ["cotangent_vector['y'] must be finite"],
    ),
    # Jacobians: bounded by QARRAY_MAX_ELEMENTS
    (
        "net-jacobian-too-large",
        "jacobian",
        jacobian(network(x=f32(1000, 3)), jac_inputs=["layers.[1].bias", "x"]),
        [
            "the Jacobian of y (1000, 2) with respect to x (1000, 3) has 6000000 "
            "elements, over the limit of 1000000 (QARRAY_MAX_ELEMENTS)",
            "vector_jacobian_product",
        ],
    ),
    (
        "net-jacobian-too-large-batched",
        "jacobian",
        jacobian(
            batched((100, 8, 3), (100, 3, 4), (4, 5)), jac_inputs=["layers.[0].w"]
        ),
        [
            "the Jacobian of y (100, 8, 5) with respect to layers.[0].w "
            "(100, 3, 4) has 4800000 elements"
        ],
    ),
]

CASES += NETWORK_CASES

# NON_NUMERIC is right for these: the value is not numeric, or not an array
NON_NUMERIC_OK = {"x-is-a-string", "unknown-encoding", "jvp-tangent-string"}

# requests the cases start from: each must be accepted as is
VALID = [
    ("apply", {"inputs": inputs()}),
    ("apply", {"inputs": inputs(layer(w=None, w_q=w_q()))}),
    ("apply", {"inputs": network()}),
    ("apply", {"inputs": network(2, bias=None)}),
    ("apply", {"inputs": batched((2, 7, 3), (2, 3, 4), (4, 5))}),
    ("apply", {"inputs": batched((2, 5, 3), (1, 3, 4), (2, 4, 5))}),
    ("apply", {"inputs": inputs(*[layer(w=b64(f32(3, 3)))] * MAX_LAYERS)}),
    ("abstract_eval", {"inputs": {"x": ABSTRACT_X, "layers": [{"w": ABSTRACT_W}]}}),
    (
        "abstract_eval",
        {"inputs": {"x": spec(2, 3, 3), "layers": [{"w": spec(2, 3, 4)}]}},
    ),
    ("vector_jacobian_product", vjp()),
    ("vector_jacobian_product", vjp(inputs(layer(w=None, w_q=w_q())))),
    (
        "vector_jacobian_product",
        vjp(
            network(),
            vjp_inputs=["x", "layers.[0].w", "layers.[1].w_q.scale", "layers.[2].bias"],
            cotangent_vector={"y": b64(f32(2, 2))},
        ),
    ),
    (
        "vector_jacobian_product",
        vjp(
            batched((2, 7, 3), (2, 3, 4), (4, 5)),
            cotangent_vector={"y": b64(f32(2, 7, 5))},
        ),
    ),
    ("jacobian_vector_product", jvp()),
    (
        "jacobian_vector_product",
        jvp(
            network(),
            jvp_inputs=["layers.[1].w_q.scale"],
            tangent_vector={"layers.[1].w_q.scale": b64(f32(5))},
        ),
    ),
    ("jacobian", jacobian()),
    ("jacobian", jacobian(network(), jac_inputs=["layers.[1].bias", "x"])),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    env = {
        "QARRAY_MAX_ELEMENTS": str(MAX_ELEMENTS),
        "QARRAY_MAX_LAYERS": str(MAX_LAYERS),
    }
    with serve(tmp, env=env) as url:
        yield url, tmp


def post(url, endpoint, payload):
    if isinstance(payload, Raw):
        return requests.post(
            f"{url}/{endpoint}",
            data=bytes(payload),
            timeout=60,
            headers={"Content-Type": payload.content_type},
        )
    return requests.post(f"{url}/{endpoint}", json=payload, timeout=60)


@pytest.mark.parametrize(
    ("endpoint", "payload"), VALID, ids=[f"{e}-{i}" for i, (e, _) in enumerate(VALID)]
)
def test_the_requests_the_cases_start_from_are_valid(server, endpoint, payload):
    url, _ = server
    response = post(url, endpoint, payload)
    assert response.status_code == 200, response.text[:2000]


@pytest.mark.parametrize(
    ("name", "endpoint", "payload", "fragments"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_is_a_4xx_naming_the_field(
    server, name, endpoint, payload, fragments
):
    url, _ = server
    response = post(url, endpoint, payload)
    assert 400 <= response.status_code < 500, (
        response.status_code,
        response.text[:2000],
    )
    message = response.text
    for fragment in fragments:
        assert fragment in message, (fragment, message[:2000])
    if name not in NON_NUMERIC_OK:
        assert NON_NUMERIC not in message, message[:2000]
    assert len(response.content) < 4000  # no input echoed back
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_the_suite_is_broad():
    assert len(CASES) >= 90
    assert len({c[0] for c in CASES}) == len(CASES)
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
