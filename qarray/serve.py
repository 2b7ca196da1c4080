"""The Tesseract's HTTP server: tesseract-core's app behind a request guard.

    qarray-serve serve --host 0.0.0.0 --port 8000 [--num-workers N]

takes the arguments ``tesseract-runtime serve`` takes (``tesseract serve`` runs
images that way); any other command is handed to ``tesseract-runtime``. Needs
tesseract-core's runtime (``pip install qarray[tesseract]``); importing
``qarray`` does not import this module.

The guard, an ASGI middleware in front of every route, refuses before the
application sees the request:

- a body over ``QARRAY_MAX_REQUEST_BYTES`` (default 256 MiB): by its
  Content-Length without reading it, or as soon as a streamed body passes the
  limit (413);
- any ``binref`` array whose buffer is not a plain relative path inside the
  input folder (``TESSERACT_INPUT_PATH``): absolute paths, ``..``, URLs and
  fsspec protocols, symlinks that lead out (422), so nothing is read or fetched
  on a client's say-so;
- a binref array declaring more than ``QARRAY_MAX_ELEMENTS`` elements (413);
- a ``run_id`` that is not a plain name (400): the runtime makes a folder of it
  under the output folder.

and sheds load with 503 + ``Retry-After`` instead of running out of memory:

- request bytes in flight in this process (bodies being read, waiting or
  computing) are bounded by ``QARRAY_MAX_INFLIGHT_BYTES`` (default: 1/16 of the
  machine's memory, at least ``QARRAY_MAX_REQUEST_BYTES``): a request whose
  Content-Length would pass it is refused before its body is read;
- at most ``QARRAY_MAX_CONCURRENCY`` requests compute at once (default: the
  CPU count); the others wait, their bytes counted in flight.

Validation errors (422) name the field and the problem but do not echo the
input back, and list at most ``MAX_LISTED_ERRORS`` problems with their count,
so an error body stays small whatever the request.

Each worker keeps up to 256 MiB of freed heap mapped for the next request
(glibc's malloc, ``_keep_freed_memory``): page faults on fresh memory cost
more than the rest of a big request on the VMs this was measured on.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path
from urllib.parse import parse_qs

DEFAULT_MAX_REQUEST_BYTES = 256 * 2**20
DEFAULT_MAX_ELEMENTS = 2**25
MAX_LISTED_ERRORS = 10
MAX_MESSAGE_CHARS = 1000
RETRY_AFTER_SECONDS = 1

_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# '<path>[:<offset>[:<compressed size>]]'; a path is plain names joined by '/'
_BINREF = re.compile(r"(?P<path>[^:]*)(:\d+(:\d+)?)?")
_SAFE_PATH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{name} must be an integer, got {raw!r}.") from None
    if value < 1:
        raise SystemExit(f"{name} must be >= 1, got {value}.")
    return value


def default_max_inflight_bytes() -> int:
    """1/16 of the machine's physical memory: a request's peak memory is a few
    times its body (JSON text, decoded arrays, results)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 8 * 2**30
    return memory // 16


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


def _may_hold_binref(body: bytes) -> bool:
    """False only if no JSON string in ``body`` can decode to "binref".

    Without a backslash (JSON escapes) or a NUL byte (UTF-16/32 bodies, which
    json.loads accepts), the string "binref" can only be written as the bytes
    ``"binref"``: every quote is looked at (memchr from quote to quote: a
    base64 buffer is one long string) instead of scanning for the word, which
    ran at ~1 GB/s over base64 text (20 ms for a 22 MB body). Bodies with
    many quotes fall back to that scan.
    """
    if b"\\" in body or b"\x00" in body:  # escapes or wide encodings: parse
        return True
    find, quotes = body.find, 0
    at = find(b'"')
    while at >= 0:
        if body[at + 1 : at + 8] == b'binref"':
            return True
        quotes += 1
        if quotes > 4096:
            return b'"binref"' in body
        at = find(b'"', at + 1)
    return False


def check_body(body: bytes, input_dir: Path, max_elements: int):
    """(status, message) for a request body that must be refused, else None."""
    if not _may_hold_binref(body):  # the common case: no parse
        return None
    try:
        tree = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # the application answers malformed JSON itself
    for path, array in _encoded_arrays(tree):
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

    def __init__(
        self,
        app,
        max_body: int,
        input_dir: Path,
        max_elements: int,
        max_inflight: int | None = None,
        max_concurrency: int | None = None,
    ):
        self.app = app
        self.max_body = max_body
        self.input_dir = input_dir
        self.max_elements = max_elements
        self.max_inflight = max(max_inflight or max_body, max_body)
        self.inflight = 0  # request bytes held by this process right now
        self.computing = asyncio.Semaphore(max_concurrency or os.cpu_count() or 1)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        for run_id in query.get("run_id", []):
            if not _RUN_ID.fullmatch(run_id):
                return await _reject(
                    send, 400, "run_id must be 1-128 letters, digits, '_' or '-'"
                )
        headers = dict(scope.get("headers", []))
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _reject(send, 400, "Content-Length must be a number")
            if int(declared) > self.max_body:
                return await _reject(send, 413, self._too_large(int(declared)))
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
                    return await _reject(send, 413, self._too_large(size))
                if not held.grow(size):
                    message = self._busy(size)
                    chunks = []  # let go of it before draining the rest
                    return await _shed(receive, send, message)
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            del chunks
            refusal = check_body(body, self.input_dir, self.max_elements)
            if refusal:
                return await _reject(send, *refusal)

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

            # computations wait their turn here, their bytes still counted
            async with self.computing:
                return await self.app(scope, replay, send)
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
    await _reject(
        send, 503, message, [(b"retry-after", str(RETRY_AFTER_SECONDS).encode())]
    )


async def _reject(send, status: int, message: str, headers=()):
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


def _validation_error_response(request, exc):
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


# glibc's malloc gives a freed block of more than its (dynamic) threshold back
# to the system, so every big buffer of the next request (the body, its str,
# the base64 strings, the decoded arrays) is fresh memory again: measured at
# 4-6 us per 4 KiB page fault on these VMs, 20-35 ms per 22 MB buffer, more
# than the rest of the request. Blocks up to 32 MiB (glibc's largest mmap
# threshold) come from the heap, and up to SERVE_KEEP_FREED_BYTES of free
# heap stays mapped for the next request. MALLOC_*_ in the environment win.
SERVE_MMAP_THRESHOLD_BYTES = 32 * 2**20
SERVE_KEEP_FREED_BYTES = 256 * 2**20


def _keep_freed_memory() -> bool:
    """Tune glibc's malloc for a server of big requests (see above); False
    where it cannot (not glibc) or the environment already does."""
    import ctypes

    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(
        mallopt(m_mmap_threshold, SERVE_MMAP_THRESHOLD_BYTES)
        and mallopt(m_trim_threshold, SERVE_KEEP_FREED_BYTES)
    )


def create_app():
    """tesseract-core's app for TESSERACT_API_PATH, behind the guard."""
    from fastapi.exceptions import RequestValidationError
    from tesseract_core.runtime.config import get_config
    from tesseract_core.runtime.core import get_tesseract_api
    from tesseract_core.runtime.serve import create_rest_api

    app = create_rest_api(get_tesseract_api())
    # after the API module loaded (a resident model's float32 file is read and
    # freed there): what it let go of goes back to the system as before
    _keep_freed_memory()
    app.add_exception_handler(RequestValidationError, _validation_error_response)
    return RequestGuard(
        app,
        max_body=_env_int("QARRAY_MAX_REQUEST_BYTES", DEFAULT_MAX_REQUEST_BYTES),
        input_dir=Path(get_config().input_path),
        max_elements=_env_int("QARRAY_MAX_ELEMENTS", DEFAULT_MAX_ELEMENTS),
        max_inflight=_env_int(
            "QARRAY_MAX_INFLIGHT_BYTES", default_max_inflight_bytes()
        ),
        max_concurrency=_env_int("QARRAY_MAX_CONCURRENCY", os.cpu_count() or 1),
    )


def main(argv=None) -> None:
    """``qarray-serve serve [--host H] [--port P] [--num-workers N]``;
    ``qarray-serve convert ...`` converts a PyTorch state dict to a model file
    (qarray.checkpoint); any other command runs as ``tesseract-runtime`` would
    run it."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "convert":
        from .checkpoint import main as convert_main

        return convert_main(argv[1:])
    if not argv or argv[0] != "serve":
        from tesseract_core.runtime.cli import main as runtime_main

        sys.argv = ["tesseract-runtime", *argv]
        return runtime_main()
    parser = argparse.ArgumentParser(prog="qarray-serve serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-workers", type=int, default=1)
    args = parser.parse_args(argv[1:])
    if args.num_workers < 1:
        parser.error("--num-workers must be >= 1")

    import uvicorn

    _env_int("QARRAY_MAX_REQUEST_BYTES", DEFAULT_MAX_REQUEST_BYTES)  # fail early
    uvicorn.run(
        "qarray.serve:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.num_workers,
        timeout_keep_alive=60,
    )
    return None


if __name__ == "__main__":
    main()
