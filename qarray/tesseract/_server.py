"""The server: tesseract-core's app for a qarray Tesseract, behind the guard.

    qarray-serve serve --host 0.0.0.0 --port 8000 [--num-workers N]
    qarray-serve serve --uds /tmp/qarray.sock [--num-workers N]

takes the arguments ``tesseract-runtime serve`` takes (``tesseract serve`` runs
images that way; the other commands are ``qarray.tesseract._cli``'s), and
``--uds PATH``, which ``tesseract-runtime serve`` does not: uvicorn's, the
server bound to a Unix domain socket at PATH instead of a TCP port (hosts
that refuse TCP sockets, such as sandboxed accelerator hosts; a proxy on the
same host).

The served API docs (``/docs``, ReDoc) load their script from an installed
package (``fastapi-offline``) instead of a CDN, so they render on machines
without internet access.

Each worker keeps freed heap mapped for the next request
(``_memory.keep_freed_memory``): on a user's machine the page faults of
fresh memory can cost more than the rest of a big request
(``python -m benchmarks.parse_bodies`` shows them deciding its figures).

With ``--num-workers N`` and ``QARRAY_MODEL`` the workers map one read-only
copy of the resident weights (``_shared_weights``) instead of loading N.

With ``--num-workers N`` each worker takes its own 1/N of the cores this
process may run on (``os.sched_setaffinity``, before JAX starts: XLA sizes
its thread pool by the cores it may use), so N workers run N pools of
cores/N threads instead of N pools of all the cores competing for them
(``claim_cores``; docs/deployment.md has the measurements).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from importlib import resources
from pathlib import Path

from ._guard import RequestGuard, validation_error_response
from ._memory import freeze_startup_objects, keep_freed_memory
from ._metrics import MetricsRoute
from ._settings import Settings, SettingsError
from ._shared_weights import SHARED_WEIGHTS_ENV, make_shared_folder
from ._supervisor import APP, KEEP_ALIVE_S, stop_when_closed, supervise
from ._workarounds import (
    OneWriteHTTPProtocol,
    endpoints_off_event_loop,
    install_local_binref_files,
)

# set by main for its workers: a folder of one lock file per worker slot
_WORKER_SLOTS = "QARRAY_SERVE_WORKER_SLOTS"
_held_slot = None  # the open lock file of this worker's slot


def claim_cores(slots: str | None = None) -> set[int] | None:
    """This worker's share of the cores (module doc): the first free slot of
    ``slots`` (a folder ``main`` made, its name ``<folder>:<workers>``),
    held by a lock until the process ends (a restarted worker takes the slot
    its predecessor left). None where there is no folder (one worker) or
    affinity cannot be set."""
    global _held_slot
    slots = os.environ.get(_WORKER_SLOTS) if slots is None else slots
    if not slots or not hasattr(os, "sched_setaffinity"):
        return None
    folder, workers = slots.rsplit(":", 1)
    workers = int(workers)
    cores = sorted(os.sched_getaffinity(0))
    for slot in range(workers):
        handle = open(os.path.join(folder, f"slot-{slot}"), "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        _held_slot = handle
        share = max(1, len(cores) // workers)
        start = (slot * share) % len(cores)
        mine = set(cores[start : start + share])
        os.sched_setaffinity(0, mine)
        return mine
    return None


# the page's assets, served from fastapi_offline's static folder
_ASSETS = {
    "/docs/redoc.standalone.js": ("redoc.standalone.js", "application/javascript"),
    "/docs/favicon.png": ("favicon.png", "image/png"),
}


class OfflineDocs:
    """ASGI middleware answering ``/docs`` with ReDoc served from this
    process (``fastapi_offline``'s copy of its script) rather than from a
    CDN: tesseract-core's ``/docs`` shows a blank page without internet."""

    def __init__(self, app, title: str):
        self.app = app
        self.title = title

    async def __call__(self, scope, receive, send):
        path = scope.get("path") if scope["type"] == "http" else None
        if path == "/docs":
            from fastapi.openapi.docs import get_redoc_html

            page = get_redoc_html(
                openapi_url="/openapi.json",
                title=self.title,
                redoc_js_url="/docs/redoc.standalone.js",
                redoc_favicon_url="/docs/favicon.png",
                with_google_fonts=False,
            )
            return await page(scope, receive, send)
        if path in _ASSETS:
            from starlette.responses import Response

            name, media_type = _ASSETS[path]
            asset = resources.files("fastapi_offline") / "static" / name
            response = Response(asset.read_bytes(), media_type=media_type)
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def start_backend() -> None:
    """Start JAX's backend now: a platform that cannot start (``JAX_PLATFORMS
    =tpu`` on a machine without a chip) stops the server at start-up, saying
    why, instead of answering /health and then a 500 to every computation
    (JAX starts its backend at the first one)."""
    import jax

    try:
        jax.devices()
    except RuntimeError as failed:
        raise SystemExit(
            f"qarray-serve: JAX cannot start its backend: {failed}"
        ) from None


def create_app():
    """tesseract-core's app for TESSERACT_API_PATH, behind the guard, with
    the API module's settings (``RUNTIME.settings`` when it defines one)."""
    from fastapi.exceptions import RequestValidationError
    from tesseract_core.runtime.config import get_config
    from tesseract_core.runtime.core import get_tesseract_api
    from tesseract_core.runtime.serve import create_rest_api

    claim_cores()  # before the API module starts JAX
    api = get_tesseract_api()
    start_backend()
    app = create_rest_api(api)
    runtime = getattr(api, "RUNTIME", None)
    settings = runtime.settings if runtime is not None else Settings.from_env()
    # endpoints on worker threads: the event loop reads and validates requests
    # while others compute. A Runtime's batcher bounds the computations (a
    # batch counts once), so its requests may all wait in it; elsewhere the
    # threads are the bound
    threads = settings.max_concurrency
    if runtime is not None:
        threads *= settings.max_batch_rows
    batcher = runtime.batcher if runtime is not None else None
    served = endpoints_off_event_loop(app, threads, batcher) or app
    install_local_binref_files()
    # after the API module loaded (a resident model's float32 file is read and
    # freed there): what it let go of goes back to the system as before
    keep_freed_memory()
    app.add_exception_handler(RequestValidationError, validation_error_response)
    config = get_config()
    docs = OfflineDocs(served, title=f"{config.name or 'Tesseract'} - API docs")
    metrics = MetricsRoute(docs, batcher)
    guard = RequestGuard(metrics, settings, input_dir=Path(config.input_path))
    freeze_startup_objects()  # the last thing start-up makes: its objects stay
    return guard


def serve(argv: list[str]) -> int | None:
    """``qarray-serve serve [--host H] [--port P | --uds PATH] [--num-workers N]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="qarray-serve serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument(
        "--uds",
        default=None,
        metavar="PATH",
        help="bind a Unix domain socket at PATH instead of --host / --port",
    )
    # Tesseract.from_source (through shared_memory_tesseract) hands the server
    # the read end of a pipe its client holds: EOF there means the client is
    # gone, and the server stops rather than outlive it
    parser.add_argument("--parent-pipe-fd", type=int, default=None)
    args = parser.parse_args(argv)
    if args.num_workers < 1:
        parser.error("--num-workers must be >= 1")
    try:  # fail early, before the workers start
        Settings.from_env()
    except SettingsError as error:
        parser.exit(2, f"qarray-serve: {error}\n")

    if args.parent_pipe_fd is not None:
        stop_when_closed(args.parent_pipe_fd)
    if args.num_workers > 1:
        _supervise(args)
        return None
    import uvicorn

    uvicorn.run(
        APP,
        factory=True,
        host=args.host,
        port=args.port,
        uds=args.uds,
        timeout_keep_alive=KEEP_ALIVE_S,
        http=OneWriteHTTPProtocol,
    )
    return None


def _supervise(args) -> None:
    """This process becomes the workers' supervisor (``_supervisor``), after
    it leaves them their share of the cores (a folder of slots,
    ``claim_cores``) and one copy of the resident weights (a folder on
    ``/dev/shm``, ``_shared_weights``) in the environment they inherit."""
    slots = tempfile.mkdtemp(prefix="qarray-serve-workers-")
    os.environ[_WORKER_SLOTS] = f"{slots}:{args.num_workers}"
    shared = make_shared_folder()
    os.environ[SHARED_WEIGHTS_ENV] = str(shared)
    supervise(
        args.host, args.port, args.num_workers, (Path(slots), shared), uds=args.uds
    )
