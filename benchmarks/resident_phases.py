"""Where a resident apply's server time goes, phase by phase, in this process:
the served resident row's request (3 relu layers 2048 wide, int8 weight-only,
16 rows of x, base64) through our server's own steps, with the caches warm
and right after a dense float32 call of the same shape (what the served
suite's interleaving does to each of our calls: dense reads 48 MB of weights).

    .venv/bin/python -m benchmarks.resident_phases [--calls 200]

Phases: ``parse`` (the guard's ``parse_body``), ``validate`` (the apply
payload schema: decoding x, the contract's checks), ``endpoint``
(tesseract-core's apply endpoint: ours, the batcher, the compiled call, the
output schema), ``response`` (``create_response``, json+base64) and, inside
the endpoint, ``compute`` (the compiled call alone, blocked on). Medians of
``--calls`` calls each way. docs/performance-notes.md keeps the figures;
not a `make bench` suite (the served suite times the whole round trip).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

ROWS, WIDTH, DEPTH = 16, 2048, 3
PHASES = ("parse", "validate", "endpoint", "response")


def _server(folder: Path):
    """Our app for the resident model (QARRAY_MODEL), its apply schema and
    endpoint, and the API module."""
    import sys

    from benchmarks import bench_e2e
    from qarray.checkpoint import save_model

    rng = np.random.default_rng(0)
    _, layers = bench_e2e.network(rng, (ROWS, WIDTH, WIDTH), DEPTH, "relu", layout="nk")
    save_model(folder / "resident.safetensors", layers)
    root = Path(__file__).resolve().parents[1]
    os.environ.update(
        QARRAY_MODEL=str(folder / "resident.safetensors"),
        TESSERACT_API_PATH=str(root / "tesseract_api.py"),
        TESSERACT_OUTPUT_PATH=str(folder),
    )
    from qarray.tesseract._server import create_app
    from qarray.tesseract._workarounds import ComputeRoutes

    app = create_app()
    while not isinstance(app, ComputeRoutes):
        app = app.app
    schema, endpoint = app.routes["/apply"]
    api = next(m for m in sys.modules.values() if hasattr(m, "ENDPOINTS"))
    return schema, endpoint, api


def _dense_call(rng):
    """A dense float32 3-layer call of the same shape, blocked on."""
    import jax
    import jax.numpy as jnp

    weights = [
        jnp.asarray(rng.standard_normal((WIDTH, WIDTH)), jnp.float32)
        for _ in range(DEPTH)
    ]
    x = jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32)

    @jax.jit
    def dense(x, weights):
        for w in weights:
            x = jax.nn.relu(x @ w)
        return x

    return lambda: jax.block_until_ready(dense(x, weights))


def measure(calls: int) -> dict[str, tuple[float, float]]:
    """{phase: (us warm, us after a dense call)}."""
    import jax
    from tesseract_core.runtime import serve as tesseract_serve

    from qarray.tesseract._json_body import parse_body
    from qarray.tesseract.internal import request_dict

    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as name:
        schema, endpoint, api = _server(Path(name))
        x = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
        array = {
            "object_type": "array",
            "shape": [ROWS, WIDTH],
            "dtype": "float32",
            "data": {
                "buffer": base64.b64encode(x.tobytes()).decode(),
                "encoding": "base64",
            },
        }
        body = json.dumps({"inputs": {"x": array}}).encode()
        encoding = tesseract_serve.negotiate_encoding("application/json+base64")
        payload = schema.model_validate(parse_body(body))
        request = request_dict(
            payload.root.inputs if hasattr(payload, "root") else payload.inputs
        )
        compiled, resident = api.ENDPOINTS._compiled, api.RUNTIME.resident

        def phases() -> list[float]:
            stamps = [time.perf_counter()]
            tree = parse_body(body)
            stamps.append(time.perf_counter())
            validated = schema.model_validate(tree)
            stamps.append(time.perf_counter())
            outputs = endpoint(validated)
            stamps.append(time.perf_counter())
            tesseract_serve.create_response(
                outputs, encoding, base_dir=name, binref_dir=None
            )
            stamps.append(time.perf_counter())
            return np.diff(stamps)

        def compute() -> list[float]:
            start = time.perf_counter()
            jax.block_until_ready(compiled(request, resident))
            return [time.perf_counter() - start]

        dense = _dense_call(rng)
        figures = {}
        for names, run in ((PHASES, phases), (("compute (within endpoint)",), compute)):
            for _ in range(20):
                run()
                dense()
            warm = np.median([run() for _ in range(calls)], axis=0)
            cold = []
            for _ in range(calls):
                dense()
                cold.append(run())
            cold = np.median(cold, axis=0)
            figures.update(
                {
                    n: (1e6 * w, 1e6 * c)
                    for n, w, c in zip(names, warm, cold, strict=True)
                }
            )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    figures = measure(args.calls)
    print("| phase | us, caches warm | us, after a dense call |")
    print("|---|---|---|")
    for name, (warm, cold) in figures.items():
        print(f"| {name} | {warm:.0f} | {cold:.0f} |")
    total = [sum(figures[p][i] for p in PHASES) for i in (0, 1)]
    print(f"| total of the four phases | {total[0]:.0f} | {total[1]:.0f} |")


if __name__ == "__main__":
    main()
