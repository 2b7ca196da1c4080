"""The HTTP server over a Unix socket: `qarray-serve serve --uds PATH`, checked.

    python scripts/serve_uds_check.py [--out FILE.json] [--width 64] [--layers 3]
        [--rows 8] [--rtol 1e-2] [--timeout 300]

For hosts that refuse TCP sockets (the TPU hosts we borrow): writes a
resident int8 model (``QARRAY_MODEL``: ``--layers`` relu layers ``--width``
wide, the last without), starts ``qarray-serve serve --uds PATH`` on it in a
process of its own (the one that holds the accelerator: this script starts
no JAX backend), waits for ``GET /health``, sends an ``apply`` and then a
``vector_jacobian_product`` of the same x (the residual cache's path) over
the socket (``http.client`` on an ``AF_UNIX`` socket, base64 arrays), checks
both against the NumPy reference (support/network.py: relative error of the
whole array at most ``--rtol``; 1e-2 leaves room for an accelerator's
default matmul precision, one bf16 pass on a TPU), prints a JSON report
(``--out``: also to that file) and stops the server by its pid. Exit status
0 when both answers pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER_ENV = dict(os.environ)  # the server's JAX: this host's accelerator
# this process needs no device (NumPy does the checking): leave the chip free
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from support import network as net  # noqa: E402
from support.server import SERVE, decode, encode, stop  # noqa: E402

# the entry point where it is installed beside this Python, else the same
# function (a runtime that has the project on PYTHONPATH, not installed)
ENTRY = "import sys; from qarray.tesseract import main; sys.exit(main())"
PROGRAM = [str(SERVE)] if SERVE.exists() else [sys.executable, "-c", ENTRY]


class UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 to a server listening on a Unix domain socket."""

    def __init__(self, path: str, timeout: float = 120):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


def request(path: str, method: str, endpoint: str, payload=None):
    """(status, decoded JSON body) of one request on a new connection."""
    conn = UnixConnection(path)
    try:
        body = None if payload is None else json.dumps(encode(payload))
        headers = {} if body is None else {"Content-Type": "application/json"}
        conn.request(method, f"/{endpoint}", body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    try:
        return response.status, decode(json.loads(data)) if data else None
    except ValueError:
        return response.status, data[:500].decode(errors="replace")


def wait_healthy(path: str, proc, timeout: float, log: Path) -> float:
    """Seconds until ``GET /health`` answered 200."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            )
        with contextlib.suppress(OSError, http.client.HTTPException):
            if request(path, "GET", "health")[0] == 200:
                return time.monotonic() - start
        time.sleep(0.2)
    raise RuntimeError(f"not healthy after {timeout} s:\n{log.read_text()[-4000:]}")


def _error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def run(width=64, layers=3, rows=8, rtol=1e-2, timeout=300.0) -> dict:
    from qarray.checkpoint import save_model

    rng = np.random.default_rng(0)
    # a smooth activation: at an accelerator's default precision (one bf16
    # pass) a relu unit near zero can flip against the float64 reference and
    # move x's cotangent by far more than the products' error (seen on a TPU:
    # 10% through three relu layers, the apply within 0.2%)
    model = [
        net.make_layer(rng, width, width, "nk", "w", True, "tanh")
        for _ in range(layers)
    ]
    model[-1]["activation"] = "none"
    for layer in model:  # unit-scale activations through the layers
        layer["w"] /= np.float32(np.sqrt(width))
    x, g = net.normal(rng, (rows, width)), net.normal(rng, (rows, width))
    reference = {"x": x, "layers": model}
    report = {"socket": None, "width": width, "layers": layers, "rows": rows}
    with tempfile.TemporaryDirectory(prefix="qarray-uds-") as tmp:
        tmp = Path(tmp)
        save_model(tmp / "model.safetensors", model)
        path = str(tmp / "qarray.sock")  # short: AF_UNIX paths stop at 107 bytes
        (tmp / "outputs").mkdir()
        env = {
            **SERVER_ENV,
            "TESSERACT_API_PATH": str(ROOT / "tesseract_api.py"),
            "TESSERACT_OUTPUT_FORMAT": "json+base64",
            "TESSERACT_OUTPUT_PATH": str(tmp / "outputs"),
            "QARRAY_MODEL": str(tmp / "model.safetensors"),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), SERVER_ENV.get("PYTHONPATH")) if p
            ),
        }
        log = tmp / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*PROGRAM, "serve", "--uds", path],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=tmp,
            )
        report.update(socket=path, pid=proc.pid, command=PROGRAM[0])
        try:
            report["startup_s"] = wait_healthy(path, proc, timeout, log)
            start = time.perf_counter()
            status, out = request(path, "POST", "apply", {"inputs": {"x": x}})
            report["apply"] = _check(status, out, "y", net.forward(reference), rtol)
            report["apply"]["ms"] = 1e3 * (time.perf_counter() - start)
            start = time.perf_counter()
            status, out = request(
                path,
                "POST",
                "vector_jacobian_product",
                {
                    "inputs": {"x": x},
                    "vjp_inputs": ["x"],
                    "vjp_outputs": ["y"],
                    "cotangent_vector": {"y": g},
                },
            )
            want = net.vjp(reference, g)["x"]
            report["vjp"] = _check(status, out, "x", want, rtol)
            report["vjp"]["ms"] = 1e3 * (time.perf_counter() - start)
        finally:
            stop(proc)
            report["server_exit"] = proc.returncode
            report["server_log_tail"] = log.read_text(errors="replace")[-1500:]
    report["ok"] = all(report.get(k, {}).get("ok", False) for k in ("apply", "vjp"))
    return report


def _check(status, out, name, want, rtol) -> dict:
    if status != 200 or not isinstance(out, dict) or name not in out:
        return {"ok": False, "status": status, "body": str(out)[:500]}
    error = _error(out[name], want)
    return {"ok": error <= rtol, "status": status, "relative_error": error}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--rtol", type=float, default=1e-2)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    report = run(args.width, args.layers, args.rows, args.rtol, args.timeout)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
