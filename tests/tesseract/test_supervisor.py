"""The multi-worker supervisor (qarray/tesseract/_supervisor.py): no JAX in
it, the workers it starts answer, the shared weights' folder and the port
go when it stops; and _workarounds' workaround 4 (TCP_NODELAY on uvicorn's
multi-worker socket), which lives there, pinned against uvicorn."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import requests

from qarray.checkpoint import save_model
from qarray.tesseract import _supervisor
from support import network as net
from support.server import b64, decode, serve, server_processes


def _jax_libraries(pid: int) -> set[str]:
    """The files of jaxlib (XLA's extension among them) process pid maps."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in maps if "/jaxlib/" in line}


def test_the_supervisor_holds_no_jax_and_its_workers_answer(tmp_path):
    rng = np.random.default_rng(4)
    layers = [net.make_layer(rng, 32, 8, "nk", "w_q", True, "relu")]
    model = tmp_path / "model.safetensors"
    save_model(model, layers)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    want = np.stack([net.forward_one(row, layers)[0] for row in x])
    with serve(tmp_path, env={"QARRAY_MODEL": str(model)}, workers=2) as url:
        for _ in range(4):  # new connections: both workers answer
            r = requests.post(
                f"{url}/apply", json={"inputs": {"x": b64(x)}}, timeout=60
            )
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(
                decode(r.json())["y"], want, rtol=2e-4, atol=2e-4
            )
        supervisor, *children = server_processes(url)
        argv = supervisor.cmdline()
        assert argv[1] == str(Path(_supervisor.__file__).resolve()), argv
        assert not _jax_libraries(supervisor.pid)
        assert sum(bool(_jax_libraries(c.pid)) for c in children) == 2
        shared = Path(argv[argv.index("--shared-folder") + 1])
        assert [p.suffix for p in shared.iterdir()].count(".weights") == 1
    # stopped (SIGTERM to the PID qarray-serve had): the segment is memory
    # while it exists, so it goes with the server
    assert not shared.exists()
    assert not psutil.pid_exists(supervisor.pid) or supervisor.status() == "zombie"


def test_the_supervisor_stops_when_its_client_pipe_closes(tmp_path):
    """The pipe Tesseract.from_source hands qarray-serve crosses the exec:
    its client gone, the supervisor and its workers stop."""
    read, write = os.pipe()
    env = {
        **os.environ,
        "TESSERACT_API_PATH": str(Path(__file__).parents[2] / "tesseract_api.py"),
        "TESSERACT_OUTPUT_PATH": str(tmp_path),
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("qarray-serve")),
            "serve",
            "--port",
            "0",
            "--num-workers",
            "2",
            "--parent-pipe-fd",
            str(read),
        ],
        env=env,
        pass_fds=(read,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(read)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "_supervisor.py" not in " ".join(
            psutil.Process(proc.pid).cmdline()
        ):
            time.sleep(0.1)
        assert "_supervisor.py" in " ".join(psutil.Process(proc.pid).cmdline())
        os.close(write)
        assert proc.wait(timeout=30) is not None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


def test_uvicorn_binds_a_protocol_zero_socket_and_nodelay_fixes_it():
    import socket

    import uvicorn
    from uvicorn.config import Config

    assert uvicorn.__version__ == "0.54.0"
    upstream = Config.bind_socket
    try:
        config = Config("x:app", host="127.0.0.1", port=0, workers=2)
        sock = upstream(config)
        # asyncio sets TCP_NODELAY only where proto == IPPROTO_TCP
        assert sock.proto == 0
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        sock.close()
        _supervisor.install_nodelay_listener()
        _supervisor.install_nodelay_listener()  # idempotent
        sock = Config("x:app", host="127.0.0.1", port=0, workers=2).bind_socket()
        sock.listen()
        client = socket.create_connection(sock.getsockname())
        accepted, _ = sock.accept()
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        for s in (client, accepted, sock):
            s.close()
    finally:
        Config.bind_socket = upstream
