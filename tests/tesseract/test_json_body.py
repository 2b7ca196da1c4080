"""A request body's JSON document (``_json_body.parse_body``): equal to what
``json.loads`` reads, on both sides of ``ORJSON_MAX_BYTES``, with a large
body's base64 buffers cut out and put back."""

import base64
import json
import random

import numpy as np
import pytest

from qarray.tesseract import _json_body
from qarray.tesseract._json_body import ORJSON_MAX_BYTES, parse_body

LONG = base64.b64encode(np.arange(1 << 18, dtype=np.float32).tobytes())


def _array(buffer: bytes, shape) -> bytes:
    return (
        b'{"object_type": "array", "shape": ' + json.dumps(shape).encode()
        + b', "dtype": "float32", "data": {"buffer": "' + buffer
        + b'", "encoding": "base64"}}'
    )  # fmt: skip


def _qat_body() -> bytes:
    """What tesseract-jax sends in a QAT step: x and three layers' weights."""
    layers = b", ".join(
        b'{"w": ' + _array(LONG, [512, 512]) + b', "bias": '
        + _array(base64.b64encode(bytes(2048)), [512])
        + b', "layout": "kn", "activation": "relu"}'
        for _ in range(3)
    )  # fmt: skip
    return (
        b'{"inputs": {"x": '
        + _array(LONG, [512, 512])
        + b', "layers": ['
        + layers
        + b"]}}"
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": [1, -2.5, 1e-300, 18446744073709551615, "\\u00e9"], "a": {}}',
        b'{"x": NaN, "y": -Infinity}',  # json.loads' extensions
        b'{"big": 1e400}',  # inf for json.loads, an error for orjson
        '{"utf16": 1}'.encode("utf-16"),
        b'"\\ud800"',  # an unpaired surrogate
        b"[" * 1100 + b"]" * 1100,  # past orjson's nesting limit
        b'{"x": {"data": {"buffer": "' + b"QUJD" * (1 << 18) + b'"}}, "n": NaN}',
    ],
    ids=["plain", "nan", "1e400", "utf16", "surrogate", "nesting", "over-1-MiB"],
)
def test_the_guard_reads_a_body_as_json_loads_does(body):
    """``parse_body`` gives the document ``json.loads`` gives (what FastAPI
    reads), including for what only ``json.loads`` takes, on both sides of
    ``ORJSON_MAX_BYTES``."""
    assert (len(body) >= ORJSON_MAX_BYTES) == (len(body) > 1_000_000)
    expected = json.loads(body)
    assert repr(parse_body(body)) == repr(expected)


def test_a_body_that_is_not_json_parses_to_none():
    for body in (b"{not json", b"", b"\xff\xfe\x00", b"[" * 100_000):
        assert parse_body(body) is None


def test_a_qat_steps_body_has_its_buffers_cut_out_and_put_back():
    """The shortcut is taken for what a training loop sends (else its speed
    is silently gone), and gives json.loads' document."""
    body = _qat_body()
    assert len(body) >= ORJSON_MAX_BYTES
    cut = _json_body._parse_cut(body)
    assert cut is not None
    assert cut == json.loads(body)
    assert cut["inputs"]["layers"][2]["w"]["data"]["buffer"] == LONG.decode()


@pytest.mark.parametrize(
    "body",
    [
        # json.loads keeps the last of two equal keys: the first token is lost
        b'{"data": {"buffer": "' + LONG + b'", "buffer": "' + LONG[4:] + b'"}}',
        # not base64: an escape, a character outside the alphabet
        b'{"data": {"buffer": "' + LONG[:-8] + b'\\/\\/"}}',
        b'{"data": {"buffer": "' + LONG[:-8] + b'!!!!"}}',
        # the token's own text in the body
        b'{"data": {"buffer": "' + LONG + b'"}, "note": "@qarray-cut-buffer-0"}',
        # a token spelled with escapes, where the cut buffer's token is lost
        b'{"data": {"buffer": "'
        + LONG
        + b'", "buffer": "\\u0040qarray-cut-buffer-0"}}',
        # a UTF-8 byte order mark (json.loads reads past it)
        b'\xef\xbb\xbf{"data": {"buffer": "' + LONG + b'"}}',
    ],
    ids=[
        "duplicate-key",
        "escapes",
        "not-base64",
        "token-in-body",
        "escaped-token",
        "bom",
    ],
)
def test_what_the_shortcut_cannot_take_is_read_by_json_loads(body):
    assert _json_body._parse_cut(body) is None
    try:
        expected = json.loads(body)
    except ValueError:
        expected = None
    assert parse_body(body) == expected


def test_an_invalid_body_with_long_buffers_parses_to_none():
    body = b'{"data": {"buffer": "' + LONG + b'"}, oops}'
    assert parse_body(body) is None


def _random_document(rng: random.Random, depth: int = 0):
    """A JSON value with "buffer" keys holding base64, short strings with
    escapes and quotes, numbers, nesting."""
    kind = rng.randrange(6 if depth < 4 else 3)
    if kind == 0:
        return rng.choice([0, -1.5, 1e-9, True, None, 2**40])
    if kind == 1:
        return rng.choice(["", 'a"b', "\\", "buffer", '"buffer": "', "é\n", "QUJD"])
    if kind == 2:
        return base64.b64encode(rng.randbytes(rng.randrange(3, 40))).decode()
    if kind == 3:
        return [_random_document(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["buffer", "data", 'buf"fer', "x", "buffer"]
    return {
        rng.choice(keys): (
            base64.b64encode(rng.randbytes(rng.randrange(6, 60))).decode()
            if rng.random() < 0.5
            else _random_document(rng, depth + 1)
        )
        for _ in range(rng.randrange(1, 5))
    }


def test_random_documents_read_as_json_loads_reads_them(monkeypatch):
    """With every body "large" and every buffer "long", random documents
    written with random spacing read the same both ways (the shortcut taken
    wherever it applies)."""
    monkeypatch.setattr(_json_body, "ORJSON_MAX_BYTES", 0)
    monkeypatch.setattr(_json_body, "CUT_MIN_BYTES", 4)
    rng = random.Random(0)
    taken = 0
    for _ in range(400):
        document = {"inputs": _random_document(rng)}
        spacing = rng.choice([(", ", ": "), (",", ":"), (" ,\n", " :\t")])
        body = json.dumps(document, separators=spacing, ensure_ascii=rng.random() < 0.5)
        body = body.encode()
        taken += _json_body._parse_cut(body) is not None
        assert parse_body(body) == json.loads(body)
    assert taken > 50
