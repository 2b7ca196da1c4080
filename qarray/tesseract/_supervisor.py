"""The process that watches ``qarray-serve serve --num-workers N``'s workers.

uvicorn's supervisor binds the port, starts the workers and restarts the ones
that die; it never runs a request. uvicorn spawns each worker as a fresh
interpreter that imports JAX, tesseract-core's runtime and FastAPI again, a
private heap paid N times (docs/deployment.md has the PSS). Here the
supervisor (``qarray-serve`` itself, the PID a client started) imports those
modules once, starting none of them (no JAX backend: XLA sizes its thread
pool by the cores a worker claims, ``claim_cores``; no model: the workers
load it, ``_shared_weights``), freezes them (``freeze_startup_objects``: the
collector never writes to, and so never copies, them) and forks the workers
(``_workarounds.fork_workers``): their imports are the supervisor's pages,
shared copy-on-write. A worker restarted after a crash is forked from the
same pages.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from pathlib import Path

APP = "qarray.tesseract._server:create_app"
# uvicorn's default (5 s) closes a connection a client reuses after a pause
# between its requests; tesseract-core's clients keep theirs open
KEEP_ALIVE_S = 60
# signals uvicorn's supervisor queues for itself: a worker forked before its
# server installs its own handlers must not queue them for nobody
_SUPERVISOR_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


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


def preload() -> None:
    """Import what every worker imports (module doc), start nothing, and
    freeze the objects so far out of the collector's reach."""
    import fastapi  # noqa: F401
    import jax.numpy  # noqa: F401
    import tesseract_core.runtime.serve  # noqa: F401

    from . import _runtime  # noqa: F401 (the resident model's, the batcher's)
    from ._memory import freeze_startup_objects

    freeze_startup_objects()


def _default_signals_in_child() -> None:
    for sig in _SUPERVISOR_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                      else signal.SIG_DFL)  # fmt: skip


def supervise(
    host: str,
    port: int,
    workers: int,
    folders: tuple[Path, ...],
    uds: str | None = None,
) -> None:
    """uvicorn's multi-worker supervisor over ``APP`` (on the Unix socket
    ``uds`` where given, else ``host:port``), its workers forked from this
    process after ``preload`` (module doc); removes ``folders`` (the
    workers' slots, the shared weights': a segment is memory while it
    exists) when it ends."""
    from ._workarounds import (
        OneWriteHTTPProtocol,
        fork_workers,
        install_nodelay_listener,
    )

    install_nodelay_listener()
    preload()
    fork_workers()
    os.register_at_fork(after_in_child=_default_signals_in_child)
    import uvicorn

    try:
        uvicorn.run(
            APP,
            factory=True,
            host=host,
            port=port,
            uds=uds,
            workers=workers,
            timeout_keep_alive=KEEP_ALIVE_S,
            http=OneWriteHTTPProtocol,
        )
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
