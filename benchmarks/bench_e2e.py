"""End to end over HTTP: qarray's Tesseract against a dense float32 Tesseract.

The baseline is benchmarks/dense_api.py: a plain JAX network written the way
tesseract-core's examples are (``@eqx.filter_jit apply_jit``, the
``jax_recipes`` helpers, no qarray), taking the same request and answering y
in float32, served by stock ``tesseract-runtime serve`` (what a user would run
instead); ours by ``qarray-serve`` (tesseract-core's app behind our guard).
Both are real processes on loopback (base64 arrays), started here and
stopped by PID. Each row times
ours and the baseline in one interleaved run (benchmarks/_timing.py: warm-up
excluded, rotating order, medians) and reports ours / dense, lower is better.

Requests are encoded once and posted as bytes; the response is read whole (not
decoded) so a row times the server and the wire, except the QAT rows, which
time a whole ``jax.jit(jax.value_and_grad(loss))`` step through tesseract-jax's
``apply_tesseract`` (client encoding and decoding included, the same for both).

``breakdown(...)`` splits one request's server time into stages, measured in
this process on the same bodies: guard (the request guard reading and checking
the body), decode (JSON parse + base64 to NumPy), validation (the schema's
checks beyond decoding), compute (the endpoint, blocked on), encode (the
response body); `run` attaches it to the rows it times.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import requests

from benchmarks._timing import interleaved
from support.server import ROOT, RUNTIME, SERVE, b64, serve

# the baseline runs as a user would run it: stock tesseract-runtime serve
PROGRAMS = {"ours": SERVE, "dense": RUNTIME}

DENSE_API = ROOT / "benchmarks/dense_api.py"
BASELINE = (
    "dense float32 Tesseract (benchmarks/dense_api.py) under stock "
    "tesseract-runtime serve, same request with float32 weights"
)
UNIT = "x the dense time (lower is better)"

# (row, weights in the request, (M, K, N), target): one layer K -> N
APPLY = (
    ("apply, int8 w_q in the request", "w_q", (16, 2048, 2048), 0.5),
    ("apply, int8 w_q in the request", "w_q", (256, 1024, 1024), 0.7),
    ("apply, dense w in the request (return_w_q false)", "w", (16, 2048, 2048), 1.0),
    ("apply, dense w in the request (return_w_q false)", "w", (256, 1024, 1024), 1.0),
    ("vjp wrt x, int8 w_q in the request", "w_q", (256, 1024, 1024), None),
)
# (row, depth, activation, (M, K, N), target): every layer after the first N -> N
QAT = (
    ("QAT step through tesseract-jax, 1 layer", 1, "none", (128, 1024, 1024), 1.0),
    ("QAT step through tesseract-jax, 3-layer relu", 3, "relu", (128, 1024, 1024), 0.9),
)
# resident models, PyTorch's (out, in) layout ("nk", what the converter writes)
RESIDENT = (
    ("resident model apply, 1 layer", 1, "none", (16, 4096, 4096), 0.9, 0.3),
    ("resident model apply, 3-layer relu", 3, "relu", (16, 2048, 2048), 0.5, 0.3),
)


# --- requests


def network(rng, shape, depth=1, activation="none", layout="kn"):
    """x (M, K) and ``depth`` layers (K -> N, then N -> N), dense float32."""
    m, k, n = shape
    layers, width = [], k
    for i in range(depth):
        w = (rng.standard_normal((width, n)) / np.sqrt(width)).astype(np.float32)
        layers.append(
            {
                "w": w if layout == "kn" else np.ascontiguousarray(w.T),
                "bias": rng.standard_normal(n).astype(np.float32),
                "layout": layout,
                "activation": "none" if i == depth - 1 else activation,
            }
        )
        width = n
    return rng.standard_normal((m, k)).astype(np.float32), layers


def quantized(layers):
    """The layers with their weights pre-quantized (w_q), as qarray would."""
    from qarray._numerics import quantize_rows_np as quantize_rows

    out = []
    for layer in layers:
        qvalue, scale = quantize_rows(layer["w"])
        rest = {k: v for k, v in layer.items() if k != "w"}
        out.append({**rest, "w_q": {"qvalue": qvalue, "scale": scale}})
    return out


def encoded(tree):
    if isinstance(tree, np.ndarray):
        return b64(tree)
    if isinstance(tree, dict):
        return {k: encoded(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [encoded(v) for v in tree]
    return tree


def body(inputs: dict, **extra) -> bytes:
    return json.dumps({"inputs": encoded(inputs), **encoded(extra)}).encode()


def poster(session, url, endpoint, data):
    headers = {"Content-Type": "application/json"}

    def post():
        response = session.post(
            f"{url}/{endpoint}", data=data, headers=headers, timeout=300
        )
        if response.status_code != 200:
            raise RuntimeError(f"{url}/{endpoint}: {response.text[:500]}")
        return None

    return post


def vjp_body(inputs: dict, paths, cotangent) -> bytes:
    return body(
        inputs,
        vjp_inputs=sorted(paths),
        vjp_outputs=["y"],
        cotangent_vector={"y": cotangent},
    )


def _row(name, shape, times, target, **extra):
    return {
        "row": f"end to end: {name}",
        "shape": shape,
        "baseline": BASELINE,
        "ratio": times["ours"] / times["dense"],
        "target": target,
        "unit": UNIT,
        "lower_is_better": True,
        "ms": 1e3 * times["ours"],
        "baseline_ms": 1e3 * times["dense"],
        **extra,
    }


def _apply_rows(urls, apis, reps, breakdown_reps):
    rows = []
    session = requests.Session()
    for name, kind, shape, target in APPLY:
        rng = np.random.default_rng(0)
        x, layers = network(rng, shape)
        ours_layers = quantized(layers) if kind == "w_q" else layers
        if name.startswith("vjp"):
            g = rng.standard_normal((shape[0], shape[2])).astype(np.float32)
            endpoint = "vector_jacobian_product"
            data = {
                "ours": vjp_body({"x": x, "layers": ours_layers}, ["x"], g),
                "dense": vjp_body({"x": x, "layers": layers}, ["x"], g),
            }
        else:
            endpoint = "apply"
            data = {
                "ours": body({"x": x, "layers": ours_layers}),
                "dense": body({"x": x, "layers": layers}),
            }
        times = interleaved(
            {k: poster(session, urls[k], endpoint, data[k]) for k in data}, reps=reps
        )
        stages = {
            k: breakdown(apis[k], endpoint, data[k], breakdown_reps) for k in data
        }
        rows.append(
            _row(
                name,
                shape,
                times,
                target,
                body_mb={k: len(v) / 1e6 for k, v in data.items()},
                breakdown=stages,
            )
        )
    return rows


def _qat_rows(urls, apis, reps, breakdown_reps):
    import jax.numpy as jnp

    rows = []
    for name, depth, activation, shape, target in QAT:
        rng = np.random.default_rng(0)
        x, layers = network(rng, shape, depth, activation)
        target_y = rng.standard_normal((shape[0], shape[2])).astype(np.float32)
        params = [
            {"w": jnp.asarray(layer["w"]), "bias": jnp.asarray(layer["bias"])}
            for layer in layers
        ]
        static = [
            {"layout": layer["layout"], "activation": layer["activation"]}
            for layer in layers
        ]

        steps = {
            k: _qat_step(urls[k], params, static, x, target_y)
            for k in ("ours", "dense")
        }
        times = interleaved(steps, reps)
        # the two requests of a step: apply, then the VJP of the parameters
        paths = [f"layers.[{i}].{p}" for i in range(depth) for p in ("w", "bias")]
        g = (2 / target_y.size * rng.standard_normal(target_y.shape)).astype(np.float32)
        stages = {}
        for k in ("ours", "dense"):
            apply_stages = breakdown(
                apis[k], "apply", body({"x": x, "layers": layers}), breakdown_reps
            )
            vjp_stages = breakdown(
                apis[k],
                "vector_jacobian_product",
                vjp_body({"x": x, "layers": layers}, paths, g),
                breakdown_reps,
            )
            stages[k] = {s: apply_stages[s] + vjp_stages[s] for s in apply_stages}
        rows.append(_row(name, shape, times, target, breakdown=stages))
    return rows


def _qat_step(url, params, static, x, target):
    """One jax.jit(jax.value_and_grad(loss)) step through apply_tesseract."""
    import jax
    import jax.numpy as jnp
    from tesseract_core import Tesseract
    from tesseract_jax import apply_tesseract

    tess = Tesseract.from_url(url)

    def loss(params, x, target):
        layers = [{**p, **s} for p, s in zip(params, static, strict=True)]
        y = apply_tesseract(tess, {"x": x, "layers": layers})["y"]
        return jnp.mean((y - target) ** 2)

    step = jax.jit(jax.value_and_grad(loss))
    x, target = jnp.asarray(x), jnp.asarray(target)
    return lambda: step(params, x, target)


def _resident_rows(tmp, apis, reps, breakdown_reps):
    from qarray._numerics import quantize_rows_np as quantize_rows
    from qarray.checkpoint import save_model

    rows = []
    session = requests.Session()
    for name, depth, activation, shape, target, bytes_target in RESIDENT:
        rng = np.random.default_rng(0)
        x, layers = network(rng, shape, depth, activation, layout="nk")
        path = tmp / f"resident-{depth}.safetensors"
        save_model(path, layers)
        data = body({"x": x})
        with ExitStack() as stack:
            urls = {}
            for k, api_path in (
                ("ours", ROOT / "tesseract_api.py"),
                ("dense", DENSE_API),
            ):
                folder = tmp / f"resident-{depth}-{k}"
                folder.mkdir()
                env = {"QARRAY_MODEL": str(path)}
                urls[k] = stack.enter_context(
                    serve(folder, api_path, env=env, program=PROGRAMS[k])
                )
            times = interleaved(
                {k: poster(session, urls[k], "apply", data) for k in urls}, reps=reps
            )
        rows.append(_row(name, shape, times, target))
        # what each server keeps on the device: int8 payload, one float32 scale
        # per output channel and the bias, against float32 weights and the bias
        ours = dense = 0
        for layer in layers:
            qvalue, scale = quantize_rows(layer["w"])
            ours += qvalue.nbytes + scale.nbytes + layer["bias"].nbytes
            dense += layer["w"].nbytes + layer["bias"].nbytes
        rows.append(
            {
                "row": f"end to end: {name}, device bytes of the model",
                "shape": shape,
                "baseline": "the dense Tesseract's resident float32 weights and "
                "biases (ours: int8 payload + scales + biases)",
                "ratio": ours / dense,
                "target": bytes_target,
                "unit": "x the dense bytes (lower is better)",
                "lower_is_better": True,
                "bytes": ours,
                "baseline_bytes": dense,
            }
        )
    return rows


def run(reps=31, breakdown_reps=5):
    from qarray.tesseract.internal import keep_freed_memory

    # this process (the clients, and the in-process breakdown) with the
    # servers' malloc settings: both sides of the wire, and each stage, then
    # run as they do in qarray-serve
    keep_freed_memory()
    apis = {"ours": _ours_api(), "dense": _api(DENSE_API, "dense_api")}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with ExitStack() as stack:
            urls = {}
            for k, api_path in (
                ("ours", ROOT / "tesseract_api.py"),
                ("dense", DENSE_API),
            ):
                (tmp / k).mkdir()
                urls[k] = stack.enter_context(
                    serve(tmp / k, api_path, program=PROGRAMS[k])
                )
            rows = _apply_rows(urls, apis, reps, breakdown_reps)
            rows += _qat_rows(urls, apis, reps, breakdown_reps)
        rows += _resident_rows(tmp, apis, reps, breakdown_reps)
    return rows


# --- stages of one request, measured in this process


def _ours_api():
    sys.path.insert(0, str(ROOT))
    import tesseract_api

    return tesseract_api


def _api(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _guard_ms(data: bytes, reps: int) -> float:
    """The request guard taking a body in 256 KiB messages (asyncio's read
    size; uvicorn hands each on) and checking it, before an app that only
    reads it."""
    from qarray.tesseract import Settings
    from qarray.tesseract.internal import RequestGuard

    async def app(scope, receive, send):
        await receive()

    limits = {"max_request_bytes": 2**30, "max_inflight_bytes": 2**31}
    guard = RequestGuard(app, Settings(**limits, max_concurrency=1), Path("."))
    chunk = 2**18
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    scope = {
        "type": "http",
        "query_string": b"",
        "headers": [(b"content-length", str(len(data)).encode())],
    }

    async def once():
        messages = iter(pieces)

        async def receive():
            piece = next(messages)
            more = piece is not pieces[-1]
            return {"type": "http.request", "body": piece, "more_body": more}

        async def send(message):
            pass

        await guard(scope, receive, send)

    loop = asyncio.new_event_loop()
    try:
        return _median_ms(lambda: loop.run_until_complete(once()), reps)
    finally:
        loop.close()


def _decode_arrays(tree):
    import pybase64

    if isinstance(tree, dict):
        if tree.get("object_type") == "array":
            raw = pybase64.b64decode(tree["data"]["buffer"], validate=True)
            return np.frombuffer(raw, tree["dtype"]).reshape(tree["shape"])
        return {k: _decode_arrays(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_decode_arrays(v) for v in tree]
    return tree


def breakdown(api, endpoint: str, data: bytes, reps: int = 5) -> dict[str, float]:
    """ms per stage of one request ``data`` to ``endpoint`` of ``api``, run
    through tesseract-core's endpoint function (the one its HTTP app calls):
    guard (RequestGuard reading and checking the body), decode (JSON parse and
    base64 to NumPy), validation (the payload schema beyond decoding), compute
    (the endpoint, outputs validated and on the host), encode (the response
    body, json+base64)."""
    import jax
    from tesseract_core.runtime.core import create_endpoints
    from tesseract_core.runtime.file_interactions import output_to_bytes

    # each server's own residual cache (ours: RUNTIME.cache at its default;
    # the dense one has none, tesseract-core's default), kept across calls for
    # the same API, so a VJP after its apply hits, as in a training step
    fn = next(f for f in create_endpoints(api) if f.__name__ == endpoint)
    schema = inspect.signature(fn).parameters["payload"].annotation
    tree = json.loads(data)
    payload = schema.model_validate(tree)
    result = jax.block_until_ready(fn(payload))
    parse = _median_ms(lambda: json.loads(data), reps)
    arrays = _median_ms(lambda: _decode_arrays(tree), reps)
    validate = _median_ms(lambda: schema.model_validate(tree), reps)
    return {
        "guard": _guard_ms(data, reps),
        "decode": parse + arrays,
        "validation": max(validate - arrays, 0.0),
        "compute": _median_ms(lambda: jax.block_until_ready(fn(payload)), reps),
        "encode": _median_ms(lambda: output_to_bytes(result, "json+base64"), reps),
    }


def table(rows) -> str:
    """The breakdown of every row that has one, ms (ours / dense)."""
    stages = ("guard", "decode", "validation", "compute", "encode")
    lines = [
        "| row | shape | " + " | ".join(stages) + " | sum | measured end to end |",
        "|---|---|" + "---|" * (len(stages) + 2),
    ]
    for row in rows:
        if "breakdown" not in row:
            continue
        b = row["breakdown"]
        cells = [f"{b['ours'][s]:.1f} / {b['dense'][s]:.1f}" for s in stages]
        sums = [sum(b[k][s] for s in stages) for k in ("ours", "dense")]
        lines.append(
            f"| {row['row'].removeprefix('end to end: ')} | {tuple(row['shape'])} | "
            + " | ".join(cells)
            + f" | {sums[0]:.1f} / {sums[1]:.1f}"
            + f" | {row['ms']:.1f} / {row['baseline_ms']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    rows = run(reps=int(sys.argv[1]) if len(sys.argv) > 1 else 31)
    for row in rows:
        print(
            f"{row['row']} {row['shape']}: {row['ratio']:.2f} (target {row['target']})"
        )
    print(table(rows))
