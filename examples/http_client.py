"""apply + vector_jacobian_product over HTTP with tesseract-core's Python client.

Start the server first (`make serve`), then:

    .venv/bin/python examples/http_client.py [--url http://127.0.0.1:8000]
"""

import argparse

import numpy as np
from tesseract_core import Tesseract


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)  # activations (M, K)
    w = rng.standard_normal((64, 16)).astype(np.float32)  # weights (K, N)
    bias = np.zeros(16, np.float32)

    tess = Tesseract.from_url(args.url)
    out = tess.apply({"x": x, "w": w, "bias": bias})
    y = out["y"]
    dense = x @ w + bias
    print(
        f"y: shape {y.shape}, relative error vs dense float32: "
        f"{np.linalg.norm(y - dense) / np.linalg.norm(dense):.2e}"
    )
    print(
        f"weights quantized to int8 {out['w_q']['qvalue'].shape} with "
        f"{out['w_q']['scale'].shape} scales, weight error {out['weight_error']:.2e}"
    )

    # gradient of sum(y**2) with respect to x, w (straight-through) and bias
    cotangent = 2 * y
    grads = tess.vector_jacobian_product(
        {"x": x, "w": w, "bias": bias}, ["x", "w", "bias"], ["y"], {"y": cotangent}
    )
    for name, grad in sorted(grads.items()):
        norm = np.linalg.norm(grad)
        print(f"d sum(y^2) / d {name}: shape {grad.shape}, norm {norm:.3f}")

    # the quantized weights go back in as w_q: same y, exact gradient for the scales
    again = tess.apply({"x": x, "w_q": out["w_q"], "bias": bias})
    print(f"w_q round trip max |dy|: {np.abs(again['y'] - y).max():.1e}")


if __name__ == "__main__":
    main()
