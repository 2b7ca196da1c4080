"""``qarray.tesseract.jit_request``: an endpoint function of the request dict
compiled with its array leaves traced and the rest (strings, flags, None)
static, against the same function in NumPy; and the split into arrays and a
hashable rest that the residual cache and the row merging key on. The rest of
``_request``: the contract's checks in test_bad_input_*.py, ``request_dict``
in test_endpoints.py.
"""

import jax.numpy as jnp
import numpy as np

from qarray.tesseract import jit_request
from qarray.tesseract._request import merge_request, split_request


def numpy_layer(inputs, scale):
    y = inputs["x"].astype(np.float64) @ inputs["w"] * scale
    if inputs["bias"] is not None:
        y = y + inputs["bias"]
    return np.maximum(y, 0) if inputs["activation"] == "relu" else y


def request(rng, activation="relu", bias=True):
    return {
        "x": rng.standard_normal((2, 3)).astype(np.float32),
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "bias": rng.standard_normal(4).astype(np.float32) if bias else None,
        "activation": activation,
    }


def test_arrays_are_traced_and_the_rest_is_static(rng):
    traces = []

    def layer(inputs, scale):
        traces.append(inputs["activation"])
        y = inputs["x"] @ inputs["w"] * scale
        if inputs["bias"] is not None:
            y = y + inputs["bias"]
        return jnp.maximum(y, 0) if inputs["activation"] == "relu" else y

    compiled = jit_request(layer)
    for inputs, scale in [
        (request(rng), np.float32(2)),
        (request(rng), np.float32(3)),  # new values, the same shapes: no trace
        (request(rng, "none"), np.float32(2)),  # a string changes: traced again
        (request(rng, "none", bias=False), np.float32(2)),  # None: again
        (request(rng, "none", bias=False), np.float32(5)),
    ]:
        got = np.asarray(compiled(inputs, scale))
        np.testing.assert_allclose(
            got, numpy_layer(inputs, scale), rtol=1e-5, atol=1e-5
        )
    assert traces == ["relu", "none", "none"]


def test_split_and_merge_invert_each_other(rng):
    inputs = {**request(rng), "layers": [{"w": np.ones(2), "flag": True}, None]}
    arrays, static = split_request(inputs)
    merged = merge_request(arrays, static)
    assert merged.keys() == inputs.keys()
    assert (
        merged["x"] is inputs["x"]
        and merged["layers"][0]["w"] is inputs["layers"][0]["w"]
    )
    assert merged["activation"] == "relu" and merged["layers"][0]["flag"] is True
    assert merged["bias"] is inputs["bias"] and merged["layers"][1] is None
    assert sum(a is not None for a in arrays) == 4  # x, w, bias, layers.[0].w
    # the rest is hashable and the same for requests that differ in values only
    other = {**request(rng), "layers": [{"w": np.zeros(2), "flag": True}, None]}
    assert hash(static) == hash(split_request(other)[1])
    assert static == split_request(other)[1]
    assert static != split_request({**other, "activation": "none"})[1]
