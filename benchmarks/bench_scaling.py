"""Replicas on one host: requests/s of `qarray-serve --num-workers 1` vs `2`.

Eight client threads, each on its own keep-alive connection, send the same
mid-size request (a 3-layer relu network, x (64, 512), three (512, 512) float32
weight matrices: 4.4 MB of base64 JSON) as fast as the server answers. One
worker computes one request at a time (the endpoints run in its event loop),
so a second worker is the way to a second core. Both servers stay up; the
measurement alternates between them in blocks, so drift in the machine's load
hits both alike. Each row also gives the CPU cores the server processes used
while measured: when 2 workers use no more cores than 1, the host (its cores,
the clients, other load), not the worker count, is the limit.
"""

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import requests

from support.server import b64, serve

CLIENTS = 8
SHAPE = (64, 512, 512)  # (M, K, N): x (M, K), three layers N x N after the first


def request_body(rng, shape=SHAPE, depth=3) -> bytes:
    m, k, n = shape
    layers, width = [], k
    for i in range(depth):
        w = (rng.standard_normal((width, n)) / np.sqrt(width)).astype(np.float32)
        layers.append(
            {
                "w": b64(w),
                "bias": b64(rng.standard_normal(n).astype(np.float32)),
                "activation": "none" if i == depth - 1 else "relu",
            }
        )
        width = n
    x = rng.standard_normal((m, k)).astype(np.float32)
    return json.dumps({"inputs": {"x": b64(x), "layers": layers}}).encode()


def throughput(url, body, seconds, clients=CLIENTS) -> float:
    """Requests/s answered (200) with ``clients`` threads for ``seconds``."""
    counts = [0] * clients
    failures = []
    ready = threading.Barrier(clients + 1)
    go = threading.Event()
    stop_at = [0.0]

    def client(i):
        with requests.Session() as session:
            headers = {"Content-Type": "application/json"}
            post = session.post(f"{url}/apply", data=body, headers=headers)
            post.raise_for_status()  # connected, and warm
            ready.wait()
            go.wait()
            while time.perf_counter() < stop_at[0]:
                response = session.post(
                    f"{url}/apply", data=body, headers=headers, timeout=120
                )
                if response.status_code != 200:
                    failures.append(response.status_code)
                    return
                counts[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    ready.wait()
    began = time.perf_counter()
    stop_at[0] = began + seconds
    go.set()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    if failures:
        raise RuntimeError(f"the server answered {failures[0]}")
    return sum(counts) / elapsed


def server_processes(url) -> list[psutil.Process]:
    """The process listening on url's port and its workers."""
    port = int(url.rsplit(":", 1)[1])
    for proc in psutil.process_iter():
        try:
            if any(
                c.laddr.port == port and c.status == psutil.CONN_LISTEN
                for c in proc.net_connections()
            ):
                while proc.parent() and proc.parent().name() == proc.name():
                    proc = proc.parent()  # uvicorn's supervisor
                return [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
    raise RuntimeError(f"no process listens on port {port}")


def cpu_seconds(procs) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def run(seconds=8.0, blocks=3):
    rng = np.random.default_rng(0)
    body = request_body(rng)
    rates = {1: [], 2: []}
    cores = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "one").mkdir()
        (tmp / "two").mkdir()
        with (
            serve(tmp / "one", workers=1) as one,
            serve(tmp / "two", workers=2) as two,
        ):
            urls = {1: one, 2: two}
            procs = {w: server_processes(urls[w]) for w in urls}
            for workers in (1, 2):  # warm every worker (compile) outside the blocks
                throughput(urls[workers], body, 1.0)
            for block in range(blocks):
                order = (1, 2) if block % 2 == 0 else (2, 1)
                for workers in order:
                    used = cpu_seconds(procs[workers])
                    began = time.perf_counter()
                    rates[workers].append(throughput(urls[workers], body, seconds))
                    used = cpu_seconds(procs[workers]) - used
                    cores[workers].append(used / (time.perf_counter() - began))
    one_rps, two_rps = (statistics.median(rates[w]) for w in (1, 2))
    return [
        {
            "row": f"HTTP apply throughput, 2 workers vs 1 ({CLIENTS} clients, "
            "3-layer relu, dense w)",
            "shape": SHAPE,
            "baseline": "qarray-serve --num-workers 1, same clients",
            "ratio": two_rps / one_rps,
            "target": None,
            "unit": "x the 1-worker requests/s",
            "requests_per_s": two_rps,
            "baseline_requests_per_s": one_rps,
            "blocks": {str(w): [round(r, 2) for r in rates[w]] for w in rates},
            "server_cores": {
                str(w): round(statistics.median(c), 2) for w, c in cores.items()
            },
            "request_bytes": len(body),
        }
    ]


if __name__ == "__main__":
    for row in run():
        print(json.dumps(row, indent=2))
