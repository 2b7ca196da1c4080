"""Start and stop a real `tesseract-runtime serve` process for tests."""

import base64
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = Path(sys.executable).with_name("tesseract-runtime")
SERVE = Path(sys.executable).with_name("qarray-serve")  # what make serve runs


def free_port() -> int:
    """A free loopback TCP port; the test is skipped on a host that refuses
    TCP sockets (the lent TPU hosts: their suite is in-process)."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError as refused:
        import pytest

        pytest.skip(f"this host refuses TCP sockets ({refused}): no server here")


@contextlib.contextmanager
def serve(
    tmp_path,
    api_path=ROOT / "tesseract_api.py",
    env=None,
    workers=1,
    timeout=120,
    program=SERVE,
):
    """Serve ``api_path`` on a free loopback port; yield its base URL.
    ``program``: qarray-serve (default) or stock ``tesseract-runtime``.

    The process is ours alone: it is stopped by PID when the block exits.
    """
    port = free_port()
    output = tmp_path / "outputs"
    output.mkdir(exist_ok=True)
    full_env = {
        **os.environ,
        "TESSERACT_API_PATH": str(api_path),
        "TESSERACT_OUTPUT_FORMAT": "json+base64",
        "TESSERACT_OUTPUT_PATH": str(output),
        "TESSERACT_NAME": "qarray",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",
        **(env or {}),
    }
    log = open(tmp_path / f"server-{port}.log", "wb")
    proc = subprocess.Popen(
        [
            str(program),
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-workers",
            str(workers),
        ],
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout, tmp_path / f"server-{port}.log")
        yield url
    finally:
        stop(proc)
        log.close()


def wait_healthy(url, proc, timeout, log_path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
            )
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"server not healthy after {timeout}s:\n{log_path.read_text()}")


def stop(proc):
    """Stop a server we started, its worker processes included."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def b64(array) -> dict:
    """An array in tesseract's base64 JSON encoding."""
    array = np.asarray(array, order="C")  # (ascontiguousarray makes 0-d arrays 1-d)
    return {
        "object_type": "array",
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "data": {
            "buffer": base64.b64encode(array.tobytes()).decode(),
            "encoding": "base64",
        },
    }


def encode(tree):
    """A request's NumPy arrays (at any depth: layers are a list) in tesseract's
    base64 encoding, everything else as is."""
    if isinstance(tree, np.ndarray | np.generic):
        return b64(tree)
    if isinstance(tree, dict):
        return {k: encode(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [encode(v) for v in tree]
    return tree


def decode(obj):
    """Decode tesseract's JSON encodings (base64 or json) back to NumPy, recursively."""
    if isinstance(obj, dict) and obj.get("object_type") == "array":
        data = obj["data"]
        if data["encoding"] == "base64":
            raw = base64.b64decode(data["buffer"])
            return np.frombuffer(raw, dtype=obj["dtype"]).reshape(obj["shape"])
        return np.asarray(data["buffer"], dtype=obj["dtype"]).reshape(obj["shape"])
    if isinstance(obj, dict):
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj


def server_processes(url) -> list[psutil.Process]:
    """The server process listening on url's port (uvicorn's supervisor when
    it has workers) and its children: this test's own server."""
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == "LISTEN":
            proc = psutil.Process(conn.pid)
            while proc.parent() and _is_server(proc.parent()):
                proc = proc.parent()
            return [proc, *proc.children(recursive=True)]
    raise RuntimeError(f"no process listens on {url}")


def _is_server(proc: psutil.Process) -> bool:
    """qarray-serve (with workers: the supervisor and the workers it forked)."""
    return "qarray-serve" in " ".join(proc.cmdline())


def server_rss(url) -> int:
    """Resident memory (bytes) of a server and its worker processes."""
    total = 0
    for proc in server_processes(url):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total


def server_pss(url) -> dict[int, int]:
    """Proportional set size (bytes) of a server's processes by pid
    (``/proc/PID/smaps_rollup``: a page shared by n processes counts 1/n in
    each, so their sum is what the server holds)."""
    sizes = {}
    for proc in server_processes(url):
        with contextlib.suppress(OSError, psutil.NoSuchProcess):
            for line in Path(f"/proc/{proc.pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    sizes[proc.pid] = int(line.split()[1]) * 1024
    return sizes
