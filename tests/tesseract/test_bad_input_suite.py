"""The bad-input suite as a whole (test_bad_input_layer.py, _encoding.py,
_network.py, _gradients.py): the requests its cases start from are accepted
as they are, so each 4xx is for the reason its case names; the cases are
broad (every endpoint, ids unique across the files); and the server they
shared wrote nothing outside its output folder.
"""

import pytest

from support.server import b64
from tests.tesseract import (
    test_bad_input_encoding,
    test_bad_input_gradients,
    test_bad_input_layer,
    test_bad_input_network,
)
from tests.tesseract.bad_requests import (
    ABSTRACT_W,
    ABSTRACT_X,
    MAX_LAYERS,
    NON_NUMERIC_OK,
    batched,
    f32,
    inputs,
    jacobian,
    jvp,
    layer,
    network,
    post,
    spec,
    stray_files,
    vjp,
    w_q,
)

CASES = [
    *test_bad_input_layer.CASES,
    *test_bad_input_encoding.CASES,
    *test_bad_input_network.CASES,
    *test_bad_input_gradients.CASES,
]

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


@pytest.mark.parametrize(
    ("endpoint", "payload"), VALID, ids=[f"{e}-{i}" for i, (e, _) in enumerate(VALID)]
)
def test_the_requests_the_cases_start_from_are_valid(
    bad_input_server, endpoint, payload
):
    url, _ = bad_input_server
    response = post(url, endpoint, payload)
    assert response.status_code == 200, response.text[:2000]


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
    assert NON_NUMERIC_OK <= {c[0] for c in CASES}


def test_nothing_was_written_outside_the_output_folder(bad_input_server):
    """Runs after the cases of the other test_bad_input_*.py files this process
    ran, on the server they shared: pytest takes the files in name order, this
    one last, and xdist's --dist loadfile hands each process its files in that
    order. The fixture checks the same again after the process's last test
    (the check for a process that did not run this file)."""
    _, tmp = bad_input_server
    assert stray_files(tmp) == []
