"""A 2-layer quantized network over plain HTTP: apply and vector_jacobian_product.

The requests are what curl would send (JSON bodies, arrays in tesseract's
base64 encoding), made with `requests`: any language with an HTTP client can
do the same. Start the server first (`make serve`), then:

    .venv/bin/python examples/http_client.py [--url http://127.0.0.1:8000]
"""

import argparse
import base64

import numpy as np
import requests


def encode(array) -> dict:
    """An array in tesseract's base64 JSON encoding."""
    array = np.asarray(array, order="C")
    return {
        "object_type": "array",
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "data": {
            "buffer": base64.b64encode(array.tobytes()).decode(),
            "encoding": "base64",
        },
    }


def decode(obj):
    """Every array in a response (base64 or JSON lists) as NumPy, recursively."""
    if isinstance(obj, dict) and obj.get("object_type") == "array":
        data = obj["data"]
        if data["encoding"] == "base64":
            raw = np.frombuffer(base64.b64decode(data["buffer"]), obj["dtype"])
        else:
            raw = np.asarray(data["buffer"], obj["dtype"])
        return raw.reshape(obj["shape"])
    if isinstance(obj, dict):
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj


def post(url, endpoint, body):
    """POST a JSON body; the decoded response, or the server's 4xx message."""
    response = requests.post(f"{url}/{endpoint}", json=body, timeout=60)
    if response.status_code >= 400:
        detail = response.json()["detail"]
        if isinstance(detail, list):  # the schema's errors, pydantic's format
            detail = "; ".join(error["msg"] for error in detail)
        raise RuntimeError(f"{response.status_code}: {detail}")
    return decode(response.json())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    url = args.url.rstrip("/")

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)  # a batch of 4 inputs
    # layer 0 stored (out, in) like PyTorch's nn.Linear ("nk"), layer 1 (in, out)
    w0 = (rng.standard_normal((32, 64)) / 8).astype(np.float32)
    b0 = (rng.standard_normal(32) / 10).astype(np.float32)
    w1 = (rng.standard_normal((32, 16)) / 6).astype(np.float32)
    b1 = np.zeros(16, np.float32)
    layers = [
        {"w": encode(w0), "bias": encode(b0), "layout": "nk", "activation": "relu"},
        {"w": encode(w1), "bias": encode(b1), "layout": "kn"},
    ]

    # apply: y, and each layer's int8 weights when asked (return_w_q)
    inputs = {"x": encode(x), "layers": layers}
    out = post(url, "apply", {"inputs": {**inputs, "return_w_q": True}})
    y = out["y"]
    dense = np.maximum(x @ w0.T + b0, 0) @ w1 + b1
    print(
        f"y: shape {y.shape}, relative error vs dense float32: "
        f"{np.linalg.norm(y - dense) / np.linalg.norm(dense):.2e}"
    )
    for i, layer in enumerate(out["layers"]):
        qvalue, scale = layer["w_q"]["qvalue"], layer["w_q"]["scale"]
        print(
            f"layers.[{i}]: int8 weights {qvalue.shape} with {scale.shape} scales, "
            f"weight error {layer['weight_error']:.2e}"
        )

    # vector_jacobian_product: the gradient of sum(y^2), straight-through for w
    paths = ["x", "layers.[0].w", "layers.[0].bias", "layers.[1].w"]
    grads = post(
        url,
        "vector_jacobian_product",
        {
            "inputs": inputs,
            "vjp_inputs": paths,
            "vjp_outputs": ["y"],
            "cotangent_vector": {"y": encode(2 * y)},
        },
    )
    for path in paths:
        norm = np.linalg.norm(grads[path])
        print(f"d sum(y^2) / d {path}: shape {grads[path].shape}, norm {norm:.3f}")

    # the int8 weights go back in as w_q: the same y, and exact gradients for
    # the scales
    quantized = [
        {k: v for k, v in layer.items() if k != "w"}
        | {"w_q": {k: encode(v) for k, v in got["w_q"].items()}}
        for layer, got in zip(layers, out["layers"], strict=True)
    ]
    again = post(url, "apply", {"inputs": {"x": encode(x), "layers": quantized}})
    print(f"w_q round trip max |dy|: {np.abs(again['y'] - y).max():.1e}")
    scales = post(
        url,
        "vector_jacobian_product",
        {
            "inputs": {"x": encode(x), "layers": quantized},
            "vjp_inputs": ["layers.[0].w_q.scale", "layers.[1].w_q.scale"],
            "vjp_outputs": ["y"],
            "cotangent_vector": {"y": encode(2 * y)},
        },
    )
    for path, grad in sorted(scales.items()):
        print(f"d sum(y^2) / d {path}: shape {grad.shape}")

    # bad input: a 4xx that names the field and the shapes
    bad = [layers[0], {**layers[1], "w": encode(w1[:20])}]
    try:
        post(url, "apply", {"inputs": {"x": encode(x), "layers": bad}})
    except RuntimeError as error:
        print(f"a mismatched layer is refused: {error}")


if __name__ == "__main__":
    main()
