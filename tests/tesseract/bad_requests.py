"""What the tests/tesseract/test_bad_input_*.py files share (not a test file):
the requests the cases start from and the builders that change one field of
them, the server's limits, and the check every case makes.

Every case changes one thing in a request that the server accepts as is
(test_bad_input_suite.py checks those requests are accepted), so each 4xx is
for the reason the case names. A case is (id, endpoint, JSON payload or a
``Raw`` body, fragments the error message must contain). The server they are
sent to is ``bad_input_server`` (tests/tesseract/conftest.py): one per pytest
process, shared by the files.
"""

import numpy as np
import requests

from support.server import b64

MAX_LAYERS = 4  # QARRAY_MAX_LAYERS of the cases' server
MAX_ELEMENTS = 1_000_000  # its QARRAY_MAX_ELEMENTS
SERVER_ENV = {
    "QARRAY_MAX_ELEMENTS": str(MAX_ELEMENTS),
    "QARRAY_MAX_LAYERS": str(MAX_LAYERS),
}
# tesseract-core's answer to an array it cannot take for one: for the cases
# it would mislead (a wrong rank or dtype is not "non-numeric data")
NON_NUMERIC = "Could not parse value as a numeric array"
# NON_NUMERIC is right for these: the value is not numeric, or not an array
NON_NUMERIC_OK = {"x-is-a-string", "unknown-encoding", "jvp-tangent-string"}

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


def post(url, endpoint, payload):
    if isinstance(payload, Raw):
        return requests.post(
            f"{url}/{endpoint}",
            data=bytes(payload),
            timeout=60,
            headers={"Content-Type": payload.content_type},
        )
    return requests.post(f"{url}/{endpoint}", json=payload, timeout=60)


def check_refused(url, name, endpoint, payload, fragments):
    """The case ``name`` gets a 4xx whose message contains every fragment (and
    not tesseract-core's NON_NUMERIC, where that would mislead), echoes no
    input back, and leaves the server healthy."""
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


def stray_files(tmp):
    """What the server wrote in its folder ``tmp`` outside its output folder
    (its own log, server-PORT.log, aside)."""
    return [
        p
        for p in tmp.rglob("*")
        if not p.is_relative_to(tmp / "outputs") and not p.name.startswith("server-")
    ]
