"""The multi-worker supervisor (qarray/tesseract/_supervisor.py): it
starts no JAX backend, its workers are its forks and share its imports'
pages, they answer, and the shared weights' folder and the port go when it
stops; _workarounds' workarounds 4 (TCP_NODELAY on uvicorn's multi-worker
socket) and 5 (uvicorn's workers forked), pinned against uvicorn."""

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
from qarray.tesseract import _workarounds
from support import network as net
from support.server import b64, decode, serve, server_processes


def _thread_names(pid: int) -> set[str]:
    tasks = Path(f"/proc/{pid}/task")
    return {(t / "comm").read_text().strip() for t in tasks.iterdir()}


def _shared_anonymous_mib(pid: int) -> float:
    """MiB of pid's anonymous memory (its heap and Python's arenas) that it
    shares with other processes: only a fork shares those pages."""
    total, anonymous = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            anonymous = len(fields) < 6 or fields[5] == "[heap]"
        elif anonymous and fields[0] in ("Shared_Clean:", "Shared_Dirty:"):
            total += int(fields[1])
    return total / 1024


def test_the_workers_are_forks_that_share_the_supervisors_imports(tmp_path):
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
        workers = [c for c in children if c.cmdline() == supervisor.cmdline()]
        assert len(workers) == 2, [c.cmdline() for c in children]
        # JAX imported but never started there: no XLA thread, no model
        assert not any("XLA" in n for n in _thread_names(supervisor.pid))
        assert ".weights" not in Path(f"/proc/{supervisor.pid}/maps").read_text()
        # the imports' heap is shared with the supervisor (spawned: ~0)
        for worker in workers:
            assert _shared_anonymous_mib(worker.pid) > 16, worker.pid
        maps = Path(f"/proc/{workers[0].pid}/maps").read_text().splitlines()
        (segment,) = {line.split()[-1] for line in maps if line.endswith(".weights")}
        shared = Path(segment).parent
    # stopped (SIGTERM to the PID qarray-serve had): the segment is memory
    # while it exists, so it goes with the server
    assert not shared.exists()
    assert not psutil.pid_exists(supervisor.pid) or supervisor.status() == "zombie"


def test_the_supervisor_stops_when_its_client_pipe_closes(tmp_path):
    """The pipe Tesseract.from_source hands qarray-serve: its client gone,
    the supervisor and its workers stop."""
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
        supervisor = psutil.Process(proc.pid)
        while time.monotonic() < deadline and len(supervisor.children()) < 2:
            time.sleep(0.1)
        workers = supervisor.children()
        assert len(workers) == 2
        os.close(write)
        assert proc.wait(timeout=30) is not None
        psutil.wait_procs(workers, timeout=30)
        assert not any(w.is_running() and w.status() != "zombie" for w in workers)
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
        _workarounds.install_nodelay_listener()
        _workarounds.install_nodelay_listener()  # idempotent
        sock = Config("x:app", host="127.0.0.1", port=0, workers=2).bind_socket()
        sock.listen()
        client = socket.create_connection(sock.getsockname())
        accepted, _ = sock.accept()
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        for s in (client, accepted, sock):
            s.close()
    finally:
        Config.bind_socket = upstream


def test_uvicorn_spawns_its_workers_and_fork_workers_forks_them():
    import multiprocessing

    from uvicorn import _subprocess
    from uvicorn.config import Config

    assert _subprocess.spawn is multiprocessing.get_context("spawn")
    config = Config("x:app", workers=2)
    upstream = _subprocess.spawn
    try:
        assert _subprocess.get_subprocess(config, print, []).__class__.__name__ == (
            "SpawnProcess"
        )
        _workarounds.fork_workers()
        assert _subprocess.get_subprocess(config, print, []).__class__.__name__ == (
            "ForkProcess"
        )
    finally:
        _subprocess.spawn = upstream


def test_a_started_worker_keeps_its_startup_objects_from_the_collector(tmp_path):
    """create_app freezes what start-up made (the imports, the API module,
    the model): a full collection walks only what requests made since."""
    code = (
        "import gc; from qarray.tesseract._server import create_app; "
        "before = gc.get_freeze_count(); create_app(); "
        "print(gc.get_freeze_count() - before, len(gc.get_objects()))"
    )
    started = start_app(tmp_path, code, "cpu")
    assert started.returncode == 0, started.stderr[-2000:]
    out = started.stdout.split()
    frozen, tracked = int(out[-2]), int(out[-1])
    assert frozen > 50_000 and tracked < frozen / 100, (frozen, tracked)


def test_a_platform_that_cannot_start_stops_the_server_at_start_up(tmp_path):
    """JAX starts its backend at the first computation: without start_backend
    a server told JAX_PLATFORMS=tpu on a machine without a chip answered
    /health and then a 500 to every apply. It now stops at start-up."""
    code = "from qarray.tesseract._server import create_app; create_app()"
    out = start_app(tmp_path, code, "tpu")
    assert out.returncode != 0
    assert "qarray-serve: JAX cannot start its backend" in out.stderr, out.stderr[
        -2000:
    ]


def start_app(tmp_path, code: str, platforms: str) -> subprocess.CompletedProcess:
    """``code`` (which calls create_app) in a fresh Python serving this
    checkout's tesseract_api.py with ``JAX_PLATFORMS=platforms``."""
    env = {
        **os.environ,
        "TESSERACT_API_PATH": str(Path(__file__).parents[2] / "tesseract_api.py"),
        "TESSERACT_OUTPUT_PATH": str(tmp_path),
        "JAX_PLATFORMS": platforms,
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
