"""deploy/nginx.conf, for real: Debian's nginx in front of three replicas.

A QAT loop runs through tesseract-jax against nginx while one replica is
SIGKILLed mid-run: every loss and gradient must still equal the NumPy
reference's and no request may fail (nginx replays the killed replica's
requests on another: every endpoint is a pure function).
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest
import requests
from tesseract_core import Tesseract
from tesseract_jax import apply_tesseract

from support import network as net
from support.server import ROOT, free_port
from tests.deploy.replicas import replicas

CONFIG = ROOT / "deploy/nginx.conf"
RTOL = ATOL = 2e-4
STEPS = 20
KILL_AT = 6  # the step during which one replica is SIGKILLed
_UPSTREAM = re.compile(r"^(\s*server 127\.0\.0\.1:)\d+( [^;]*;\n)", re.MULTILINE)
_LISTEN = "listen 127.0.0.1:8000;"


def nginx_binary() -> str:
    """Debian's nginx; installed with apt-get (as root) when absent."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.fail("nginx is not installed; as root, `apt-get install -y nginx`")
    # Debian's maintainer scripts never start the service without an init
    # system (or with a policy-rc.d that forbids it): nothing runs on port 80
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "nginx"]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        result = subprocess.run(install, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            pytest.fail(f"apt-get install nginx failed:\n{result.stderr[-2000:]}")
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
    assert found, "apt-get installed nginx, but no nginx binary was found"
    return found


def render(ports, listen_port) -> str:
    """deploy/nginx.conf with the upstream ports and the listen port put in."""
    text = CONFIG.read_text()
    lines = _UPSTREAM.findall(text)
    assert len(lines) == 3, "deploy/nginx.conf: expected 3 upstream server lines"
    prefix, options = lines[0]
    servers = "".join(f"{prefix}{port}{options}" for port in ports)
    first = _UPSTREAM.search(text)
    text = _UPSTREAM.sub("", text)
    text = text[: first.start()] + servers + text[first.start() :]
    assert text.count(_LISTEN) == 1
    return text.replace(_LISTEN, f"listen 127.0.0.1:{listen_port};")


@contextlib.contextmanager
def nginx(tmp_path, ports):
    """nginx in the foreground with its pid, logs and temp folders under
    tmp_path; stopped by its PID (its workers with it)."""
    binary = nginx_binary()
    prefix = tmp_path / "nginx"
    prefix.mkdir()
    listen_port = free_port()
    (prefix / "nginx.conf").write_text(render(ports, listen_port))
    command = [binary, "-p", f"{prefix}/", "-c", str(prefix / "nginx.conf")]
    command += ["-e", str(prefix / "error.log")]
    # the workers run as root here: tmp_path's parents are private to root
    command += ["-g", "daemon off; user root;"]
    check = subprocess.run([*command, "-t"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    log = open(prefix / "stdout.log", "wb")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{listen_port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, (prefix / "error.log").read_text()
            with contextlib.suppress(requests.RequestException):
                requests.get(f"{url}/health", timeout=2)
                break  # nginx answers (a 502 when no replica runs)
            assert time.monotonic() < deadline, "nginx did not answer"
            time.sleep(0.1)
        yield url, prefix
    finally:
        workers = []
        with contextlib.suppress(psutil.Error):
            workers = psutil.Process(proc.pid).children()
        proc.send_signal(signal.SIGTERM)  # fast shutdown: the master stops its workers
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for worker in workers:
            with contextlib.suppress(psutil.Error):
                worker.kill()
        log.close()


def access_log(prefix):
    """[(status, [upstream statuses], [upstream addresses])] per request."""
    out = []
    for line in (prefix / "access.log").read_text().splitlines():
        status = int(line.split('" ', 1)[1].split()[0])
        addrs = line.split("upstream=", 1)[1].split(" upstream_status=")[0]
        statuses = line.split("upstream_status=", 1)[1]
        out.append((status, re.split(r"[,:] ", statuses), re.split(r"[,:] ", addrs)))
    return out


def test_config_caps_bodies_with_a_json_413(tmp_path):
    """nginx refuses a body over QARRAY_MAX_REQUEST_BYTES by its Content-Length,
    before reading it, and answers JSON like the replicas' own 413. No replica
    needs to run for this."""
    with nginx(tmp_path, [free_port() for _ in range(3)]) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(
                b"POST /apply HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: 268435457\r\n\r\n{"
            )
            reply = b""
            while b"}" not in reply:
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
        head, body = reply.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 413"), head
        assert b"application/json" in head
        assert b"QARRAY_MAX_REQUEST_BYTES" in body


def _qat_problem(rng):
    inputs = {
        "x": net.normal(rng, (16, 8)),
        "layers": [
            net.make_layer(rng, 8, 16, "kn", "w", True, "silu"),
            net.make_layer(rng, 16, 4, "nk", "w", True, "none"),
        ],
    }
    target = net.normal(rng, (16, 4))
    return inputs, target


def test_qat_loop_through_nginx_survives_a_killed_replica(tmp_path, rng):
    inputs, target = _qat_problem(rng)
    keys = [(i, k) for i in range(2) for k in ("w", "bias")]
    params = [inputs["layers"][i][k] for i, k in keys]
    with (
        replicas(tmp_path, 3) as servers,
        nginx(tmp_path, [int(url.rsplit(":", 1)[1]) for url, _ in servers]) as (
            url,
            prefix,
        ),
    ):
        tess = Tesseract.from_url(url)

        def loss(params):
            request = {"x": jnp.asarray(inputs["x"]), "layers": []}
            for i, layer in enumerate(inputs["layers"]):
                request["layers"].append(
                    {
                        "layout": layer["layout"],
                        "activation": layer["activation"],
                        "w": params[2 * i],
                        "bias": params[2 * i + 1],
                    }
                )
            y = apply_tesseract(tess, request)["y"]
            return jnp.mean((y - target) ** 2)

        step = jax.jit(jax.value_and_grad(loss))
        victim = servers[1][1]
        for n in range(STEPS):
            if n == KILL_AT:  # lands while this step's requests are in flight
                threading.Timer(0.02, victim.send_signal, [signal.SIGKILL]).start()
            value, grads = step(params)
            # the NumPy reference at the same parameters
            for (i, k), p in zip(keys, params, strict=True):
                inputs["layers"][i][k] = p
            y = net.forward(inputs)
            want = net.vjp(inputs, 2 * (y - target) / y.size)
            np.testing.assert_allclose(value, np.mean((y - target) ** 2), rtol=1e-4)
            for (i, k), g in zip(keys, grads, strict=True):
                np.testing.assert_allclose(
                    g, want[f"layers.[{i}].{k}"], rtol=RTOL, atol=ATOL, err_msg=n
                )
            params = [p - np.float32(0.05) * np.asarray(g) for p, g in zip(
                params, grads, strict=True)]  # fmt: skip
        assert victim.wait(timeout=10) == -signal.SIGKILL
        log = access_log(prefix)

    errors = [entry for entry in log if entry[0] != 200]
    retried = [entry for entry in log if len(entry[1]) > 1]
    used = {addr for entry in log for addr in entry[2]}
    print(
        f"\nnginx: {len(log)} requests, {len(errors)} errors, {len(retried)} "
        f"retried on another replica: {[e[1] for e in retried]}"
    )
    assert not errors, errors
    assert retried, "no request reached the killed replica: nothing was tested"
    assert len(used) == 3, used  # round robin reached every replica
