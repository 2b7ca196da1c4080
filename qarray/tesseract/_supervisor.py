"""The process that watches ``qarray-serve serve --num-workers N``'s workers.

uvicorn's supervisor binds the port, starts the workers (each a fresh
interpreter that imports the app) and restarts the ones that die; it never
runs a request. Importing anything of qarray would import JAX into it (the
package's ``__init__``), which is memory every worker already has (its
heap, not shared: docs/deployment.md has the PSS). So ``_server.serve``
checks the settings and prepares the workers' environment, then replaces
itself (``os.execv``, the same PID: a client holding it sees no change) with
this file run by path, which imports the standard library and uvicorn only.

    python .../qarray/tesseract/_supervisor.py --host H --port P
        --num-workers N [--shared-folder DIR] [--parent-pipe-fd FD]

Also here because the supervisor needs them and may not import the rest:
``install_nodelay_listener`` (workaround 4 of ``_workarounds``) and
``stop_when_closed``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path

APP = "qarray.tesseract._server:create_app"
# uvicorn's default (5 s) closes a connection a client reuses after a pause
# between its requests; tesseract-core's clients keep theirs open
KEEP_ALIVE_S = 60


def command(
    host: str,
    port: int,
    workers: int,
    shared_folder: Path | None,
    parent_pipe_fd: int | None,
) -> list[str]:
    """The argv that runs this file as the supervisor, with this Python."""
    argv = [sys.executable, str(Path(__file__).resolve())]
    argv += ["--host", host, "--port", str(port), "--num-workers", str(workers)]
    if shared_folder is not None:
        argv += ["--shared-folder", str(shared_folder)]
    if parent_pipe_fd is not None:
        argv += ["--parent-pipe-fd", str(parent_pipe_fd)]
    return argv


def install_nodelay_listener() -> None:
    """Workaround 4 (``_workarounds``' module doc): uvicorn's multi-worker
    listening socket sets TCP_NODELAY, which the accepted connections
    inherit (Linux); idempotent."""
    from uvicorn.config import Config

    if getattr(Config.bind_socket, "sets_nodelay", False):
        return
    upstream = Config.bind_socket

    def bind_socket(self):
        sock = upstream(self)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    bind_socket.sets_nodelay = True
    Config.bind_socket = bind_socket


def stop_when_closed(fd: int) -> None:
    """SIGTERM to this process (uvicorn stops its workers and frees the port)
    once the other end of pipe ``fd`` is closed: ``Tesseract.from_source``
    hands the server the read end of a pipe its client holds, and the server
    must not outlive the client."""

    def watch() -> None:
        try:
            while os.read(fd, 1):  # nothing is written: only EOF matters
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="client-watch").start()


def supervise(argv: list[str]) -> None:
    """uvicorn's multi-worker supervisor over ``APP`` (module doc); removes
    the shared-weights folder when it ends (the segment is memory while it
    exists)."""
    parser = argparse.ArgumentParser(prog="qarray-serve supervisor")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True)
    parser.add_argument("--shared-folder", type=Path, default=None)
    parser.add_argument("--parent-pipe-fd", type=int, default=None)
    args = parser.parse_args(argv)
    if args.parent_pipe_fd is not None:
        stop_when_closed(args.parent_pipe_fd)
    install_nodelay_listener()
    import uvicorn

    try:
        uvicorn.run(
            APP,
            factory=True,
            host=args.host,
            port=args.port,
            workers=args.num_workers,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    finally:
        if args.shared_folder is not None:
            shutil.rmtree(args.shared_folder, ignore_errors=True)


if __name__ == "__main__":
    # run by path, Python put this file's folder first on the path, where
    # qarray.tesseract's private modules would shadow any top-level module of
    # the same name for the workers too (they start from this path)
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    supervise(sys.argv[1:])
