"""The request guard: an ASGI middleware in front of every route of a qarray
Tesseract's app (``create_app``), refusing before the application sees the
request:

- a body over ``QARRAY_MAX_REQUEST_BYTES``: by its Content-Length without
  reading it, or as soon as a streamed body passes the limit (413);
- any ``binref`` array whose buffer is not a plain relative path inside the
  input folder (``TESSERACT_INPUT_PATH``): absolute paths, ``..``, URLs and
  fsspec protocols, symlinks that lead out (422), so nothing is read or fetched
  on a client's say-so;
- a binref array declaring more than ``QARRAY_MAX_ELEMENTS`` elements (413);
- a ``run_id`` that is not a plain name (400): the runtime makes a folder of it
  under the output folder.

and sheds load with 503 + ``Retry-After`` instead of running out of memory:

- request bytes in flight in this process (bodies being read, waiting or
  computing) are bounded by ``QARRAY_MAX_INFLIGHT_BYTES``: a request whose
  Content-Length would pass it is refused before its body is read.

How many compute at once is the batcher's (``QARRAY_MAX_CONCURRENCY``
batches, each of many requests: ``qarray.tesseract._batcher``), not the
guard's: a per-request bound here would cap every batch at it.

The guard parses a JSON body once and hands the document down in the scope
(``PARSED_BODY``): the compute routes (``_workarounds.ComputeRoutes``)
validate it without parsing the bytes again, and the binref check walks it
instead of scanning the bytes.

Validation errors (422) name the field and the problem but do not echo the
input back, and list at most ``MAX_LISTED_ERRORS`` problems with their count,
so an error body stays small whatever the request.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import parse_qs

from ._json_body import parse_body
from ._settings import Settings

MAX_LISTED_ERRORS = 10
MAX_MESSAGE_CHARS = 1000
RETRY_AFTER_SECONDS = 1

# the scope key of a body's parsed JSON document (None: not JSON); whoever
# reads it pops it, so the document is not held while the request computes
PARSED_BODY = "qarray.parsed_body"

_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# '<path>[:<offset>[:<compressed size>]]'; a path is plain names joined by '/'
_BINREF = re.compile(r"(?P<path>[^:]*)(:\d+(:\d+)?)?")
_SAFE_PATH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")


def binref_problem(buffer: str, input_dir: Path) -> str | None:
    """Why a binref buffer may not be read, or None if it names a file inside
    ``input_dir`` (the check happens before anything is opened)."""
    match = _BINREF.fullmatch(buffer)
    path = match.group("path") if match else ""
    if not match or not _SAFE_PATH.fullmatch(path):
        return (
            f"binref buffer {buffer!r} must be a relative path inside the input "
            "folder (names of letters, digits, '_', '.', '-' joined by '/'); absolute "
            "paths, '..', URLs and other protocols are refused"
        )
    if any(part == ".." for part in path.split("/")):
        return f"binref buffer {buffer!r} may not contain '..'"
    root = input_dir.resolve()
    target = (root / path).resolve()
    if not target.is_relative_to(root):
        return f"binref buffer {buffer!r} leads outside the input folder"
    return None


def _encoded_arrays(tree, path=""):
    """(field path, encoded-array dict) for every encoded array in a JSON tree."""
    if isinstance(tree, dict):
        if tree.get("object_type") == "array" and isinstance(tree.get("data"), dict):
            yield path, tree
            return
        for key, value in tree.items():
            yield from _encoded_arrays(value, f"{path}.{key}" if path else str(key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _encoded_arrays(value, f"{path}.[{i}]")


def _field_name(path: str) -> str:
    # the endpoint payload nests the schema under "inputs"
    return path.removeprefix("inputs.")


def check_body(tree, input_dir: Path, max_elements: int):
    """(status, message) for a request (``tree``: its parsed body, see
    ``parse_body``) that must be refused, else None."""
    try:
        arrays = list(_encoded_arrays(tree))
    except RecursionError:  # nested beyond any schema: the application refuses
        return None
    for path, array in arrays:
        data = array["data"]
        if data.get("encoding") != "binref":
            continue
        name = _field_name(path)
        buffer = data.get("buffer")
        if not isinstance(buffer, str):
            return 422, f"{name}: a binref buffer must be a string path"
        problem = binref_problem(buffer, input_dir)
        if problem:
            return 422, f"{name}: {problem}"
        shape = array.get("shape")
        if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            size = 1
            for d in shape:
                size *= max(d, 0)
            if size > max_elements:
                return 413, (
                    f"{name}: declared shape {tuple(shape)} has {size} elements, over "
                    f"the limit of {max_elements} (QARRAY_MAX_ELEMENTS)"
                )
    return None


class RequestGuard:
    """ASGI middleware applying the checks in this module's docstring."""

    def __init__(self, app, settings: Settings, input_dir: Path):
        self.app = app
        self.max_body = settings.max_request_bytes
        self.input_dir = input_dir
        self.max_elements = settings.max_elements
        self.max_inflight = settings.max_inflight_bytes
        self.inflight = 0  # request bytes held by this process right now

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        for run_id in query.get("run_id", []):
            if not _RUN_ID.fullmatch(run_id):
                return await reject(
                    send, 400, "run_id must be 1-128 letters, digits, '_' or '-'"
                )
        headers = dict(scope.get("headers", []))
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await reject(send, 400, "Content-Length must be a number")
            if int(declared) > self.max_body:
                return await reject(send, 413, self._too_large(int(declared)))
        # the declared bytes are reserved before any is read (a chunked body
        # reserves as it arrives); one event loop per process: no lock needed
        held = _Reservation(self)
        if not held.grow(int(declared or 0)):
            return await _shed(receive, send, self._busy(int(declared)))
        try:
            # chunks joined once at the end: one copy of the body, which the
            # check reads and the application gets as is (a single chunk:
            # Starlette's Request.body() takes it without copying again)
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None  # the client left: nothing to answer
                chunk = message.get("body", b"")
                chunks.append(chunk)
                size += len(chunk)
                if size > self.max_body:
                    return await reject(send, 413, self._too_large(size))
                if not held.grow(size):
                    message = self._busy(size)
                    chunks = []  # let go of it before draining the rest
                    return await _shed(receive, send, message)
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            del chunks
            tree = parse_body(body)
            refusal = check_body(tree, self.input_dir, self.max_elements)
            if refusal:
                return await reject(send, *refusal)
            downstream = {**scope, PARSED_BODY: tree}
            del tree  # the scope holds it until a route takes it

            replayed = False

            async def replay():
                nonlocal replayed, body
                if not replayed:
                    replayed = True
                    # handed over, not kept: the application holds the only copy
                    message, body = (
                        {"type": "http.request", "body": body, "more_body": False},
                        b"",
                    )
                    return message
                return await receive()  # e.g. the client disconnecting

            # the bytes stay counted while the request waits and computes
            return await self.app(downstream, replay, send)
        finally:
            held.release()

    def _busy(self, size: int) -> str:
        return (
            f"the server is busy: {self.inflight} request bytes in flight, and "
            f"{size} more would pass QARRAY_MAX_INFLIGHT_BYTES = {self.max_inflight}"
            f"; retry after {RETRY_AFTER_SECONDS} s"
        )

    def _too_large(self, size: int) -> str:
        return (
            f"request body of {size} bytes is over the limit of {self.max_body} "
            "bytes (QARRAY_MAX_REQUEST_BYTES)"
        )


class _Reservation:
    """Bytes one request holds of the guard's in-flight budget."""

    def __init__(self, guard: RequestGuard):
        self.guard = guard
        self.bytes = 0

    def grow(self, size: int) -> bool:
        """Hold ``size`` bytes in all (never less than held); False, holding no
        more, when that would pass the budget."""
        extra = size - self.bytes
        if extra <= 0:
            return True
        if self.guard.inflight + extra > self.guard.max_inflight:
            return False
        self.guard.inflight += extra
        self.bytes = size
        return True

    def release(self) -> None:
        self.guard.inflight -= self.bytes
        self.bytes = 0


async def _shed(receive, send, message: str):
    """503 with Retry-After: load shed before the body is read (or as soon as
    a body without Content-Length passes the budget).

    The rest of the body is drained unbuffered first: HTTP clients send the
    whole body before they read an answer, and a connection closed under an
    upload reaches them as a broken connection instead of this 503.
    """
    while True:
        message_in = await receive()
        if message_in["type"] == "http.disconnect" or not message_in.get(
            "more_body", False
        ):
            break
    await reject(
        send, 503, message, [(b"retry-after", str(RETRY_AFTER_SECONDS).encode())]
    )


async def reject(send, status: int, message: str, headers=()):
    body = json.dumps({"detail": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def validation_error_response(request, exc):
    """FastAPI's 422, without echoing each failing input back: a malformed
    100 MB array would otherwise come back whole in the error."""
    from fastapi.encoders import jsonable_encoder
    from fastapi.responses import JSONResponse

    errors = exc.errors()
    listed = [
        {
            k: (v[:MAX_MESSAGE_CHARS] if isinstance(v, str) else v)
            for k, v in error.items()
            if k not in ("input", "url", "ctx")
        }
        for error in errors[:MAX_LISTED_ERRORS]
    ]
    content = {"detail": jsonable_encoder(listed)}
    if len(errors) > len(listed):
        content["errors"] = len(errors)
        content["note"] = f"{len(errors)} problems; the first {len(listed)} are listed"
    return JSONResponse(status_code=422, content=content)
