"""qarray-serve's request guard: no file or network access on a client's say-so,
bounded request bodies, safe run ids."""

import json
import socket
import time

import numpy as np
import pytest
import requests

from qarray.tesseract.internal import binref_problem
from support import reference as ref
from support.server import b64, decode, serve

X = np.arange(6, dtype=np.float32).reshape(2, 3)
W = np.arange(12, dtype=np.float32).reshape(3, 4) / 12
QV, SCALE = ref.quantize(W)


def inputs(x=None, **layer):
    """x (2, 3) through one layer {"w": W (3, 4)}; ``layer`` changes its fields
    (None removes one)."""
    fields = {k: v for k, v in {"w": b64(W), **layer}.items() if v is not None}
    return {"x": b64(X) if x is None else x, "layers": [fields]}


def binref(buffer, shape=(2, 3), dtype="float32"):
    return {
        "object_type": "array",
        "shape": list(shape),
        "dtype": dtype,
        "data": {"buffer": buffer, "encoding": "binref"},
    }


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    inputs = tmp / "inputs"
    inputs.mkdir()
    (inputs / "x.bin").write_bytes(X.tobytes())
    (inputs / "layers").mkdir()
    (inputs / "layers" / "w.bin").write_bytes(W.tobytes())
    secret = tmp / "secret.bin"
    secret.write_bytes(np.full(6, 4321.5, np.float32).tobytes())
    (inputs / "link.bin").symlink_to(secret)
    env = {"TESSERACT_INPUT_PATH": str(inputs), "QARRAY_MAX_REQUEST_BYTES": "200000"}
    with serve(tmp, env=env) as url:
        yield url, tmp, secret


HOSTILE = [
    ("absolute", "{secret}:0"),
    ("absolute-no-offset", "/etc/passwd"),
    ("dotdot", "../secret.bin:0"),
    ("dotdot-inside", "sub/../../secret.bin"),
    ("url", "http://127.0.0.1:9/x.bin:0"),
    ("fsspec-memory", "memory://x.bin"),
    ("fsspec-chained", "simplecache::http://127.0.0.1:9/x"),
    ("file-scheme", "file:///etc/passwd"),
    ("home", "~/x.bin"),
    ("symlink-out", "link.bin:0"),
    ("empty", ""),
]


@pytest.mark.parametrize(("name", "buffer"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_binref_is_refused_before_reading(guarded, name, buffer):
    url, _, secret = guarded
    buffer = buffer.format(secret=secret)
    payload = {"inputs": inputs(x=binref(buffer))}
    response = requests.post(f"{url}/apply", json=payload, timeout=30)
    assert response.status_code == 422, response.text
    assert "x: binref buffer" in response.text or "x: a binref buffer" in response.text
    # nothing of the secret came back
    assert "4321" not in response.text
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("spelling", ["escaped", "utf-16"])
def test_binref_spelled_otherwise_is_refused(guarded, spelling):
    """The guard's fast path looks for the bytes "binref"; JSON escapes
    ("bin\\u0072ef") and UTF-16 bodies (json.loads takes both) spell the
    same string without them, and are parsed and checked too."""
    url, _, secret = guarded
    payload = {"inputs": inputs(x=binref(f"{secret}:0"))}
    text = json.dumps(payload)
    if spelling == "escaped":
        text = text.replace('"binref"', '"bin\\u0072ef"')
        data = text.encode()
    else:
        data = text.encode("utf-16")
    assert b"binref" not in data
    response = requests.post(
        f"{url}/apply",
        data=data,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 422, response.text
    assert "x: binref buffer" in response.text
    assert "4321" not in response.text


# where a layer's arrays sit in a request: the guard walks the whole body
NESTED = {
    "w": lambda array: inputs(w=array),
    "bias": lambda array: inputs(bias=array),
    "w_q.qvalue": lambda array: inputs(
        w=None, w_q={"qvalue": array, "scale": b64(SCALE)}
    ),
    "w_q.scale": lambda array: inputs(w=None, w_q={"qvalue": b64(QV), "scale": array}),
}


@pytest.mark.parametrize("field", NESTED)
def test_hostile_binref_in_a_layer_is_refused(guarded, field):
    url, _, secret = guarded
    payload = {"inputs": NESTED[field](binref(f"{secret}:0", shape=(3, 4)))}
    response = requests.post(f"{url}/apply", json=payload, timeout=30)
    assert response.status_code == 422, response.text
    # the field by its path, in the contract's notation
    assert f"layers.[0].{field}: binref buffer" in response.text, response.text
    assert "4321" not in response.text
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_binref_inside_the_input_folder_works(guarded):
    url, _, _ = guarded
    payload = {
        "inputs": inputs(x=binref("x.bin:0"), w=binref("layers/w.bin:0", shape=(3, 4)))
    }
    response = requests.post(f"{url}/apply", json=payload, timeout=30)
    assert response.status_code == 200, response.text
    y = decode(response.json())["y"]
    np.testing.assert_allclose(y, X @ ref.roundtrip(W), rtol=1e-5, atol=1e-6)


def test_binref_in_a_cotangent_is_checked_too(guarded):
    url, _, secret = guarded
    payload = {
        "inputs": inputs(),
        "vjp_inputs": ["x"],
        "vjp_outputs": ["y"],
        "cotangent_vector": {"y": binref(f"{secret}:0", shape=(2, 4))},
    }
    response = requests.post(f"{url}/vector_jacobian_product", json=payload, timeout=30)
    assert response.status_code == 422
    assert "cotangent_vector.y: binref buffer" in response.text


def test_binref_declaring_a_huge_shape_is_refused(guarded):
    url, _, _ = guarded
    payload = {"inputs": inputs(x=binref("x.bin:0", shape=(100000, 100000)))}
    response = requests.post(f"{url}/apply", json=payload, timeout=30)
    assert response.status_code == 413
    assert "x: declared shape (100000, 100000)" in response.text
    assert "QARRAY_MAX_ELEMENTS" in response.text
    # in a layer too
    payload = {"inputs": inputs(w=binref("layers/w.bin:0", shape=(3, 10**8)))}
    response = requests.post(f"{url}/apply", json=payload, timeout=30)
    assert response.status_code == 413
    assert "declared shape (3, 100000000)" in response.text


def test_body_over_the_limit_is_refused_by_its_length(guarded):
    url, _, _ = guarded
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        # declare 10 MB, send nothing: the answer must not wait for the body
        sock.sendall(
            b"POST /apply HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10000000\r\n\r\n"
        )
        start = time.monotonic()
        reply = b""
        while chunk := sock.recv(4096):  # the guard closes the connection
            reply += chunk
        reply = reply.decode()
        assert time.monotonic() - start < 5
    assert reply.startswith("HTTP/1.1 413"), reply
    assert "QARRAY_MAX_REQUEST_BYTES" in reply


def test_streamed_body_over_the_limit_is_refused(guarded):
    url, _, _ = guarded

    def chunks():
        for _ in range(100):
            yield b" " * 10000  # 1 MB in all, no Content-Length

    response = requests.post(
        f"{url}/apply",
        data=chunks(),
        timeout=30,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 413
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("run_id", ["../../escape", "a/b", "x" * 200, "%2e%2e"])
def test_run_id_must_be_a_plain_name(guarded, run_id):
    url, tmp, _ = guarded
    response = requests.post(
        f"{url}/apply", params={"run_id": run_id}, json={"inputs": inputs()}, timeout=30
    )
    assert response.status_code == 400
    assert not (tmp / "escape").exists()


def test_binref_problem_unit():
    from pathlib import Path

    root = Path("/tmp")
    assert binref_problem("data/x.bin:16", root) is None
    assert binref_problem("x.bin:0:12", root) is None
    for bad in ("/x", "../x", "a/../../x", "s3://b/x", "c:\\x", "a//b", ".hidden"):
        assert binref_problem(bad, root) is not None, bad


def test_validation_errors_do_not_echo_large_inputs(guarded):
    url, _, _ = guarded
    x = np.ones((100, 300), np.float32)  # ~160 kB of base64, under the body limit
    payload = {"inputs": {"x": b64(x), "layers": [{}]}}  # neither w nor w_q
    response = requests.post(f"{url}/apply", json=payload, timeout=30)
    assert response.status_code == 422
    assert "layers.[0] must give exactly one of w and w_q, got neither" in (
        response.text
    )
    assert len(response.content) < 2000
    # a field error (FastAPI's 422 would echo the whole value back): ~60 kB of
    # JSON lists with one string in them
    w = np.ones((300, 40)).tolist()
    w[-1][-1] = "a"
    payload = {"inputs": {"x": b64(x[:2]), "layers": [{"w": w}]}}
    response = requests.post(f"{url}/apply", json=payload, timeout=30)
    assert response.status_code == 422
    assert '"loc":["body","inputs","layers",0,"w"]' in response.text
    assert len(response.content) < 2000


def test_the_guard_parses_a_body_once_and_hands_the_document_down(tmp_path):
    """The application gets the body's bytes as sent and, in the scope, the
    document ``json.loads`` reads from them (None for a body that is not
    JSON): the compute routes validate it without parsing again."""
    import asyncio

    from qarray.tesseract._guard import PARSED_BODY, RequestGuard
    from qarray.tesseract._settings import Settings

    seen = []

    async def app(scope, receive, send):
        message = await receive()
        seen.append((scope.get(PARSED_BODY, "absent"), message["body"]))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = RequestGuard(app, Settings.from_env({}), input_dir=tmp_path)

    async def post(body: bytes):
        scope = {"type": "http", "method": "POST", "path": "/apply",
                 "query_string": b"", "headers": [
                     (b"content-length", str(len(body)).encode())]}  # fmt: skip
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            pass

        await guard(scope, receive, send)

    document = {"inputs": inputs()}
    body = json.dumps(document).encode()
    for sent in (body, b"{not json", b""):
        asyncio.run(post(sent))
    assert seen == [(document, body), (None, b"{not json"), (None, b"")]


@pytest.mark.parametrize("where", ["shape", "data"])
def test_an_integer_beyond_64_bits_is_a_4xx_naming_its_field(guarded, where):
    """The one number orjson reads differently from ``json.loads`` (an
    integer past 64 bits, read as a float): still refused, naming x."""
    url, _, _ = guarded
    big = 2**70
    x = {"object_type": "array", "shape": [2, 3], "dtype": "float32",
         "data": {"buffer": X.tolist(), "encoding": "json"}}  # fmt: skip
    if where == "shape":
        x["shape"] = [big, 3]
    else:
        x["dtype"] = "int64"
        x["data"]["buffer"] = [[1, 2, 3], [4, 5, big]]
    payload = {"inputs": {**inputs(), "x": x}}
    body = json.dumps(payload)
    assert str(big) in body
    response = requests.post(
        f"{url}/apply", data=body, headers={"content-type": "application/json"},
        timeout=30,
    )  # fmt: skip
    assert 400 <= response.status_code < 500, response.text
    assert '"loc":["body","inputs","x"]' in response.text
    assert len(response.content) < 4000
    assert requests.get(f"{url}/health", timeout=30).status_code == 200
