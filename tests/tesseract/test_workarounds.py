"""Each tesseract-core workaround in qarray/tesseract/_workarounds.py, pinned:
the upstream behaviour it works around (these fail once tesseract-core stops
behaving that way: drop the workaround then), and what it does instead."""

from importlib.metadata import version
from types import SimpleNamespace

import numpy as np
import pytest
from tesseract_core.runtime import schema_generation
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from qarray.tesseract import _workarounds
from support import network as net
from support.server import b64


def test_checked_against_the_installed_tesseract_core():
    assert version("tesseract-core") == _workarounds.CHECKED_AGAINST


@pytest.fixture(scope="module")
def api():
    import sys

    from support.server import ROOT

    sys.path.insert(0, str(ROOT))
    import tesseract_api

    return tesseract_api


def info(inputs, field="vjp_inputs"):
    """What pydantic hands an AfterValidator (the parts the validators read)."""
    return SimpleNamespace(data={"inputs": inputs}, field_name=field)


def w_layer_inputs(api, rng):
    """A request whose layer 0 gives dense w (its w_q is null) and no bias."""
    inputs = net.three_layer(rng)
    inputs["layers"][0] = {"w": inputs["layers"][0]["w"], "layout": "kn"}
    return api.InputSchema.model_validate(inputs)


def resident_inputs(api, rng):
    """A request that omits layers (run by a resident model), unvalidated:
    this test process loads none."""
    return api.InputSchema.model_construct(x=net.normal(rng, (2, 6)), layers=None)


def test_upstream_path_check_raises_typeerror_through_a_null_list(api, rng):
    with pytest.raises(TypeError):
        _workarounds._upstream_input_path_validator(
            "layers.[0].w", info(resident_inputs(api, rng))
        )


def test_upstream_path_check_accepts_an_absent_array(api, rng):
    inputs = w_layer_inputs(api, rng)
    assert inputs.layers[0].bias is None
    path = "layers.[0].bias"
    assert _workarounds._upstream_input_path_validator(path, info(inputs)) == path


def test_installed_check_names_the_path(api, rng):
    assert schema_generation.input_path_validator is _workarounds.checked_input_path
    inputs = w_layer_inputs(api, rng)
    for path, text in (
        ("layers.[0].w_q.scale", "Could not find vjp_inputs path"),  # upstream's
        ("layers.[0].bias", "vjp_inputs: 'layers.[0].bias' names an array this"),
    ):
        with pytest.raises(ValueError) as error:
            _workarounds.checked_input_path(path, info(inputs))
        assert path in str(error.value) and text in str(error.value)
    assert _workarounds.checked_input_path("x", info(inputs)) == "x"
    with pytest.raises(
        ValueError, match=r"'layers.\[0\].w' names a layer of the resident"
    ):
        _workarounds.checked_input_path("layers.[0].w", info(resident_inputs(api, rng)))


def test_installed_check_leaves_other_schemas_to_upstream():
    """A schema without check_gradient_path gets tesseract-core's check only."""
    inputs = SimpleNamespace(a=np.ones(3))
    assert _workarounds.checked_input_path("a", info(inputs)) == "a"


# --- 3: endpoints off the event loop


def _app_routes(app):
    from fastapi.routing import APIRoute

    return {r.path: r for r in app.router.routes if isinstance(r, APIRoute)}


def test_upstream_handler_runs_endpoints_inside_start_run(api):
    """tesseract-core's handler is a coroutine wrapping the endpoint function
    (which ``endpoints_off_event_loop`` calls through ``__wrapped__``), and
    its source runs it under ``start_run``, whose stdio redirection holds a
    process-wide lock."""
    import inspect

    from tesseract_core.runtime import mpa
    from tesseract_core.runtime.serve import create_rest_api

    routes = _app_routes(create_rest_api(api))
    upstream = routes["/apply"].endpoint
    assert inspect.iscoroutinefunction(upstream)
    assert upstream.__wrapped__.__name__ == "apply"
    assert "start_run" in inspect.getsource(create_rest_api)
    assert "_STDIO_REDIRECT_LOCK" in inspect.getsource(mpa.redirect_stdio)


async def _post(app, path, payload, query=b"", content_type=b"application/json",
                scope_extra=None):  # fmt: skip
    """(status, JSON body) of one POST through an ASGI app; ``scope_extra``:
    keys added to its scope."""
    import json

    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": "POST", "path": path, "raw_path": path.encode(),
        "query_string": query, "root_path": "", "scheme": "http",
        "headers": [(b"content-type", content_type),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        **(scope_extra or {}),
    }  # fmt: skip
    sent, messages = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    status = sent[0]["status"]
    return status, json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def _request_body(inputs):
    from support.server import b64

    def encode(tree):
        if isinstance(tree, dict):
            return {k: encode(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [encode(v) for v in tree]
        return b64(tree) if isinstance(tree, np.ndarray) else tree

    return {"inputs": encode(inputs)}


def test_endpoints_off_event_loop_answer_like_upstream(api, rng):
    """The replaced routes answer exactly as tesseract-core's (a 422 too),
    and two requests are inside endpoints at once (upstream: one)."""
    import asyncio
    import threading

    from tesseract_core.runtime.serve import create_rest_api

    stock, ours = create_rest_api(api), create_rest_api(api)
    assert _workarounds.endpoints_off_event_loop(ours, threads=4)
    assert set(_app_routes(stock)) == set(_app_routes(ours))
    inputs = net.three_layer(rng)
    body = _request_body(inputs)
    bad = _request_body({**inputs, "x": inputs["x"][:, :2]})

    async def compare():
        want, got = (
            await _post(stock, "/apply", body),
            await _post(ours, "/apply", body),
        )
        assert got[0] == want[0] == 200 and got[1] == want[1]
        assert (await _post(ours, "/apply", bad))[0] == 422

    asyncio.run(compare())
    inside = threading.Barrier(2, timeout=30)  # broken if the calls serialize
    original = api.apply

    def apply_meeting(inputs):
        inside.wait()
        return original(inputs)

    api.apply = apply_meeting
    try:
        app = create_rest_api(api)
        _workarounds.endpoints_off_event_loop(app, threads=4)

        async def both():
            return await asyncio.gather(*(_post(app, "/apply", body) for _ in "ab"))

        answers = asyncio.run(both())
    finally:
        api.apply = original
    assert [status for status, _ in answers] == [200, 200]


def test_well_formed_requests_skip_fastapi_and_answer_like_upstream(api, rng):
    """``ComputeRoutes`` answers a well-formed request itself, exactly as
    tesseract-core would; anything else reaches FastAPI (and its answer)."""
    import asyncio

    from tesseract_core.runtime.serve import create_rest_api

    stock, ours = create_rest_api(api), create_rest_api(api)
    served = _workarounds.endpoints_off_event_loop(ours, threads=4)
    reached = []
    fastapi = served.app

    async def spy(scope, receive, send):
        reached.append(scope["path"])
        return await fastapi(scope, receive, send)

    served.app = spy
    inputs = net.three_layer(rng)
    body = _request_body(inputs)
    g = rng.standard_normal((3, 2)).astype(np.float32)
    vjp = {
        **body,
        "vjp_inputs": ["x"],
        "vjp_outputs": ["y"],
        "cotangent_vector": {"y": b64(g)},
    }
    bad = _request_body({**inputs, "x": inputs["x"][:, :2]})

    async def compare():
        for path, payload in (("/apply", body), ("/vector_jacobian_product", vjp)):
            want = await _post(stock, path, payload)
            assert await _post(served, path, payload) == want
            assert want[0] == 200
        # valid to the schema, refused by the endpoint: the same 422
        wrong = {**vjp, "cotangent_vector": {"y": b64(g[:, :1])}}
        want = await _post(stock, "/vector_jacobian_product", wrong)
        assert await _post(served, "/vector_jacobian_product", wrong) == want
        assert want[0] == 422
        assert reached == []  # answered without FastAPI
        for args in (
            ("/apply", bad),  # invalid: FastAPI's 422
            ("/apply", b"{not json"),  # malformed
            ("/apply", body, b"run_id=abc"),  # a query string
            ("/apply", body, b"", b"text/plain"),  # not JSON as FastAPI reads it
        ):
            want = await _post(stock, *args)
            assert await _post(served, *args) == want
        assert reached == ["/apply"] * 4

    asyncio.run(compare())


def test_compute_routes_validate_the_guards_document_without_parsing(api, rng):
    """Where the guard parsed the body (``PARSED_BODY`` in the scope), the
    compute routes validate that document and never parse the bytes: bytes
    that are not JSON, handed down with the document of a valid request, get
    that request's answer."""
    import asyncio
    import json

    from tesseract_core.runtime.serve import create_rest_api

    from qarray.tesseract._guard import PARSED_BODY

    served = _workarounds.endpoints_off_event_loop(create_rest_api(api), threads=4)
    document = _request_body(net.three_layer(rng))

    async def compare():
        want = await _post(served, "/apply", document)
        got = await _post(
            served, "/apply", b"{not json", scope_extra={PARSED_BODY: document}
        )
        assert want[0] == 200 and got == want
        # None: the guard found no JSON document; FastAPI answers the bytes
        status, answer = await _post(
            served, "/apply", b"{not json", scope_extra={PARSED_BODY: None}
        )
        assert status == 422 and "json" in json.dumps(answer).lower()

    asyncio.run(compare())


# --- workaround 6: binref output files without fsspec


def _dump_two(folder):
    """Two arrays written as one response's binref outputs (one file, the
    second appended): their documents and the file's bytes."""
    from tesseract_core.runtime import array_encoding

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(5, dtype=np.int8)
    first, name = array_encoding.dump_binref_arraydict(a, folder, "run_x", "f")
    second, _ = array_encoding.dump_binref_arraydict(b, folder, "run_x", name)
    return first, second, (folder / "run_x" / "f.bin").read_bytes()


def _count_fsspec_opens(monkeypatch):
    import fsspec

    opened = []
    upstream = fsspec.open

    def counted(*args, **kwargs):
        opened.append(args[0])
        return upstream(*args, **kwargs)

    monkeypatch.setattr(fsspec, "open", counted)
    return opened


def test_upstream_binref_outputs_open_each_file_through_fsspec(tmp_path, monkeypatch):
    opened = _count_fsspec_opens(monkeypatch)
    first, second, data = _dump_two(tmp_path)
    assert len(opened) >= 4  # a size and a write per array
    assert first["data"]["buffer"] == "run_x/f.bin:0"
    assert second["data"]["buffer"] == "run_x/f.bin:24"
    assert data == np.arange(6, dtype=np.float32).tobytes() + bytes(range(5))


def test_local_binref_files_write_what_upstream_writes(tmp_path, monkeypatch):
    from tesseract_core.runtime import array_encoding

    expected = _dump_two(tmp_path / "upstream")
    monkeypatch.setattr(array_encoding, "get_filesize", array_encoding.get_filesize)
    monkeypatch.setattr(array_encoding, "write_to_path", array_encoding.write_to_path)
    _workarounds.install_local_binref_files()
    opened = _count_fsspec_opens(monkeypatch)
    assert _dump_two(tmp_path / "local") == expected
    assert opened == []


def test_local_binref_files_leave_urls_to_fsspec():
    import fsspec

    path = "memory://qarray-test/run/f.bin"
    assert _workarounds.local_filesize(path) == 0
    _workarounds.local_write(b"abc", path, append=True)
    _workarounds.local_write(b"de", path, append=True)
    assert _workarounds.local_filesize(path) == 5
    with fsspec.open(path, "rb") as f:
        assert f.read() == b"abcde"
    _workarounds.local_write(b"x", path)  # not appending: replaced
    assert _workarounds.local_filesize(path) == 1


class _RecordingTransport:
    """What uvicorn's HTTP protocol needs of a socket transport, keeping each
    write (a ``writelines`` is one write: asyncio sends it with one
    ``sendmsg``)."""

    def __init__(self):
        self.writes, self.closed = [], False
        self.closed_by_server = None  # closed before the client left

    def write(self, data):
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def writelines(self, list_of_data):
        self.write(b"".join(bytes(data) for data in list_of_data))

    def get_extra_info(self, name, default=None):
        addresses = {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 80)}
        return addresses.get(name, default)

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def get_write_buffer_size(self):
        return 0

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


async def _hello(scope, receive, send):
    import asyncio

    await receive()
    headers = [(b"content-length", b"5"), (b"content-type", b"text/plain")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if scope["path"] == "/streamed":  # the body a turn later
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await send({"type": "http.response.body", "body": b"hello"})


def _serve_one_request(protocol_class, request: bytes) -> _RecordingTransport:
    """``request`` through ``protocol_class`` over a recording transport,
    until its response is written."""
    import asyncio

    from uvicorn.config import Config
    from uvicorn.server import ServerState

    async def run():
        config = Config(app=_hello, lifespan="off", access_log=False)
        config.load()
        protocol = protocol_class(
            config=config, server_state=ServerState(), app_state={}
        )
        transport = _RecordingTransport()
        protocol.connection_made(transport)
        protocol.data_received(request)
        for _ in range(100):
            await asyncio.sleep(0)
            if any(w.endswith(b"hello") for w in transport.writes):
                break
        await asyncio.sleep(0)  # a turn past the body: nothing more comes
        transport.closed_by_server = transport.closed
        protocol.connection_lost(None)
        return transport

    return asyncio.run(run())


REQUEST = b"GET / HTTP/1.1\r\nHost: qarray\r\n\r\n"


def test_upstream_writes_a_responses_headers_and_body_apart():
    writes = [w for w in _serve_one_request(AutoHTTPProtocol, REQUEST).writes if w]
    assert len(writes) == 2, writes
    assert writes[0].startswith(b"HTTP/1.1 200") and writes[0].endswith(b"\r\n\r\n")
    assert writes[1] == b"hello"


def test_one_write_protocol_sends_a_response_in_one_write():
    upstream = _serve_one_request(AutoHTTPProtocol, REQUEST).writes
    ours = _serve_one_request(_workarounds.OneWriteHTTPProtocol, REQUEST)
    assert len(ours.writes) == 1, ours.writes
    assert _without_date(ours.writes[0]) == _without_date(b"".join(upstream))
    assert not ours.closed_by_server  # kept alive


def test_one_write_protocol_sends_before_it_closes():
    closing = REQUEST.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    ours = _serve_one_request(_workarounds.OneWriteHTTPProtocol, closing)
    assert ours.closed_by_server
    assert len(ours.writes) == 1 and ours.writes[0].endswith(b"hello"), ours.writes
    assert b"connection: close" in ours.writes[0].lower()


def test_one_write_protocol_sends_headers_alone_when_the_body_comes_later():
    streamed = REQUEST.replace(b"GET / ", b"GET /streamed ")
    ours = _serve_one_request(_workarounds.OneWriteHTTPProtocol, streamed)
    assert len(ours.writes) == 2, ours.writes
    assert ours.writes[0].endswith(b"\r\n\r\n") and ours.writes[1] == b"hello"


def _without_date(response: bytes) -> bytes:
    """The response without its ``date`` header (seconds apart)."""
    lines = response.split(b"\r\n")
    return b"\r\n".join(line for line in lines if not line.lower().startswith(b"date:"))
