"""Several `qarray-serve` replicas started at once, each stopped by its PID."""

import contextlib
import os
import subprocess

from support.server import ROOT, SERVE, free_port, stop, wait_healthy


@contextlib.contextmanager
def replicas(tmp_path, n, api_path=ROOT / "tesseract_api.py", env=None,
             workers=1, timeout=180):  # fmt: skip
    """Start ``n`` servers in parallel; yield [(url, Popen)].

    With one worker a replica is one process (uvicorn runs it in-process), so
    its PID is the server's: a test may SIGKILL it.
    """
    started = []
    logs = []
    try:
        for i in range(n):
            port = free_port()
            folder = tmp_path / f"replica-{i}"
            (folder / "outputs").mkdir(parents=True)
            log = open(folder / "server.log", "wb")
            logs.append(log)
            command = [str(SERVE), "serve", "--host", "127.0.0.1", "--port", str(port)]
            proc = subprocess.Popen(
                [*command, "--num-workers", str(workers)],
                env={
                    **os.environ,
                    "TESSERACT_API_PATH": str(api_path),
                    "TESSERACT_OUTPUT_FORMAT": "json+base64",
                    "TESSERACT_OUTPUT_PATH": str(folder / "outputs"),
                    "TESSERACT_NAME": "qarray",
                    "JAX_PLATFORMS": "cpu",
                    "XLA_FLAGS": "",
                    **(env or {}),
                },
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=folder,
            )
            started.append((f"http://127.0.0.1:{port}", proc, folder / "server.log"))
        for url, proc, log_path in started:
            wait_healthy(url, proc, timeout, log_path)
        yield [(url, proc) for url, proc, _ in started]
    finally:
        for _, proc, _ in started:
            stop(proc)
        for log in logs:
            log.close()
