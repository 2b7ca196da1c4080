"""A resident model under many clients for a while, every answer checked.

    .venv/bin/python -m benchmarks.load_soak [--clients 64] [--seconds 60]

``qarray-serve`` with a resident 3-layer relu network (batching on, the
defaults); each client a thread on its own keep-alive connection sending
one- to four-row applies, vector_jacobian_products and
jacobian_vector_products in turn, every answer compared with the NumPy
network (support/network.py); one request in ten is bad (a width
the model does not take) and must get a 422 while its batch-mates get their
right answers. Prints the counts, the 5xx and wrong answers (both must be
0), and the server's resident memory over time (flat: the last third's
peak within 10% of the middle third's (the first compiles)). Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from support import network as net
from support.server import b64, decode, serve

WIDTHS = (256, 256, 128, 64)  # K0 -> ... -> N_last
RTOL = ATOL = 2e-3  # the int8 network against float64 NumPy, a few steps deep


def _layers(rng):
    layers, k = [], WIDTHS[0]
    for i, n in enumerate(WIDTHS[1:]):
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        layers.append(
            {
                "w": w,
                "bias": rng.standard_normal(n).astype(np.float32) * 0.1,
                "layout": "nk",
                "activation": "relu" if i < len(WIDTHS) - 2 else "none",
            }
        )
        k = n
    return layers


def _case(rng, i, layers):
    """(endpoint, body, check(status, json) -> problem or None)."""
    rows = 1 + i % 4
    x = rng.standard_normal((rows, WIDTHS[0])).astype(np.float32)
    if i % 10 == 9:  # a bad request: its own 422, nothing else
        bad = {"inputs": {"x": b64(x[:, :-1])}}
        return "apply", bad, lambda s, _: None if s == 422 else f"bad request got {s}"
    kind = ("apply", "vector_jacobian_product", "jacobian_vector_product")[i % 3]
    body = {"inputs": {"x": b64(x)}}
    if kind == "apply":
        want = net.forward_one(x, layers)[0]

        def check(status, out):
            return _compare(status, decode(out["y"]), want, "y")

    elif kind == "vector_jacobian_product":
        g = rng.standard_normal((rows, WIDTHS[-1])).astype(np.float32)
        body |= {
            "vjp_inputs": ["x"],
            "vjp_outputs": ["y"],
            "cotangent_vector": {"y": b64(g)},
        }
        want = net.vjp_one(x, layers, g)["x"]

        def check(status, out):
            return _compare(status, decode(out["x"]), want, "vjp x")

    else:
        t = rng.standard_normal(x.shape).astype(np.float32)
        body |= {
            "jvp_inputs": ["x"],
            "jvp_outputs": ["y"],
            "tangent_vector": {"x": b64(t)},
        }
        want = _jvp(x, layers, t)

        def check(status, out):
            return _compare(status, decode(out["y"]), want, "jvp y")

    return kind, body, check


def _jvp(x, layers, t):
    """The network's JVP in float64 (forward mode through the NumPy trace:
    the weights as served, relu's derivative at each pre-activation)."""
    _, trace = net.forward_one(x, layers)
    dh = np.asarray(t, np.float64)
    for layer, (_, z) in zip(layers, trace, strict=True):
        dz = dh @ net.dense_kn(layer)
        dh = dz * net.act_grad(layer.get("activation", "none"), z)
    return dh


def _compare(status, got, want, what, tol=RTOL):
    if status != 200:
        return f"{what}: status {status}"
    scale = max(float(np.abs(want).max()), 1.0)
    if not np.allclose(got, want, rtol=tol, atol=tol * scale):
        return f"{what}: off by {float(np.abs(got - want).max()):.3g}"
    return None


def run(clients: int, seconds: float) -> dict:
    from qarray.checkpoint import save_model

    rng = np.random.default_rng(11)
    layers = _layers(rng)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        path = tmp / "model.safetensors"
        save_model(path, layers)
        # the reference computes the network as served: w quantized at load
        with serve(tmp, env={"QARRAY_MODEL": str(path)}) as url:
            host, port = url.removeprefix("http://").split(":")
            server = _server_process(int(port))
            counts = {"ok": 0, "refused": 0}
            problems: list[str] = []
            memory: list[tuple[float, int]] = []
            stop = time.monotonic() + seconds
            lock = threading.Lock()

            def client(c):
                conn = http.client.HTTPConnection(host, int(port), timeout=300)
                local = np.random.default_rng(1000 + c)
                i = c
                while time.monotonic() < stop:
                    endpoint, body, check = _case(local, i, layers)
                    conn.request(
                        "POST",
                        f"/{endpoint}",
                        json.dumps(body),
                        {"Content-Type": "application/json"},
                    )
                    response = conn.getresponse()
                    raw = response.read()
                    if response.status == 422:
                        conn.close()  # the guard may close after a 4xx
                        conn = http.client.HTTPConnection(host, int(port), timeout=300)
                    out = json.loads(raw) if response.status == 200 else None
                    problem = check(response.status, out)
                    with lock:
                        if problem:
                            problems.append(problem)
                        counts["refused" if response.status == 422 else "ok"] += 1
                    i += 1

            threads = [
                threading.Thread(target=client, args=(c,)) for c in range(clients)
            ]
            started = time.monotonic()
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                memory.append((time.monotonic() - started, server.memory_info().rss))
                time.sleep(1.0)
            for t in threads:
                t.join()
    third = max(1, len(memory) // 3)
    # the first third compiles the batch sizes: flat from the second on
    first = max(m for _, m in memory[third : 2 * third] or memory[:1])
    last = max(m for _, m in memory[-third:])
    return {
        "clients": clients,
        "seconds": seconds,
        "answered": counts["ok"],
        "refused (bad requests)": counts["refused"],
        "problems": problems[:20],
        "problem count": len(problems),
        "rss MiB middle third peak": first / 2**20,
        "rss MiB last third peak": last / 2**20,
        "memory flat": last <= 1.1 * first,
    }


def _server_process(port: int) -> psutil.Process:
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "serve" in cmdline and str(port) in cmdline:
            return proc
    raise RuntimeError(f"no server process on port {port}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    report = run(args.clients, args.seconds)
    print(json.dumps(report, indent=1))
    ok = report["problem count"] == 0 and report["memory flat"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
