"""Malformed requests to the gradient endpoints (vector_jacobian_product,
jacobian_vector_product, jacobian) get a 4xx naming the field: differentiable
paths that are not, or that name an array the request did not give (LoRA
factors included); tangents and cotangents of the wrong shape, dtype, key or
encoding, or not finite; Jacobians over QARRAY_MAX_ELEMENTS.

The requests the cases start from, the check and the server:
tests/tesseract/bad_requests.py, conftest.py's bad_input_server.

Covers: qarray/tesseract/_paths.py, qarray/tesseract/_request.py
"""

import numpy as np
import pytest

from support.server import b64
from tests.tesseract.bad_requests import (
    G,
    X,
    batched,
    check_refused,
    f32,
    inputs,
    jacobian,
    jvp,
    layer,
    loc,
    network,
    truncated,
    vjp,
    w_q,
    with_nan,
)

CASES = [
    # paths, vectors and sizes on the one-layer request
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
    (
        "lora-path-not-given",
        "vector_jacobian_product",
        vjp(vjp_inputs=["lora.[0].a"]),
        ["vjp_inputs: 'lora.[0].a' names an array this request did not give"],
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
    # the network: gradient paths the request did not give
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


@pytest.mark.parametrize(
    ("name", "endpoint", "payload", "fragments"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_is_a_4xx_naming_the_field(
    bad_input_server, name, endpoint, payload, fragments
):
    url, _ = bad_input_server
    check_refused(url, name, endpoint, payload, fragments)
