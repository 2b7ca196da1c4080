"""Serving under load: throughput and latency against concurrent clients.

A resident model served by ``qarray-serve`` (int8, dynamic batching on, the
defaults) against the same model in float32 served by stock
``tesseract-runtime serve`` (benchmarks/dense_api.py, its weights stored
``(K, N)``: the faster float32 spelling), one worker each. Each client is a
thread with its own keep-alive connection sending the same kind of request
as fast as it is answered (its own x, and cotangent for a VJP); 1, 4, 16 and
64 clients. Request kinds: one-row and 16-row applies, one-row
``vector_jacobian_product`` with respect to x; models: 4 relu layers 4096
wide and 3 relu layers 2048 wide (plus a lone VJP at 2 layers 1024 wide). Every
level is warmed (batch sizes compiled) before it is measured; ours and dense
alternate level by level, ``runs`` times; rows give medians and spreads.

The FNO example's Tesseract (examples/neural_operator) is measured the same
way with batching on against itself with batching off
(``QARRAY_MAX_BATCH_ROWS=1``), one-field applies.

    .venv/bin/python -m benchmarks.run --only load
"""

from __future__ import annotations

import contextlib
import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks import bench_e2e
from support.server import ROOT, RUNTIME, b64, serve

OURS, DENSE = ROOT / "tesseract_api.py", ROOT / "benchmarks/dense_api.py"
FNO = ROOT / "examples/neural_operator/tesseract_api.py"
BASELINE = "dense float32 Tesseract, stock tesseract-runtime serve, same clients"
CLIENTS = (1, 4, 16, 64)
# (model name, depth, width, [(kind, rows, {clients: throughput target})])
MODELS = (
    (
        "4 relu layers 4096 wide",
        4,
        4096,
        [
            ("apply", 1, {1: 1.8, 16: 3.5, 64: 3.5}),
            ("apply", 16, {}),
            ("vjp", 1, {16: 3.0}),
        ],
    ),
    ("3 relu layers 2048 wide", 3, 2048, [("apply", 1, {}), ("apply", 16, {})]),
    ("2 relu layers 1024 wide", 2, 1024, [("vjp", 1, {1: 1.0, 4: 1.0})]),
)
# a level is warm once a warm-up run's p99 is within WARM_TAIL x its p50
# (no compile in it), after at most WARM_ROUNDS runs
WARM_ROUNDS, WARM_TAIL = 4, 4.0
P99_TARGET = ("4 relu layers 4096 wide", "apply", 1, 16, 150.0)  # ms


def _body(rng, kind: str, rows: int, k: int, n: int, field: str = "x") -> bytes:
    x = rng.standard_normal((rows, *k) if isinstance(k, tuple) else (rows, k))
    x = x.astype(np.float32)
    payload = {"inputs": {field: b64(x)}}
    if kind == "vjp":
        out = "y" if field == "x" else "u"
        g = rng.standard_normal((rows, n)).astype(np.float32)
        payload.update(
            vjp_inputs=[field], vjp_outputs=[out], cotangent_vector={out: b64(g)}
        )
    return json.dumps(payload).encode()


def measure(url: str, bodies: list[bytes], endpoint: str, seconds: float) -> dict:
    """req/s and latency percentiles with one client thread per body."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    errors: list[str] = []
    ready = threading.Barrier(len(bodies) + 1)
    stop = [0.0]

    def client(body: bytes) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        mine = []
        ready.wait()
        while time.monotonic() < stop[0]:
            start = time.perf_counter()
            conn.request(
                "POST", f"/{endpoint}", body, {"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                errors.append(f"{response.status}")
                break
            mine.append(time.perf_counter() - start)
        conn.close()
        latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    stop[0] = time.monotonic() + seconds
    began = time.monotonic()
    ready.wait()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{endpoint}: answers {sorted(set(errors))}")
    elapsed = time.monotonic() - began
    latencies.sort()
    return {
        "rps": len(latencies) / elapsed,
        "p50": 1e3 * latencies[len(latencies) // 2],
        "p99": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def _levels(servers: dict, make_body, endpoint, clients, runs, seconds, warm):
    """{server: {clients: [measure(...) per run]}}, servers alternating."""
    out = {name: {c: [] for c in clients} for name in servers}
    for _ in range(runs):
        for c in clients:
            for name, url in servers.items():
                bodies = [make_body(i) for i in range(c)]
                for _ in range(WARM_ROUNDS):  # until the batch sizes are compiled
                    warmed = measure(url, bodies, endpoint, warm)
                    if warmed["p99"] < WARM_TAIL * warmed["p50"]:
                        break
                out[name][c].append(measure(url, bodies, endpoint, seconds))
    return out


def _summary(samples: list[dict], key: str) -> tuple[float, float, float]:
    values = [s[key] for s in samples]
    return statistics.median(values), min(values), max(values)


def _model_files(tmp: Path, depth: int, width: int) -> tuple[Path, Path]:
    """The same weights for ours ((N, K), quantized at load) and dense
    ((K, N) float32)."""
    from qarray.checkpoint import save_model

    rng = np.random.default_rng(depth * width)
    _, layers = bench_e2e.network(rng, (1, width, width), depth, "relu", "kn")
    dense = tmp / f"dense-{depth}x{width}.safetensors"
    save_model(dense, layers)
    ours = tmp / f"ours-{depth}x{width}.safetensors"
    save_model(
        ours,
        [
            {**layer, "w": np.ascontiguousarray(layer["w"].T), "layout": "nk"}
            for layer in layers
        ],
    )
    return ours, dense


@contextlib.contextmanager
def _servers(tmp: Path, ours_env: dict, dense_env: dict | None, api=OURS):
    with contextlib.ExitStack() as stack:
        folder = Path(tempfile.mkdtemp(dir=tmp))
        urls = {"ours": stack.enter_context(serve(folder, api, env=ours_env))}
        if dense_env is not None:
            folder = Path(tempfile.mkdtemp(dir=tmp))
            urls["dense"] = stack.enter_context(
                serve(folder, DENSE, env=dense_env, program=RUNTIME)
            )
        yield urls


def _rows(name, kind, rows, width, results, targets, baseline, clients):
    out = []
    for c in clients:
        ours, base = results["ours"][c], results["baseline"][c]
        ratios = [o["rps"] / b["rps"] for o, b in zip(ours, base, strict=True)]
        median, low, high = (
            statistics.median(ratios),
            min(ratios),
            max(ratios),
        )
        o50, o99, b50, b99 = (
            _summary(ours, "p50")[0],
            _summary(ours, "p99")[0],
            _summary(base, "p50")[0],
            _summary(base, "p99")[0],
        )
        out.append(
            {
                "row": f"load: {name}, {kind} of {rows} row{'s' * (rows > 1)}, "
                f"{c} client{'s' * (c > 1)}, throughput",
                "shape": (rows, width, width),
                "baseline": baseline,
                "ratio": median,
                "target": targets.get(c),
                "unit": "x the baseline's req/s",
                "spread": [low, high],
                "rps": _summary(ours, "rps")[0],
                "baseline_rps": _summary(base, "rps")[0],
                "p50_ms": o50,
                "p99_ms": o99,
                "baseline_p50_ms": b50,
                "baseline_p99_ms": b99,
                "clients": c,
            }
        )
        if (name, kind, rows, c) == P99_TARGET[:4]:
            out.append(
                {
                    "row": f"load: {name}, {kind} of {rows} row, {c} clients, p99",
                    "shape": (rows, width, width),
                    "baseline": "target in ms",
                    "ratio": o99,
                    "target": P99_TARGET[4],
                    "unit": "ms",
                    "lower_is_better": True,
                    "baseline_p99_ms": b99,
                    "clients": c,
                }
            )
    return out


def _fno_rows(tmp, clients, runs, seconds, warm):
    grid = 32  # examples/neural_operator/fno.py's GRID
    rng = np.random.default_rng(5)

    def body(i):
        return _body(rng, "apply", 1, (grid, grid), None, field="log_k")

    urls = {}
    with contextlib.ExitStack() as stack:
        for name, rows in (("ours", "64"), ("baseline", "1")):
            folder = Path(tempfile.mkdtemp(dir=tmp))
            env = {"QARRAY_MAX_BATCH_ROWS": rows}
            urls[name] = stack.enter_context(serve(folder, FNO, env=env))
        results = _levels(urls, body, "apply", clients, runs, seconds, warm)
    return _rows(
        "FNO example (32 x 32 fields)",
        "apply",
        1,
        grid,
        results,
        {},
        "the same FNO Tesseract with batching off (QARRAY_MAX_BATCH_ROWS=1)",
        clients,
    )


def workers_rows(tmp, clients=(1, 16, 64), runs=1, seconds=4.0, warm=1.5):
    """``--num-workers 2`` (each pinned to half the cores) against one worker,
    both ours, on the 4-layer model's one-row applies: the deployment page's
    recommendation."""
    name, depth, width, _ = MODELS[0]
    ours_file, _ = _model_files(tmp, depth, width)
    env = {"QARRAY_MODEL": str(ours_file)}
    rng = np.random.default_rng(2)
    urls = {}
    with contextlib.ExitStack() as stack:
        for label, workers in (("ours", 2), ("baseline", 1)):
            folder = Path(tempfile.mkdtemp(dir=tmp))
            urls[label] = stack.enter_context(
                serve(folder, OURS, env=env, workers=workers)
            )
        results = _levels(
            urls,
            lambda i: _body(rng, "apply", 1, width, width),
            "apply",
            clients,
            runs,
            seconds,
            warm,
        )
    return _rows(
        f"{name}, 2 workers",
        "apply",
        1,
        width,
        results,
        {},
        "ours with one worker (batching on both cores)",
        clients,
    )


def run(runs=3, seconds=4.0, warm=1.5, clients=CLIENTS) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name, depth, width, kinds in MODELS:
            ours_file, dense_file = _model_files(tmp, depth, width)
            with _servers(
                tmp, {"QARRAY_MODEL": str(ours_file)}, {"QARRAY_MODEL": str(dense_file)}
            ) as urls:
                urls = {"ours": urls["ours"], "baseline": urls["dense"]}
                for kind, rows_, targets in kinds:
                    rng = np.random.default_rng(rows_)
                    endpoint = "apply" if kind == "apply" else "vector_jacobian_product"

                    def body(i, kind=kind, rows_=rows_, rng=rng, width=width):
                        return _body(rng, kind, rows_, width, width)

                    results = _levels(
                        urls, body, endpoint, clients, runs, seconds, warm
                    )
                    rows += _rows(
                        name, kind, rows_, width, results, targets, BASELINE, clients
                    )
        rows += _fno_rows(tmp, clients, runs, seconds, warm)
        rows += workers_rows(tmp, runs=runs, seconds=seconds, warm=warm)
    return rows


def table(rows) -> str:
    """Throughput and latency per level (the docs' load section)."""
    lines = [
        "| model, request | clients | ours req/s | baseline req/s | ratio (spread) "
        "| ours p50 / p99 ms | baseline p50 / p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "rps" not in r:
            continue
        name = r["row"].removeprefix("load: ").rsplit(",", 2)[0]
        lines.append(
            f"| {name} | {r['clients']} | {r['rps']:.0f} | {r['baseline_rps']:.0f} | "
            f"{r['ratio']:.2f} ({r['spread'][0]:.2f}-{r['spread'][1]:.2f}) | "
            f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} | "
            f"{r['baseline_p50_ms']:.0f} / {r['baseline_p99_ms']:.0f} |"
        )
    return "\n".join(lines)


def plot(rows, path: Path) -> None:
    """Throughput against clients, ours and the baseline, per model/request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict]] = {}
    for r in rows:
        if "rps" in r:
            series.setdefault(
                r["row"].removeprefix("load: ").rsplit(",", 2)[0], []
            ).append(r)
    columns = 4
    rows_ = -(-len(series) // columns)
    fig, axes = plt.subplots(
        rows_, columns, figsize=(3.4 * columns, 3.0 * rows_), squeeze=False
    )
    for ax in axes.flat[len(series) :]:
        ax.set_visible(False)
    for ax, (name, points) in zip(axes.flat, series.items(), strict=False):
        points.sort(key=lambda r: r["clients"])
        c = [p["clients"] for p in points]
        ours, base = (
            ("2 workers", "1 worker")
            if "workers" in name
            else (
                "qarray (batched)",
                "baseline",
            )
        )
        ax.plot(c, [p["rps"] for p in points], "o-", label=ours)
        ax.plot(c, [p["baseline_rps"] for p in points], "s--", label=base)
        ax.legend(fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(v) for v in c])
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("clients")
    for row in axes:
        row[0].set_ylabel("requests / s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    quick = "--quick" in sys.argv
    rows = run(runs=1 if quick else 3, seconds=2.0 if quick else 4.0)
    print(table(rows))
    print(json.dumps(rows, indent=1, default=float))
