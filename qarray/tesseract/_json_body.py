"""A request body's JSON document, read faster than ``json.loads`` reads it
and equal to what it reads (what FastAPI and tesseract-core's stock server
parse with), so every later check sees the same document.

- A body under ``ORJSON_MAX_BYTES`` is read by orjson, which is faster on
  small bodies and on arrays written as JSON numbers.
- A larger body is mostly base64 arrays (a QAT step's weights: megabytes of
  strings, which ``json.loads`` scans a character at a time). Its long
  ``"buffer"`` strings are cut out first: each is checked to be base64
  (pybase64, vectorised), which makes it a JSON string with nothing to
  unescape; ``json.loads`` reads the rest, a short skeleton with a token in
  each one's place; then each token is replaced by its string, decoded as
  ASCII (``python -m benchmarks.parse_bodies``).

Whatever either shortcut cannot take as ``json.loads`` would (orjson: NaN
and Infinity, 1e400, UTF-16 and UTF-32, unpaired surrogates, nesting past
1024; the skeleton: a buffer that is not base64, a token that does not come
back as a whole string value) is read by ``json.loads`` itself. The one
difference left: an integer literal beyond 64 bits reads as the nearest float
under orjson, which no payload field takes as valid either way (a shape is
bounded by the work limit, integer arrays are 8 to 64 bits).
"""

from __future__ import annotations

import binascii
import json

import orjson
import pybase64

# bodies from this size are read by json.loads, their long buffers cut out
ORJSON_MAX_BYTES = 1 << 20
# buffers from this size are cut out of a large body (shorter ones cost
# json.loads little)
CUT_MIN_BYTES = 1 << 16

_BUFFER_KEY = b'"buffer"'
_JSON_SPACE = b" \t\n\r"
# what stands in the skeleton for the i-th buffer: '@' starts no JSON value,
# so a token the scan placed outside a string makes the skeleton invalid
_TOKEN = "@qarray-cut-buffer-"
_TOKEN_BYTES = _TOKEN.encode()


def parse_body(body: bytes):
    """``body``'s JSON document as ``json.loads`` reads it, or None where it
    is not one (the application answers that). See the module doc."""
    if not body:
        return None
    if len(body) < ORJSON_MAX_BYTES:
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    else:
        try:
            tree = _parse_cut(body)
        except (ValueError, RecursionError):
            tree = None
        if tree is not None:
            return tree
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _parse_cut(body: bytes):
    """``json.loads(body)`` with its long base64 buffers cut out first, or
    None where that does not apply (none to cut, or the skeleton reads
    otherwise than the body would: then the caller reads the whole body).

    Why the result equals ``json.loads(body)``: a cut string holds only
    base64 characters, so where its opening quote opens a string the
    skeleton lexes as the body does, and the token comes back as that string
    value; where the scan misread the body (a ``"buffer"`` inside another
    string, a duplicate key), the token is part of another string, or
    outside any (invalid: ``@``), or dropped, and the count of tokens that
    came back whole tells.
    """
    # a UTF-8 body (json.loads detects UTF-16 and UTF-32 by zero bytes)
    if body[:1] != b"{" or b"\0" in body[:4]:
        return None
    view = memoryview(body)
    pieces, spans, start = [], [], 0
    at = body.find(_BUFFER_KEY)
    while at >= 0:
        quote = _after_colon(body, at + len(_BUFFER_KEY))
        end = body.find(b'"', quote + 1) if quote >= 0 else -1
        if end < 0:
            at = body.find(_BUFFER_KEY, at + 1)
            continue
        if end - quote - 1 >= CUT_MIN_BYTES and _is_base64(view[quote + 1 : end]):
            pieces += [view[start : quote + 1], _TOKEN_BYTES + b"%d" % len(spans)]
            spans.append((quote + 1, end))
            start = end
        at = body.find(_BUFFER_KEY, end + 1)
    if not spans:
        return None
    pieces.append(view[start:])
    skeleton = b"".join(pieces)
    # no string of the body may read as a token: none holds a token's text
    # (the cut strings are base64, so this short skeleton holds the rest),
    # and no \u escape could spell one
    if skeleton.count(_TOKEN_BYTES) != len(spans) or b"\\u" in skeleton:
        return None
    tree = json.loads(skeleton)
    if _put_back(tree, view, spans) != len(spans):
        return None
    return tree


def _after_colon(body: bytes, i: int) -> int:
    """The index of the quote opening the value after ``: `` from ``i``
    (JSON whitespace around the colon), or -1."""
    while body[i : i + 1] and body[i : i + 1] in _JSON_SPACE:
        i += 1
    if body[i : i + 1] != b":":
        return -1
    i += 1
    while body[i : i + 1] and body[i : i + 1] in _JSON_SPACE:
        i += 1
    return i if body[i : i + 1] == b'"' else -1


def _is_base64(data: memoryview) -> bool:
    """Only base64 characters, padded right (no quote, backslash, control
    or non-ASCII character: a JSON string as it is written). The bytes are
    dropped: tesseract-core's validation decodes the string itself, so the
    document stays ``json.loads``' (a second decode, which
    ``python -m benchmarks.parse_bodies`` counts in the figures)."""
    try:
        pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _put_back(tree, view: memoryview, spans: list[tuple[int, int]]) -> int:
    """Each token string value in ``tree`` replaced by the string it stands
    for; returns how many distinct tokens were (-1 on a repeat)."""
    found = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(value, dict | list):
                stack.append(value)
            elif isinstance(value, str) and value.startswith(_TOKEN):
                index = value[len(_TOKEN) :]
                if not index.isdecimal() or int(index) >= len(spans):
                    return -1
                if (index := int(index)) in found:
                    return -1
                found.add(index)
                start, end = spans[index]
                node[key] = str(view[start:end], "ascii")
    return len(found)
