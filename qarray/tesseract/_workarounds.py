"""Every tesseract-core (and uvicorn) workaround of qarray, in one place.

Each names the behaviour it works around and the tesseract-core version it
was checked against; ``tests/tesseract/test_workarounds.py`` has a test per
workaround that fails when tesseract-core stops behaving that way, so that an
upgrade fails loudly and the workaround can go.

Checked against tesseract-core 1.15.0.

1. **Gradient paths through fields a request left null.** The gradient
   endpoints' schemas check each path with
   ``schema_generation.input_path_validator``, whose lookup raises TypeError
   (answered as a 500) for a path that indexes a null list (``layers.[0].w``
   when the request omits ``layers`` to run the resident model), and which
   accepts a path to an absent optional array (``layers.[0].bias`` not
   given), whose tangent then fails as "expected 0D". ``install_gradient_path_check``
   reassigns the validator (before the runtime builds the schemas, i.e. at
   import of the API module) to one that turns the TypeError into the
   schema's own check, then calls ``inputs.check_gradient_path(path)`` when
   the InputSchema defines it: its ValueError is a 422 naming the path.
2. **No server of one's own for ``Tesseract.from_source``.** It always runs
   the ``tesseract-runtime`` console script found beside
   ``python_executable`` (``local_client._runtime_command``), so a Tesseract
   started that way serves without qarray's request guard.
   ``guarded_interpreter`` makes a folder holding a link to the interpreter
   and a ``tesseract-runtime`` script that runs ``qarray-serve`` (the same
   script every image installs, tesseract_config.yaml); passed as
   ``python_executable``, it makes ``from_source`` serve behind the guard.
3. **Endpoints computed on the event loop, one at a time.** tesseract-core's
   route handler (``serve.create_rest_api``'s ``wrapper``) is an ``async
   def`` that calls the endpoint synchronously, inside ``mpa.start_run``,
   whose stdio redirection holds a process-wide lock: a worker reads,
   validates, computes and encodes one request after another, and no two
   requests are ever inside endpoints at once (so none can be batched).
   ``endpoints_off_event_loop`` replaces the handlers of the computational
   routes with ones that call the same endpoint functions and encode the
   same responses (``serve.negotiate_encoding``, ``serve.create_response``)
   on worker threads, without the per-request run folder and log capture.
   Left as they are with a GPU transport or profiling on.
4. **A delayed-ACK stall per response with ``--num-workers`` > 1** (uvicorn 0.54,
   the server tesseract-core runs on). With more than one worker uvicorn
   binds the listening socket itself (``Config.bind_socket``:
   ``socket.socket(family, SOCK_STREAM)``, protocol 0), and asyncio sets
   TCP_NODELAY only on sockets whose protocol is IPPROTO_TCP, so every
   response waits out Nagle's algorithm against the client's delayed ACK (a
   tiny request is then dominated by that wait, stock ``tesseract-runtime
   serve`` alike: benchmarks/bench_load.py's ``workers_rows`` compares one
   worker and two).
   ``install_nodelay_listener`` makes ``bind_socket`` set TCP_NODELAY on the
   listening socket, which the accepted connections inherit (Linux).
5. **Every worker a fresh interpreter** (uvicorn 0.54). uvicorn starts its
   workers through ``multiprocessing``'s "spawn" context, a module-level
   ``uvicorn._subprocess.spawn`` with no option to change it, so each worker
   imports JAX, tesseract-core and FastAPI into a private heap.
   ``fork_workers`` gives that module the "fork" context instead: the
   workers are forked from a supervisor that imported those modules
   (``_supervisor``), and share their pages.
6. **Every binref output file opened through fsspec.** Writing an array as
   json+binref (``array_encoding.dump_binref_arraydict``) sizes and appends
   to its file with ``file_interactions.get_filesize`` and ``write_to_path``,
   each an ``fsspec.open`` (protocol parsing, a file-system object, a file
   wrapper) for what is a local file on one host: most of a small binref
   response's encoding (docs/performance-notes.md).
   ``install_local_binref_files`` gives ``array_encoding`` versions that use
   ``os`` for plain local paths and upstream's for URLs and fsspec chains.
7. **A response's headers and body in two writes** (uvicorn 0.54, h11 and
   httptools alike). ``http.response.start`` writes the status line and
   headers to the socket at once, ``http.response.body`` the body after it:
   two ``send`` calls, and between them the event loop's thread gives up
   the GIL (the first call is a system call) to the worker threads, for
   up to a switch interval. A replica killed in that gap has sent a
   response's headers and not its body: a balancer in front (nginx) has
   passed the headers on and cannot replay the request on another replica,
   and the client reads a short body (docs/deployment.md).
   ``OneWriteHTTPProtocol`` is uvicorn's HTTP protocol (the one
   ``http="auto"`` picks) whose transport holds a write until the next one
   and sends both with one ``writelines`` (one ``sendmsg``), or sends it
   alone at the end of the event-loop turn: a response that fits the
   socket's buffer leaves whole or not at all. (Sending only at the end of
   the turn would make every small request wait for the handler's own work
   after the response: ``make bench``, suite http.)
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import sys
from pathlib import Path

from tesseract_core.runtime import array_encoding, schema_generation
from tesseract_core.runtime import serve as _serve
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from ._guard import PARSED_BODY
from ._json_body import parse_body
from ._threads import WorkerThreads

_UNPARSED = object()  # a scope the guard did not see (an app without it)

CHECKED_AGAINST = "1.15.0"

_upstream_input_path_validator = schema_generation.input_path_validator


def checked_input_path(path: str, info) -> str:
    """tesseract-core's gradient path check, then the InputSchema's own."""
    try:
        path = _upstream_input_path_validator(path, info)
    except TypeError:
        pass  # a path through a null field: the schema's check names it
    inputs = info.data.get("inputs")
    check = getattr(inputs, "check_gradient_path", None)
    if check is not None:
        try:
            check(path)
        except ValueError as error:
            raise ValueError(f"{info.field_name}: {error}") from None
    return path


def install_nodelay_listener() -> None:
    """Workaround 4 (module doc); idempotent."""
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


def fork_workers() -> None:
    """Workaround 5 (module doc): uvicorn's workers forked, not spawned."""
    from uvicorn import _subprocess

    _subprocess.spawn = multiprocessing.get_context("fork")


_upstream_filesize = array_encoding.get_filesize
_upstream_write = array_encoding.write_to_path


def _is_local(path) -> bool:
    """A plain file path, not a URL nor an fsspec chain (``a::b``)."""
    path = os.fspath(path)
    return "://" not in path and "::" not in path


def local_filesize(path) -> int:
    """``file_interactions.get_filesize``: bytes in the file, 0 if absent."""
    if not _is_local(path):
        return _upstream_filesize(path)
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def local_write(buffer: bytes, path, append: bool = False) -> None:
    """``file_interactions.write_to_path``: ``buffer`` written (appended) to
    ``path``, its folders made as needed."""
    if not _is_local(path):
        return _upstream_write(buffer, path, append=append)
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "ab" if append else "wb") as file:
        file.write(buffer)
    return None


def install_local_binref_files() -> None:
    """Workaround 6 (module doc); idempotent."""
    array_encoding.get_filesize = local_filesize
    array_encoding.write_to_path = local_write


class OneWriteTransport:
    """``transport`` (an asyncio write transport) that holds each write
    until the next one, which it sends with it at once (one
    ``writelines``), or until the end of the event-loop turn: a response's
    headers leave with its body (workaround 7). ``close`` sends what it
    holds first. Every other attribute is the wrapped transport's."""

    def __init__(self, transport):
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._held = None

    def write(self, data) -> None:
        if not data:
            return
        if self._held is None:
            # sent when the turn ends if nothing follows it (a streamed body)
            self._held = data
            self._loop.call_soon(self.flush)
            return
        held, self._held = self._held, None
        if not self._transport.is_closing():
            self._transport.writelines((held, data))

    def writelines(self, list_of_data) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Sends the write held, if any."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def get_write_buffer_size(self) -> int:
        held = 0 if self._held is None else len(self._held)
        return self._transport.get_write_buffer_size() + held

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class OneWriteHTTPProtocol(AutoHTTPProtocol):
    """Workaround 7 (module doc): the HTTP protocol to give
    ``uvicorn.run(http=...)``: uvicorn's own (``http="auto"``'s) over a
    ``OneWriteTransport``."""

    def connection_made(self, transport) -> None:
        super().connection_made(OneWriteTransport(transport))


def install_gradient_path_check() -> None:
    """Workaround 1 (module doc); idempotent."""
    schema_generation.input_path_validator = checked_input_path


_RUNTIME_SCRIPT = """#!{python}
import os
import sys

os.environ.update({environment!r})

from qarray.tesseract import main

sys.exit(main())
"""


def guarded_interpreter(
    folder: Path,
    python: str | Path = sys.executable,
    environment: dict[str, str] | None = None,
) -> Path:
    """Workaround 2 (module doc): ``folder/python``, a link to ``python``
    beside a ``tesseract-runtime`` script that runs ``qarray-serve`` on it
    with ``environment`` added (``from_source`` takes none of its own); give
    it to ``Tesseract.from_source(python_executable=...)``."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "python"
    if not link.exists():
        link.symlink_to(Path(python).absolute())
    script = folder / "tesseract-runtime"
    script.write_text(
        _RUNTIME_SCRIPT.format(
            python=Path(python).absolute(), environment=dict(environment or {})
        )
    )
    os.chmod(script, 0o755)
    return link


COMPUTE_ROUTES = (
    "/apply",
    "/jacobian",
    "/jacobian_vector_product",
    "/vector_jacobian_product",
)


def endpoints_off_event_loop(app, threads: int, batcher=None) -> ComputeRoutes | None:
    """Workaround 3 (module doc): ``app``'s computational routes call their
    endpoints on at most ``threads`` worker threads at once. Returns the
    ASGI app to serve (``ComputeRoutes`` in front of ``app``); None where the
    upstream handlers stay (GPU transport, profiling). ``batcher``: the
    Tesseract's (``Batcher.expect``: a forming batch waits for the requests
    being validated)."""
    from tesseract_core.runtime.config import get_config

    config = get_config()
    if config.gpu_transport != "none" or config.profiling:
        return None
    return ComputeRoutes(app, threads, batcher)


class ComputeRoutes:
    """The computational routes off the event loop (workaround 3), and a
    short way through for well-formed requests.

    FastAPI's handlers of ``COMPUTE_ROUTES`` are replaced by ones that call
    the same endpoint functions (``create_endpoints``'), encode the same
    responses and run both on worker threads. In front of the app, a
    well-formed request (a JSON body the route's payload schema accepts, no
    query string) is validated and answered here without FastAPI's routing
    and dependency solving (a visible part of a small request's cost under
    load: docs/performance-notes.md); any other request (malformed, invalid,
    ``run_id`` given, an Accept header it cannot honour) goes on to FastAPI
    with its body, and gets FastAPI's answer.
    """

    def __init__(self, app, threads: int, batcher=None):
        import inspect

        from fastapi.routing import APIRoute

        self.app = app
        self.workers = WorkerThreads(threads)
        self.batcher = batcher
        self.routes: dict[str, tuple] = {}  # path: (payload schema, endpoint)
        for route in list(app.router.routes):
            if not isinstance(route, APIRoute) or route.path not in COMPUTE_ROUTES:
                continue
            upstream = route.endpoint
            endpoint = upstream.__wrapped__  # create_endpoints' function
            (payload,) = inspect.signature(endpoint).parameters.values()
            self.routes[route.path] = (payload.annotation, endpoint)

            async def handler(
                *args, accept, run_id, exports_done, endpoint=endpoint, **kwargs
            ):
                return await self._respond(
                    lambda: endpoint(*args, **kwargs), accept, run_id
                )

            handler.__signature__ = upstream.__signature__
            handler.__name__, handler.__doc__ = upstream.__name__, upstream.__doc__
            app.router.routes.remove(route)
            app.add_api_route(route.path, handler, methods=sorted(route.methods))

    async def _respond(self, call, accept: str | None, run_id: str | None):
        """``call()``'s result as tesseract-core's response, both made on a
        worker thread (the run folder named as upstream names it)."""
        import uuid

        from tesseract_core.runtime.config import get_config

        encoding = _serve.negotiate_encoding(accept)  # a 406 when it cannot
        rundir = None  # only binref outputs are written to a run folder
        if encoding.output_format == "json+binref":
            # a random name on the event loop is a visible part of a small
            # request's cost under load: named only where files are written
            rundir = f"run_{run_id or uuid.uuid4()}"
        output_path = get_config().output_path

        def compute():
            return _serve.create_response(
                call(), encoding, base_dir=output_path, binref_dir=rundir
            )

        return await self.workers.run(compute)

    async def __call__(self, scope, receive, send):
        # the guard's parse of the body (every route: FastAPI's parse their own)
        parsed = scope.pop(PARSED_BODY, _UNPARSED)
        route = self.routes.get(scope.get("path")) if scope["type"] == "http" else None
        if route is None or scope.get("method") != "POST" or scope.get("query_string"):
            return await self.app(scope, receive, send)
        body, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None  # the client left: nothing to answer
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(body)
        headers = dict(scope.get("headers", []))
        payload = _well_formed(route[0], body, headers.get(b"content-type"), parsed)
        del parsed
        if payload is None:  # FastAPI answers it, from the same bytes
            return await self.app(scope, _replay(body, receive), send)
        from fastapi import HTTPException
        from fastapi.responses import JSONResponse

        endpoint, batcher = route[1], self.batcher
        accept = headers.get(b"accept")
        arrival = None if batcher is None else batcher.expect()

        def call():
            if arrival is None:
                return endpoint(payload)
            with batcher.arriving(arrival):
                return endpoint(payload)

        try:
            response = await self._respond(
                call, None if accept is None else accept.decode("latin-1"), None
            )
        except HTTPException as error:  # what FastAPI's handler answers
            response = JSONResponse(
                {"detail": error.detail}, error.status_code, headers=error.headers
            )
        finally:
            if arrival is not None:
                batcher.settle(arrival)
        await response(scope, receive, send)
        return None


def _well_formed(schema, body: bytes, content_type: bytes | None, parsed=_UNPARSED):
    """``body`` as ``schema``'s payload, or None where FastAPI should decide
    (not JSON as FastAPI reads it, or not valid); ``parsed``: the guard's
    ``parse_body(body)``, where it ran."""
    from pydantic import ValidationError

    if content_type is not None:
        kind = content_type.split(b";", 1)[0].strip().lower()
        if kind != b"application/json":
            return None
    tree = parse_body(body) if parsed is _UNPARSED else parsed
    if tree is None:  # not JSON (or JSON null, which no payload schema takes)
        return None
    try:
        return schema.model_validate(tree)
    except (ValueError, ValidationError, RecursionError):
        return None


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that gives ``body`` once, then the real one."""
    given = False

    async def replayed():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
