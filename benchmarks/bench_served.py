"""The served paths: qarray's Tesseract against stock dense float32, per transport.

Three ways a user calls a Tesseract, each side by side with what they would
run instead (benchmarks/dense_api.py, a plain float32 JAX Tesseract written
like tesseract-core's examples, served by stock tesseract-core), through the
same client (tesseract-core's ``Tesseract`` and tesseract-jax):

- ``base64``: HTTP on loopback, arrays as base64 JSON: ours under
  ``qarray-serve``, the baseline under ``tesseract-runtime serve``;
- ``binref``: one host, arrays as binref files on ``/dev/shm`` through the
  binref pool: ours by ``qarray.tesseract.shared_memory_tesseract``
  (``qarray-serve``), the baseline by ``Tesseract.from_source`` with the same
  folders and options (debug mode off on both: from_source's default starts
  a debugger in the server);
- ``in-process``: ``Tesseract.from_tesseract_api``, no server.

Rows (ratios ours / baseline, lower is better, interleaved in one run):
resident 3-layer relu models, applies with dense ``w`` (three weight sets in
turn), a QAT loop through tesseract-jax (``jax.value_and_grad``, new weights
every step), the residual cache on / off in that loop, and the framework's
own cost (a tiny request, 100,000 and 10 million elements against a trivial
Tesseract that returns x). ``breakdown`` splits one request's server time into
stages, measured in this process on the bodies each transport sends.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import bench_e2e
from benchmarks._timing import interleaved
from support.server import ROOT, RUNTIME, SERVE, serve

TRANSPORTS = ("base64", "binref", "in-process")
OURS, DENSE = ROOT / "tesseract_api.py", ROOT / "benchmarks/dense_api.py"
TRIVIAL = ROOT / "benchmarks/trivial_api.py"
BASELINE = "dense float32 Tesseract (benchmarks/dense_api.py), stock tesseract-core"
UNIT = "x the baseline's time (lower is better)"

# (row, (M, K, N), {transport: target})
RESIDENT = (
    ("resident 3-layer relu", (1, 2048, 2048), {"base64": 0.8}),
    ("resident 3-layer relu", (16, 2048, 2048), {"base64": 0.65, "binref": 0.65}),
)
DENSE_W = (
    ("apply, dense w in the request", (16, 2048, 2048), {"base64": 1.0}),
    ("apply, dense w in the request", (256, 1024, 1024), {"base64": 1.0}),
)
# issue 43: the QAT loop at most 0.95x dense's step over either transport
QAT = ("QAT loop, 3-layer relu", (128, 1024, 1024), {"base64": 0.95, "binref": 0.95})
# the framework's own cost: (row, elements of x, target); ours is our
# Tesseract (a 4 x 4 layer on x, so y is as big as x) or our server
# (qarray-serve) serving the trivial Tesseract, both against the trivial
# Tesseract under stock tesseract-core
OVERHEAD = (
    ("tiny request", 4, 1.1),
    ("100,000 elements", 100_000, None),
    ("10 million elements", 10_000_000, None),
)
WEIGHT_SETS = 3  # applies with dense w cycle through this many
# the resident rows take a few ms a call, and each call finds the caches as
# the other server left them or as it left them itself (the rotating order):
# more calls than the other rows, so the median is not the luck of a few
RESIDENT_REPS_FACTOR = 3
QAT_STEP_SIZE = 1e-3


# --- the Tesseracts


@contextlib.contextmanager
def _environ(env: dict):
    """os.environ with ``env`` added, for code that reads it once (an API
    module's import, a child process's start)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def tesseract(transport: str, api: Path, tmp: Path, *, ours: bool, env=None):
    """A ``Tesseract`` serving ``api`` over ``transport``: ours (qarray-serve)
    or stock tesseract-core's server; ``env`` its settings."""
    from tesseract_core import Tesseract

    from qarray.tesseract import shared_memory_tesseract

    env = {"JAX_PLATFORMS": "cpu", **(env or {})}
    folder = Path(tempfile.mkdtemp(dir=tmp))
    if transport == "base64":
        program = SERVE if ours else RUNTIME
        with serve(folder, api, env=env, program=program) as url:
            yield Tesseract.from_url(url)
    elif transport == "binref":
        if ours:
            tess = shared_memory_tesseract(api, folder, environment=env)
        else:
            (folder / "inputs").mkdir()
            with _environ(env):  # from_source's child inherits it
                tess = Tesseract.from_source(
                    api,
                    input_path=folder / "inputs",
                    output_path=folder / "outputs",
                    output_format="json+binref",
                    python_executable=sys.executable,
                    runtime_config={"debug": False},
                    experimental_binref_pool=True,
                )
        with _environ(env), tess:
            yield tess
    else:
        with _environ(env):
            yield Tesseract.from_tesseract_api(api)


# --- requests


def _shared_memory() -> Path:
    return (
        Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    )


def _apply(tess, requests_):
    """Apply each request in turn; outputs pulled to the host."""
    state = {"i": 0}

    def call():
        inputs = requests_[state["i"] % len(requests_)]
        state["i"] += 1
        return tess.apply(inputs)["y"]

    return call


def _qat_loop(tess, params, static, x, target):
    """One step of ``jax.jit(jax.value_and_grad(loss))`` through
    ``apply_tesseract``, then SGD: new weights every step."""
    import jax
    import jax.numpy as jnp
    from tesseract_jax import apply_tesseract

    def loss(params, x, target):
        layers = [{**p, **s} for p, s in zip(params, static, strict=True)]
        y = apply_tesseract(tess, {"x": x, "layers": layers})["y"]
        return jnp.mean((y - target) ** 2)

    step = jax.jit(jax.value_and_grad(loss))
    x, target = jnp.asarray(x), jnp.asarray(target)
    state = {"params": jax.tree.map(jnp.asarray, params)}

    def call():
        value, grads = step(state["params"], x, target)
        state["params"] = jax.tree.map(
            lambda p, g: p - QAT_STEP_SIZE * g, state["params"], grads
        )
        return value

    return call


def _qat_problem():
    rng = np.random.default_rng(0)
    _, shape, _ = QAT
    x, layers = bench_e2e.network(rng, shape, 3, "relu")
    target = rng.standard_normal((shape[0], shape[2])).astype(np.float32)
    params = [{"w": layer["w"], "bias": layer["bias"]} for layer in layers]
    static = [{"layout": "kn", "activation": layer["activation"]} for layer in layers]
    return x, layers, params, static, target


def _row(name, transport, shape, times, target, baseline=BASELINE, **extra):
    ratio = times["ours"] / times["baseline"]
    return {
        "row": f"served ({transport}): {name}",
        "shape": shape,
        "baseline": baseline,
        "ratio": ratio,
        "target": target,
        "unit": UNIT,
        "lower_is_better": True,
        "ms": 1e3 * times["ours"],
        "baseline_ms": 1e3 * times["baseline"],
        **extra,
    }


# --- rows


def _resident_rows(transport, tmp, reps):
    from qarray.checkpoint import save_model

    rows = []
    rng = np.random.default_rng(0)
    _, shape, _ = RESIDENT[0]
    _, layers = bench_e2e.network(rng, shape, 3, "relu", layout="nk")
    path = tmp / "resident.safetensors"
    save_model(path, layers)
    env = {"QARRAY_MODEL": str(path)}
    with (
        tesseract(transport, OURS, tmp, ours=True, env=env) as ours,
        tesseract(transport, DENSE, tmp, ours=False, env=env) as dense,
    ):
        for name, (m, k, _), targets in RESIDENT:
            xs = [
                {"x": rng.standard_normal((m, k)).astype(np.float32)} for _ in range(4)
            ]
            times = interleaved(
                {"ours": _apply(ours, xs), "baseline": _apply(dense, xs)}, reps
            )
            rows.append(_row(name, transport, (m, k, k), times, targets.get(transport)))
    return rows


def _dense_w_rows(transport, tmp, reps):
    rows = []
    with (
        tesseract(transport, OURS, tmp, ours=True) as ours,
        tesseract(transport, DENSE, tmp, ours=False) as dense,
    ):
        for name, shape, targets in DENSE_W:
            rng = np.random.default_rng(0)
            requests_ = []
            for _ in range(WEIGHT_SETS):
                x, layers = bench_e2e.network(rng, shape)
                requests_.append({"x": x, "layers": layers})
            times = interleaved(
                {"ours": _apply(ours, requests_), "baseline": _apply(dense, requests_)},
                reps,
            )
            rows.append(_row(name, transport, shape, times, targets.get(transport)))
    return rows


def _qat_row(transport, tmp, reps):
    """The QAT loop on servers of its own, as a training loop's are: after the
    dense-w rows' 16 MiB arrays the stock server's glibc malloc keeps the
    loop's 4 MiB arrays on its heap (its dynamic mmap threshold raised past
    them), which a server that serves the loop alone does not
    (docs/performance-notes.md); ours sets its thresholds at start-up."""
    name, shape, targets = QAT
    x, _, params, static, target = _qat_problem()
    with (
        tesseract(transport, OURS, tmp, ours=True) as ours,
        tesseract(transport, DENSE, tmp, ours=False) as dense,
    ):
        times = interleaved(
            {
                "ours": _qat_loop(ours, params, static, x, target),
                "baseline": _qat_loop(dense, params, static, x, target),
            },
            reps,
        )
    return _row(name, transport, shape, times, targets.get(transport))


def _cache_row(transport, tmp, reps):
    """Ours in the QAT loop with the residual cache on (the default) / off."""
    name, shape, _ = QAT
    x, _, params, static, target = _qat_problem()
    with (
        tesseract(transport, OURS, tmp, ours=True) as on,
        tesseract(
            transport, OURS, tmp, ours=True, env={"QARRAY_VJP_CACHE_SIZE": "0"}
        ) as off,
    ):
        times = interleaved(
            {
                "ours": _qat_loop(on, params, static, x, target),
                "baseline": _qat_loop(off, params, static, x, target),
            },
            reps,
        )
    target_ratio = 0.95 if transport == "binref" else 1.0
    return _row(
        f"{name}, residual cache on / off",
        transport,
        shape,
        times,
        target_ratio,
        baseline="ours with QARRAY_VJP_CACHE_SIZE=0 (the cache off), same loop",
    )


def _overhead_rows(transport, tmp, reps):
    """Our Tesseract and our server against a trivial stock Tesseract."""
    rows = []
    env = {"QARRAY_MAX_REQUEST_BYTES": str(2**30)}
    with (
        tesseract(transport, OURS, tmp, ours=True, env=env) as ours,
        tesseract(transport, TRIVIAL, tmp, ours=True, env=env) as our_server,
        tesseract(transport, TRIVIAL, tmp, ours=False, env=env) as trivial,
    ):
        for name, elements, target in OVERHEAD:
            rng = np.random.default_rng(0)
            x = rng.standard_normal((max(elements // 4, 1), 4)).astype(np.float32)
            w = np.eye(4, dtype=np.float32)
            request = [{"x": x, "layers": [{"w": w}]}]
            few = max(5, reps // 3) if elements > 10**6 else reps
            times = interleaved(
                {
                    "tesseract": _apply(ours, request),
                    "server": _apply(our_server, request),
                    "baseline": _apply(trivial, request),
                },
                few,
            )
            baseline = (
                "trivial Tesseract returning x (benchmarks/trivial_api.py), "
                "stock tesseract-core, same request"
            )
            rows.append(
                _row(
                    f"{name}, our Tesseract (a 4 x 4 layer)",
                    transport,
                    x.shape,
                    {"ours": times["tesseract"], "baseline": times["baseline"]},
                    target,
                    baseline,
                )
            )
            if transport != "in-process":  # no server there
                rows.append(
                    _row(
                        f"{name}, our server (qarray-serve) serving the trivial one",
                        transport,
                        x.shape,
                        {"ours": times["server"], "baseline": times["baseline"]},
                        None,
                        baseline,
                    )
                )
    return rows


def run(reps=21, transports=TRANSPORTS, breakdown_reps=5):
    import jax

    from qarray.tesseract.internal import keep_freed_memory

    jax.config.update("jax_platforms", "cpu")
    keep_freed_memory()  # the client with the servers' malloc settings
    rows = []
    with tempfile.TemporaryDirectory(dir=_shared_memory()) as tmp:
        tmp = Path(tmp)
        for transport in transports:
            print(f"  served: {transport}", file=sys.stderr, flush=True)
            rows += _resident_rows(transport, tmp, RESIDENT_REPS_FACTOR * reps)
            rows += _dense_w_rows(transport, tmp, reps)
            rows.append(_qat_row(transport, tmp, reps))
            rows.append(_cache_row(transport, tmp, reps))
            rows += _overhead_rows(transport, tmp, reps)
        rows += _own_transport_rows(rows)
        rows += breakdown_rows(tmp, breakdown_reps)
    return rows


def _own_transport_rows(rows):
    """Our QAT loop over shared memory against our own over base64."""
    by = {r["row"]: r for r in rows}
    name = QAT[0]
    shm, b64 = (by.get(f"served ({t}): {name}") for t in ("binref", "base64"))
    if shm is None or b64 is None:
        return []
    return [
        {
            "row": f"served (binref): {name}, against our own base64 loop",
            "shape": QAT[1],
            "baseline": "our QAT loop over base64 HTTP (qarray-serve), same run",
            "ratio": shm["ms"] / b64["ms"],
            "target": 0.5,
            "unit": UNIT,
            "lower_is_better": True,
            "ms": shm["ms"],
            "baseline_ms": b64["ms"],
        }
    ]


# --- where the time goes, per stage, in this process


def _binref_tree(tree, folder: Path):
    """``tree`` with every NumPy array written to ``folder`` as a binref
    file, as tesseract-core's client does (one file an array)."""
    if isinstance(tree, np.ndarray):
        name = f"a{len(list(folder.iterdir()))}.bin"
        np.ascontiguousarray(tree).tofile(folder / name)
        return {
            "object_type": "array",
            "shape": list(tree.shape),
            "dtype": tree.dtype.name,
            "data": {"buffer": f"{name}:0", "encoding": "binref"},
        }
    if isinstance(tree, dict):
        return {k: _binref_tree(v, folder) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_binref_tree(v, folder) for v in tree]
    return tree


def _read_binrefs(tree, folder: Path):
    if isinstance(tree, dict):
        if tree.get("object_type") == "array":
            name = tree["data"]["buffer"].rsplit(":", 1)[0]
            return np.fromfile(folder / name, tree["dtype"]).reshape(tree["shape"])
        return {k: _read_binrefs(v, folder) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_read_binrefs(v, folder) for v in tree]
    return tree


def binref_breakdown(api, endpoint, request: dict, tmp: Path, reps=5):
    """ms per stage of one binref request (``request``: the payload with NumPy
    arrays) to ``endpoint`` of ``api``: parse (the JSON document), decode
    (reading the binref files), validation (the schema beyond decoding),
    compute (the endpoint), encode (the outputs written as binref files)."""
    import inspect

    import jax
    from tesseract_core.runtime.core import create_endpoints
    from tesseract_core.runtime.file_interactions import output_to_bytes

    inputs = Path(tempfile.mkdtemp(dir=tmp))
    outputs = Path(tempfile.mkdtemp(dir=tmp))
    data = json.dumps(_binref_tree(request, inputs)).encode()
    fn = next(f for f in create_endpoints(api) if f.__name__ == endpoint)
    schema = inspect.signature(fn).parameters["payload"].annotation
    context = {"base_dir": str(inputs)}
    tree = json.loads(data)
    payload = schema.model_validate(tree, context=context)
    result = jax.block_until_ready(fn(payload))
    parse = bench_e2e._median_ms(lambda: json.loads(data), reps)
    decode = bench_e2e._median_ms(lambda: _read_binrefs(tree, inputs), reps)
    validate = bench_e2e._median_ms(
        lambda: schema.model_validate(tree, context=context), reps
    )

    def encode():
        output_to_bytes(result, "json+binref", base_dir=str(outputs), binref_dir="r")
        for f in (outputs / "r").iterdir():
            f.unlink()

    return {
        "guard": 0.0,
        "decode": parse + decode,
        "validation": max(validate - decode, 0.0),
        "compute": bench_e2e._median_ms(
            lambda: jax.block_until_ready(fn(payload)), reps
        ),
        "encode": bench_e2e._median_ms(encode, reps),
    }


def breakdown_rows(tmp: Path, reps: int):
    """Stages of the QAT step (apply + vjp) and of an apply with dense w, ours
    and dense, per transport with a body (base64, binref)."""
    apis = {"ours": bench_e2e._ours_api(), "dense": bench_e2e._api(DENSE, "dense_api")}
    x, layers, _, _, target = _qat_problem()
    paths = [f"layers.[{i}].{p}" for i in range(len(layers)) for p in ("w", "bias")]
    g = (2 / target.size * target).astype(np.float32)
    apply_request = {"inputs": {"x": x, "layers": layers}}
    vjp_request = {
        **apply_request,
        "vjp_inputs": paths,
        "vjp_outputs": ["y"],
        "cotangent_vector": {"y": g},
    }
    rows = []
    for transport in ("base64", "binref"):
        stages = {}
        for k, api in apis.items():
            parts = []
            for endpoint, request in (
                ("apply", apply_request),
                ("vector_jacobian_product", vjp_request),
            ):
                if transport == "base64":
                    data = json.dumps(bench_e2e.encoded(request)).encode()
                    parts.append(bench_e2e.breakdown(api, endpoint, data, reps))
                else:
                    parts.append(binref_breakdown(api, endpoint, request, tmp, reps))
            stages[k] = {s: sum(p[s] for p in parts) for s in parts[0]}
        rows.append(
            {
                "row": f"served ({transport}): QAT step stages (apply + vjp)",
                "shape": QAT[1],
                "baseline": BASELINE,
                "ratio": sum(stages["ours"].values()) / sum(stages["dense"].values()),
                "target": None,
                "unit": "x the baseline's server time (sum of stages)",
                "lower_is_better": True,
                "ms": sum(stages["ours"].values()),
                "baseline_ms": sum(stages["dense"].values()),
                "breakdown": stages,
            }
        )
    return rows


def table(rows) -> str:
    """Every served row: ms ours / baseline and the ratio."""
    lines = [
        "| row | shape | ms ours | ms baseline | ratio | target |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["row"].startswith("served"):
            continue
        target = "-" if r["target"] is None else f"<= {r['target']}"
        lines.append(
            f"| {r['row']} | {tuple(r['shape'])} | {r['ms']:.1f} | "
            f"{r['baseline_ms']:.1f} | {r['ratio']:.2f} | {target} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    args = parser.parse_args()
    rows = run(args.reps, tuple(args.transports.split(",")))
    print(table(rows))
    print()
    print(bench_e2e.table(rows))
