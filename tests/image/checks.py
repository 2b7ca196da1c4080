"""Requests every image of the Tesseract must answer (the CPU image's tests
and the TPU image's): a 2-layer network against its NumPy reference, a bad
request, a hostile binref."""

import numpy as np
import requests

from support import network as net
from support.server import b64, decode, encode
from tests.image.docker import docker

RTOL = ATOL = 2e-4
TIMEOUT = 120

# a file inside the container that the stock runtime would happily read as a
# float32 array if a client named it in a binref
SECRET = "/tmp/secret.bin"
SECRET_VALUE = 4321.5


def request_inputs(rng):
    """A 2-layer request (both layouts, a nonlinearity) and its NumPy reference:
    y and the VJP for x."""
    inputs = {
        "x": net.normal(rng, (3, 4)),
        "layers": [
            net.make_layer(rng, 4, 5, "kn", "w", True, "relu"),
            net.make_layer(rng, 5, 2, "nk", "w_q", True, "none"),
        ],
    }
    y = net.forward(inputs)
    g = net.normal(rng, y.shape)
    return inputs, y, g, net.vjp(inputs, g)["x"]


def post(url, endpoint, payload):
    return requests.post(f"{url}/{endpoint}", json=payload, timeout=TIMEOUT)


def hostile_binref_request(rng):
    inputs, *_ = request_inputs(rng)
    payload = encode(inputs)
    payload["x"] = {
        "object_type": "array",
        "shape": [1, 4],
        "dtype": "float32",
        "data": {"buffer": f"{SECRET}:0", "encoding": "binref"},
    }
    return {"inputs": payload}


def check_hostile_binref_refused(url, container, rng):
    """A binref naming an absolute path is refused by the guard, unread."""
    docker(
        "exec",
        container,
        "python",
        "-c",
        f"import numpy as n; n.full(4, {SECRET_VALUE}, n.float32).tofile('{SECRET}')",
    )
    response = post(url, "apply", hostile_binref_request(rng))
    assert response.status_code == 422, response.text[:2000]
    assert "must be a relative path inside the input folder" in response.text
    assert str(SECRET_VALUE) not in response.text
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def check_apply_and_vjp(url, rng):
    inputs, y, g, gx = request_inputs(rng)
    response = post(url, "apply", {"inputs": encode(inputs)})
    assert response.status_code == 200, response.text[:2000]
    out = decode(response.json())
    np.testing.assert_allclose(out["y"], y, rtol=RTOL, atol=ATOL)
    response = post(
        url,
        "vector_jacobian_product",
        {
            "inputs": encode(inputs),
            "vjp_inputs": ["x"],
            "vjp_outputs": ["y"],
            "cotangent_vector": {"y": b64(g)},
        },
    )
    assert response.status_code == 200, response.text[:2000]
    np.testing.assert_allclose(decode(response.json())["x"], gx, rtol=RTOL, atol=ATOL)


def check_bad_input_is_a_small_4xx(url, rng):
    """A bias of the wrong width: a small 4xx naming the field and the shape,
    and the server still healthy."""
    inputs, *_ = request_inputs(rng)
    payload = encode(inputs)
    payload["layers"][1]["bias"] = b64(np.zeros(7, np.float32))
    response = post(url, "apply", {"inputs": payload})
    assert 400 <= response.status_code < 500, response.text[:2000]
    assert "layers.[1].bias" in response.text and "(7,)" in response.text
    assert len(response.content) < 4000, len(response.content)  # nothing echoed
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def check_health(url) -> None:
    """/health answers 200 with the runtime's own body."""
    response = requests.get(f"{url}/health", timeout=10)
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
