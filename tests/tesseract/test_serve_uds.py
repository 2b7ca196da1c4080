"""The server on a Unix domain socket (``qarray-serve serve --uds PATH``, for
hosts that refuse TCP sockets): the option reaches uvicorn, one worker or
several, and scripts/serve_uds_check.py serves, answers and stops.

Covers: qarray/tesseract/_server.py, qarray/tesseract/_supervisor.py,
scripts/serve_uds_check.py"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from qarray.tesseract import _server
from support.server import ROOT


def test_uds_reaches_uvicorn(monkeypatch, tmp_path):
    import uvicorn

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.update(kwargs))
    path = str(tmp_path / "q.sock")
    _server.serve(["--uds", path])
    assert seen["uds"] == path
    _server.serve([])  # TCP, as before
    assert seen["uds"] is None
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 8000)


def test_uds_reaches_the_workers_supervisor(monkeypatch, tmp_path):
    seen = {}

    def supervise(host, port, workers, folders, uds=None):
        seen.update(workers=workers, uds=uds, folders=folders)

    monkeypatch.setattr(_server, "supervise", supervise)
    # _supervise leaves the workers their slots and weights in the environment
    monkeypatch.setenv(_server._WORKER_SLOTS, "")
    monkeypatch.setenv(_server.SHARED_WEIGHTS_ENV, "")
    path = str(tmp_path / "q.sock")
    try:
        _server.serve(["--uds", path, "--num-workers", "2"])
    finally:
        for folder in seen.get("folders", ()):
            shutil.rmtree(folder, ignore_errors=True)
    assert (seen["workers"], seen["uds"]) == (2, path)


def test_the_uds_check_script_serves_answers_and_stops(tmp_path):
    out = tmp_path / "uds.json"
    # the server on the CPU: under QARRAY_TEST_PLATFORM=tpu this process holds
    # the chip (the script's run on the chip is a command of its own)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/serve_uds_check.py"), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"]
    for endpoint in ("apply", "vjp"):
        assert report[endpoint]["status"] == 200
        assert report[endpoint]["relative_error"] < 1e-5  # float32 on the CPU
    assert report["server_exit"] is not None  # stopped, by its pid
    assert not os.path.exists(report["socket"])  # its folder is gone
    with pytest.raises(ProcessLookupError):
        os.kill(report["pid"], 0)
