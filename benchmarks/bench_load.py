"""Serving under load: throughput and latency against concurrent clients.

A resident model served by ``qarray-serve`` (int8, dynamic batching on, the
defaults) against the same model in float32 served by stock
``tesseract-runtime serve`` (benchmarks/dense_api.py, its weights stored
``(K, N)``: the faster float32 spelling), one worker each. The load comes
from ``wrk`` (C: ``benchmarks/wrk.py``; a Python client of threads on the
same cores measures itself): one keep-alive connection per client, each
sending the same kind of request as fast as it is answered, the bodies
(distinct x, and cotangents for a VJP) taken in turn; 1, 4, 16 and 64
clients. A Python client checks ours' answers against NumPy before each
model is loaded (``check_answers``), and each level of ours reports the
rows of the calls its batcher computed (``GET /metrics``). Request kinds:
one-row and 16-row applies, one-row ``vector_jacobian_product`` with
respect to x; models: 4 relu layers 4096 wide and 3 relu layers 2048 wide
(plus a lone VJP at 2 layers 1024 wide). Every level is warmed (batch
sizes compiled) before it is measured; ours and dense alternate level by
level, ``runs`` times; rows give medians and spreads.

``workers_rows``: ``--num-workers 2`` against one worker; ``memory_rows``:
their memory (PSS, ``/proc/PID/smaps_rollup``: the workers map one copy of
the weights).

The FNO example's Tesseract (examples/neural_operator) is measured the same
way with batching on against itself with batching off
(``QARRAY_MAX_BATCH_ROWS=1``), one-field applies.

    .venv/bin/python -m benchmarks.run --only load
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks import bench_e2e
from benchmarks.wrk import run_wrk
from qarray.tesseract import _metrics as metrics
from support.server import (
    ROOT,
    RUNTIME,
    b64,
    decode,
    serve,
    server_processes,
    server_pss,
)

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
            ("apply", 1, {1: 1.8, 16: 7.0, 64: 7.0}),
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
# ours at N clients against ours at one: throughput that grows with clients
# (issue 43), and the tails: {(model, kind, rows): {clients: target}}
SCALING_TARGETS = {
    ("4 relu layers 4096 wide", "apply", 1): {16: 2.5, 64: 2.5},
    ("4 relu layers 4096 wide", "vjp", 1): {16: 2.5},
}
P99_TARGETS = {  # ms
    ("4 relu layers 4096 wide", "apply", 1): {16: 100.0, 64: 400.0},
    ("4 relu layers 4096 wide", "vjp", 1): {16: 150.0},
}


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


def batch_rows(url: str) -> dict | None:
    """The server's batcher counters (``GET /metrics``), or None (stock)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            return metrics.parse(response.read().decode())
    except OSError:
        return None


def _histogram(before: dict | None, after: dict | None) -> dict | None:
    """Calls per rows bucket between two ``batch_rows`` readings, and the
    mean rows per call."""
    if not before or not after:
        return None
    calls = after["calls"] - before["calls"]
    rows = after["rows_total"] - before["rows_total"]
    cumulative = {k: v - before["rows"].get(k, 0) for k, v in after["rows"].items()}
    buckets, below = {}, 0
    for bound, count in cumulative.items():
        buckets[bound] = count - below
        below = count
    return {
        "calls": calls,
        "mean_rows": rows / max(calls, 1),
        "buckets": buckets,
        "kernels": after.get("kernels"),
    }


def check_answers(url: str, model_file: Path, width: int, rows: int = 3) -> float:
    """The served y of a few rows against a float64 NumPy forward pass of
    the model file's weights quantized as the contract says (the Python
    client: ``wrk`` reads no answer); the largest relative error, an
    AssertionError past 1e-4."""
    from qarray.checkpoint import load_model
    from support.network import forward_one

    layers = [
        {
            "w": layer.w,
            "layout": layer.layout,
            "activation": layer.activation,
            **({} if layer.bias is None else {"bias": layer.bias}),
        }
        for layer in load_model(model_file)
    ]
    x = np.random.default_rng(7).standard_normal((rows, width)).astype(np.float32)
    body = json.dumps({"inputs": {"x": b64(x)}}).encode()
    request = urllib.request.Request(
        f"{url}/apply", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        y = decode(json.loads(response.read()))["y"]
    worst = 0.0
    for i in range(rows):
        want, _ = forward_one(x[i], layers)
        worst = max(worst, float(np.linalg.norm(y[i] - want) / np.linalg.norm(want)))
    assert worst < 1e-4, f"served y differs from NumPy by {worst:.2e} (relative)"
    return worst


def _levels(servers: dict, make_body, endpoint, clients, runs, seconds, warm):
    """{server: {clients: [measure(...) per run]}}, servers alternating."""
    out = {name: {c: [] for c in clients} for name in servers}
    for _ in range(runs):
        for c in clients:
            for name, url in servers.items():
                # distinct bodies, at least 16 of them, taken in turn
                bodies = [make_body(i) for i in range(max(c, 16))]
                for _ in range(WARM_ROUNDS):  # until the batch sizes are compiled
                    warmed = _measure_level(url, bodies, c, endpoint, warm)
                    if warmed["p99"] < WARM_TAIL * warmed["p50"]:
                        break
                before = batch_rows(url)
                result = _measure_level(url, bodies, c, endpoint, seconds)
                result["batches"] = _histogram(before, batch_rows(url))
                out[name][c].append(result)
    return out


def _measure_level(url, bodies, clients, endpoint, seconds) -> dict:
    """req/s and latency percentiles with ``wrk``; a RuntimeError on any
    non-2xx answer or socket error."""
    stats = run_wrk(url, f"/{endpoint}", bodies, clients, seconds)
    if stats["non_2xx"] or stats["socket_errors"]:
        raise RuntimeError(
            f"{endpoint}: {stats['non_2xx']} non-2xx answers, "
            f"{stats['socket_errors']} socket errors at {clients} clients"
        )
    return {"rps": stats["rps"], "p50": stats["p50_ms"], "p99": stats["p99_ms"]}


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
                # the batcher's calls in ours' last run of this level
                "batches": ours[-1].get("batches"),
                "isa": _isa(ours[-1].get("batches")),
            }
        )
    return out


def _isa(batches: dict | None) -> str:
    """Where ours' products ran, from its /metrics: "avx512", "amx", ...,
    "xla" (the kernels off), or "-" (no counters: a server without ours')."""
    status = (batches or {}).get("kernels")
    if not status:
        return "-"
    if status.startswith("available (") and status.endswith(")"):
        return status.removeprefix("available (").removesuffix(")")
    return "xla"


def derived_rows(rows: list[dict]) -> list[dict]:
    """From the throughput rows: ours at N clients over ours at one
    (``SCALING_TARGETS``) and ours' p99 (``P99_TARGETS``)."""
    levels = {}
    for r in rows:
        if "rps" in r:
            # "load: {name}, {kind} of {rows} row(s), {c} client(s), ..."
            name, kind_rows, _, _ = r["row"].removeprefix("load: ").rsplit(", ", 3)
            kind, _, count = kind_rows.split(" ")[:3]
            levels[(name, kind, int(count), r["clients"])] = r
    out = []
    for targets_by_key in (SCALING_TARGETS, P99_TARGETS):
        for key, targets in targets_by_key.items():
            name, kind, count = key
            one = levels.get((*key, 1))
            for clients, target in targets.items():
                level = levels.get((*key, clients))
                if level is None or (targets_by_key is SCALING_TARGETS and one is None):
                    continue
                head = f"load: {name}, {kind} of {count} row, {clients} clients"
                row = {"shape": level["shape"], "target": target, "clients": clients}
                if targets_by_key is SCALING_TARGETS:
                    row |= {
                        "row": f"{head} against 1, throughput",
                        "baseline": "ours at 1 client (the same run)",
                        "ratio": level["rps"] / one["rps"],
                        "unit": "x",
                    }
                else:
                    row |= {
                        "row": f"{head}, p99",
                        "baseline": "target in ms",
                        "ratio": level["p99_ms"],
                        "unit": "ms",
                        "lower_is_better": True,
                        "baseline_p99_ms": level["baseline_p99_ms"],
                    }
                out.append(row)
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


def run(
    runs=3, seconds=4.0, warm=1.5, clients=CLIENTS, models=MODELS, others=True
) -> list[dict]:
    """The suite's rows: ``models``' levels, then (``others``) the FNO's,
    the workers' and their memory."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name, depth, width, kinds in models:
            ours_file, dense_file = _model_files(tmp, depth, width)
            with _servers(
                tmp, {"QARRAY_MODEL": str(ours_file)}, {"QARRAY_MODEL": str(dense_file)}
            ) as urls:
                urls = {"ours": urls["ours"], "baseline": urls["dense"]}
                check_answers(urls["ours"], ours_file, width)
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
        if others:
            rows += _fno_rows(tmp, clients, runs, seconds, warm)
            rows += workers_rows(tmp, runs=runs, seconds=seconds, warm=warm)
            rows += memory_rows(tmp)
    return rows + derived_rows(rows)


def memory_rows(tmp: Path, depth: int = 4, width: int = 8192) -> list[dict]:
    """PSS of ``--num-workers 2`` against one worker, a resident int8 model
    of ``depth`` x ``width``^2 (256 MiB by default) stored quantized, both
    workers answering (each client on its own connection: uvicorn hands
    connections to whichever worker accepts) and their answers equal to one
    worker's."""
    from qarray.checkpoint import save_model

    rng = np.random.default_rng(3)
    model = tmp / f"int8-{depth}x{width}.safetensors"
    save_model(
        model,
        [
            {
                "w_q": {
                    "qvalue": rng.integers(-127, 128, (width, width), dtype=np.int8),
                    "scale": np.full(width, 1 / (127 * np.sqrt(width)), np.float32),
                },
                "layout": "nk",
                "activation": "relu",
            }
            for _ in range(depth)
        ],
    )
    x = rng.standard_normal((2, width)).astype(np.float32)
    body = json.dumps({"inputs": {"x": b64(x)}}).encode()
    pss, answers = {}, {}
    for workers in (1, 2):
        folder = Path(tempfile.mkdtemp(dir=tmp))
        env = {"QARRAY_MODEL": str(model)}
        with serve(folder, OURS, env=env, workers=workers, timeout=600) as url:

            def apply():  # a new connection: whichever worker accepts it
                request = urllib.request.Request(
                    f"{url}/apply", body, {"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(request, timeout=120) as response:
                    return decode(json.loads(response.read()))["y"]

            answers[workers] = _until_every_worker_computed(url, workers, apply)
            pss[workers] = server_pss(url)
    same = all(np.array_equal(y, answers[1][0]) for y in answers[1] + answers[2])
    if not same:
        raise RuntimeError("2 workers' answers differ from one worker's")
    total = {w: sum(p.values()) for w, p in pss.items()}
    return [
        {
            "row": f"load: memory, resident int8 {depth} x {width}^2 "
            f"({model.stat().st_size / 2**20:.0f} MiB), 2 workers, total PSS",
            "shape": (depth, width, width),
            "baseline": "one worker's PSS",
            "ratio": total[2] / total[1],
            "target": 1.3,
            "lower_is_better": True,
            "unit": "x",
            "pss_mib": {
                str(w): {str(pid): round(v / 2**20) for pid, v in p.items()}
                for w, p in pss.items()
            },
        }
    ]


def _until_every_worker_computed(url: str, workers: int, apply, timeout=300):
    """``apply()``'s answers, called until each of ``workers`` workers has
    computed with the whole model (its pages of the weights resident: with
    several workers, of the shared segment), or a RuntimeError. uvicorn
    hands a new connection to whichever worker accepts it first, often the
    same one, and an idle or still-starting worker's PSS would flatter the
    total."""
    deadline = time.monotonic() + timeout
    answers = [apply()]
    while workers > 1:
        computed = 0
        for worker in server_processes(url)[1:]:
            text = Path(f"/proc/{worker.pid}/smaps").read_text()
            for mapping in text.split(".weights\n")[1:]:  # the fields after it
                fields = dict(line.split()[:2] for line in mapping.splitlines()[:6])
                computed += int(fields["Rss:"]) >= 0.9 * int(fields["Size:"])
        if computed >= workers:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{computed} of {workers} workers computed")
        answers.append(apply())
    return answers


def table(rows) -> str:
    """Throughput and latency per level (the docs' load section)."""
    lines = [
        "| model, request | clients | ours req/s | baseline req/s | ratio (spread) "
        "| ours p50 / p99 ms | baseline p50 / p99 ms | ours rows a call (isa) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "rps" not in r:
            continue
        name = r["row"].removeprefix("load: ").rsplit(",", 2)[0]
        batches = r.get("batches")
        mean = "-" if not batches else f"{batches['mean_rows']:.1f} ({_isa(batches)})"
        lines.append(
            f"| {name} | {r['clients']} | {r['rps']:.0f} | {r['baseline_rps']:.0f} | "
            f"{r['ratio']:.2f} ({r['spread'][0]:.2f}-{r['spread'][1]:.2f}) | "
            f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} | "
            f"{r['baseline_p50_ms']:.0f} / {r['baseline_p99_ms']:.0f} | {mean} |"
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

    # --first-model: the 4096x4 model's levels alone (the issue-43 rows,
    # a few minutes), not written to results.json
    quick, first = "--quick" in sys.argv, "--first-model" in sys.argv
    rows = run(
        runs=1 if quick else 3,
        seconds=2.0 if quick else 4.0,
        models=MODELS[:1] if first else MODELS,
        others=not first,
    )
    print(table(rows))
    print(json.dumps(rows, indent=1, default=float))
