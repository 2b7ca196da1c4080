"""The request guard's JSON parse (``_json_body.parse_body``) against
``json.loads`` (what tesseract-core's stock server parses with) and orjson,
on the bodies clients send, under the server's malloc settings
(``keep_freed_memory``: without them each large string is fresh pages, and
the page faults, not the parsers, decide the figures).

    .venv/bin/python -m benchmarks.parse_bodies

Bodies: 12 MB of float32 as one base64 string (a QAT step's weights), a
one-row 4096-wide base64 body, 100,000 floats as JSON numbers. Each parser
runs in turn for five rounds; a parser's figure is its best round's mean.
docs/performance-notes.md keeps the figures; not a `make bench` suite.
"""

from __future__ import annotations

import base64
import json
import time

import numpy as np


def _array(shape, buffer, encoding: str) -> dict:
    data = {"buffer": buffer, "encoding": encoding}
    return {"object_type": "array", "shape": shape, "dtype": "float32", "data": data}


def bodies(rng) -> dict[str, bytes]:
    def b64(n):
        values = rng.standard_normal(n).astype(np.float32)
        return _array([n], base64.b64encode(values.tobytes()).decode(), "base64")

    floats = rng.standard_normal(100_000).astype(np.float32).tolist()
    documents = {
        "base64, 12 MB of float32": {"inputs": {"x": b64(3 * 2**20)}},
        "base64, one row of 4096": {"inputs": {"x": b64(4096)}},
        "JSON numbers, 100,000 floats": {
            "inputs": {"x": _array([100_000], floats, "json")}
        },
    }
    return {name: json.dumps(doc).encode() for name, doc in documents.items()}


def best_ms(parse, body: bytes, rounds: int, reps: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            parse(body)
        times.append((time.perf_counter() - start) / reps)
    return min(times) * 1e3


def main() -> None:
    import orjson

    from qarray.tesseract._json_body import parse_body
    from qarray.tesseract.internal import keep_freed_memory

    keep_freed_memory()
    parsers = {
        "json.loads": json.loads,
        "orjson": orjson.loads,
        "parse_body": parse_body,
    }
    print("| body | MB | " + " | ".join(f"{p} ms" for p in parsers) + " |")
    print("|---|---|" + "---|" * len(parsers))
    for name, body in bodies(np.random.default_rng(0)).items():
        reps = 30 if len(body) > 1e6 else 2000
        best = dict.fromkeys(parsers, float("inf"))
        for _ in range(5):  # interleaved rounds
            for label, parse in parsers.items():
                best[label] = min(best[label], best_ms(parse, body, 1, reps))
        figures = " | ".join(f"{best[p]:.3f}" for p in parsers)
        print(f"| {name} | {len(body) / 1e6:.2f} | {figures} |")


if __name__ == "__main__":
    main()
