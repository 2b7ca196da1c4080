"""The served Tesseract under fuzzing, concurrent load and faults."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests

from tests import reference as ref
from tests.tesseract.server import (
    SERVE,
    b64,
    decode,
    free_port,
    serve,
    stop,
    wait_healthy,
)

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
RTOL = ATOL = 2e-4
# resident memory the server may add over 2,000 distinct requests (see README)
RSS_GROWTH_BOUND_MB = 150


def test_fuzzing_finds_no_server_errors(tmp_path):
    """schemathesis against /openapi.json: every POST endpoint, bounded examples."""
    with serve(tmp_path, env={"QARRAY_MAX_ELEMENTS": "100000"}) as url:
        result = subprocess.run(
            [
                str(SCHEMATHESIS),
                "run",
                f"{url}/openapi.json",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "25",
                "--seed",
                "7",
                "--phases",
                "examples,coverage,fuzzing",
                "--request-timeout",
                "30",
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
        )
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-5000:]
    for endpoint in (
        "apply",
        "abstract_eval",
        "jacobian",
        "jacobian_vector_product",
        "vector_jacobian_product",
    ):
        assert f"POST /{endpoint}" in report or "Tested: 6" in report


# --- load: concurrent clients, every answer checked


def _variant_inputs(i):
    """Distinct inputs per request; some pairs differ in one element's sign of
    zero or in one int8 value's last bit, so a mixed-up cache entry would show."""
    rng = np.random.default_rng(i // 2)  # pairs share a base
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal((8, 5)).astype(np.float32)
    qvalue, scale = ref.quantize(w)
    qvalue = qvalue.copy()
    x[0, 0] = -0.0 if i % 2 else 0.0
    qvalue[1, 1] = 5 if i % 2 else 4  # differ in the last bit
    return {"x": x, "w_q": {"qvalue": qvalue, "scale": scale}}


def _request(url, session, i):
    inputs = _variant_inputs(i)
    w = ref.dequantize(inputs["w_q"]["qvalue"], inputs["w_q"]["scale"])
    payload = {
        "x": b64(inputs["x"]),
        "w_q": {k: b64(v) for k, v in inputs["w_q"].items()},
    }
    kind = ("apply", "vjp", "jvp")[i % 3]
    rng = np.random.default_rng(10_000 + i)
    if kind == "apply":
        out = session.post(f"{url}/apply", json={"inputs": payload}, timeout=60)
        out.raise_for_status()
        want = inputs["x"].astype(np.float64) @ w
        got = decode(out.json())["y"]
    elif kind == "vjp":
        # apply first, as tesseract-jax does: the VJP may come from the cache
        session.post(
            f"{url}/apply", json={"inputs": payload}, timeout=60
        ).raise_for_status()
        g = rng.standard_normal((3, 5)).astype(np.float32)
        out = session.post(
            f"{url}/vector_jacobian_product",
            json={
                "inputs": payload,
                "vjp_inputs": ["x", "w_q.scale"],
                "vjp_outputs": ["y"],
                "cotangent_vector": {"y": b64(g)},
            },
            timeout=60,
        )
        out.raise_for_status()
        got_all = decode(out.json())
        gx, gw = ref.dense_vjp(inputs["x"], w, g)
        scale_ct = np.sum(gw * inputs["w_q"]["qvalue"], axis=1)
        np.testing.assert_allclose(got_all["w_q.scale"], scale_ct, rtol=RTOL, atol=ATOL)
        want, got = gx, got_all["x"]
    else:
        t = rng.standard_normal((3, 8)).astype(np.float32)
        out = session.post(
            f"{url}/jacobian_vector_product",
            json={
                "inputs": payload,
                "jvp_inputs": ["x"],
                "jvp_outputs": ["y"],
                "tangent_vector": {"x": b64(t)},
            },
            timeout=60,
        )
        out.raise_for_status()
        want, got = t.astype(np.float64) @ w, decode(out.json())["y"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    return kind


def _server_rss_mb(port):
    """Resident memory of the server process listening on port, children included."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == "LISTEN":
            proc = psutil.Process(conn.pid)
            while proc.parent() and "qarray-serve" in " ".join(proc.parent().cmdline()):
                proc = proc.parent()
            procs = [proc, *proc.children(recursive=True)]
            return sum(p.memory_info().rss for p in procs) / 2**20
    raise RuntimeError(f"no process listens on {port}")


@pytest.mark.parametrize("workers", [1, 2])
def test_concurrent_mixed_load_is_always_right(tmp_path, workers):
    env = {"QARRAY_VJP_CACHE_SIZE": "8", "QARRAY_VJP_CACHE_MIN_INTENSITY": "0"}
    with serve(tmp_path, env=env, workers=workers) as url:
        port = int(url.rsplit(":", 1)[1])
        sessions = threading.local()

        def run(i):
            if not hasattr(sessions, "s"):
                sessions.s = requests.Session()
            return _request(url, sessions.s, i)

        with ThreadPoolExecutor(max_workers=8) as pool:
            kinds = list(pool.map(run, range(240)))  # raises on any wrong answer
        assert {"apply", "vjp", "jvp"} <= set(kinds)
        if workers == 1:
            # memory: 2,000 more requests with distinct inputs (the cache is an LRU)
            before = _server_rss_mb(port)
            with ThreadPoolExecutor(max_workers=8) as pool:
                list(pool.map(run, range(1000, 3000)))
            growth = _server_rss_mb(port) - before
            print(f"RSS growth over 2,000 requests: {growth:.1f} MB")
            assert growth < RSS_GROWTH_BOUND_MB


# --- faults


def _start(tmp_path, port):
    env = {
        **os.environ,
        "TESSERACT_API_PATH": str(Path(__file__).parents[2] / "tesseract_api.py"),
        "TESSERACT_OUTPUT_PATH": str(tmp_path / "outputs"),
        "TESSERACT_OUTPUT_FORMAT": "json+base64",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",
    }
    log = tmp_path / f"fault-{time.monotonic_ns()}.log"
    with log.open("wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [SERVE, "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    wait_healthy(f"http://127.0.0.1:{port}", proc, 120, log)
    return proc


def _apply_ok(url):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = requests.post(
        f"{url}/apply", json={"inputs": {"x": b64(x), "w": b64(w)}}, timeout=60
    )
    out.raise_for_status()
    np.testing.assert_allclose(
        decode(out.json())["y"], x @ ref.roundtrip(w), rtol=RTOL, atol=ATOL
    )


def test_killed_mid_request_then_restarted(tmp_path):
    (tmp_path / "outputs").mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(tmp_path, port)
    try:
        _apply_ok(url)
        errors = []

        def slow_body():
            yield b'{"inputs": {"x": '
            time.sleep(4)  # the server dies while this request is in flight
            yield b"[[1.0]]}}"

        def client():
            try:
                requests.post(
                    f"{url}/apply",
                    data=slow_body(),
                    timeout=60,
                    headers={"Content-Type": "application/json"},
                )
            except requests.ConnectionError as e:
                errors.append(e)

        thread = threading.Thread(target=client)
        thread.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert len(errors) == 1  # a clean connection error, not a hang or a 5xx
        proc = _start(tmp_path, port)
        for _ in range(3):
            _apply_ok(url)
    finally:
        stop(proc)


def test_client_disconnecting_mid_request_does_not_wedge_the_worker(tmp_path):
    with serve(tmp_path) as url:
        host, port = url.removeprefix("http://").split(":")
        for _ in range(5):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(
                    b"POST /apply HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                    b'{"inputs": {"x": [[1.0, 2.0'
                )
            # and a complete request whose client leaves before the answer
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                body = b'{"inputs": {"x": [[1.0, 2.0]], "w": [[1.0], [2.0]]}}'
                sock.sendall(
                    b"POST /apply HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    b"\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
        start = time.monotonic()
        _apply_ok(url)
        assert time.monotonic() - start < 10
