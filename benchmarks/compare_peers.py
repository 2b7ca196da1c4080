"""Ours next to torchao at the same shapes, same data, same threads
(`make bench-peers`, after bench_peers.py wrote the peers' times).

    .venv/bin/python -m benchmarks.compare_peers benchmarks/peers.json

Ours: ``qarray.linear_q`` (weights (N, K), like nn.Linear's) under jax.jit,
weight-only and W8A8, hot and cold exactly as bench_peers.py times torchao (a
buffer of twice the last-level cache read between calls, untimed). Prints the
table and writes benchmarks/peers_results.json (docs/performance.md shows it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import qarray as qa
from benchmarks.peer_shapes import SHAPES, flush_buffer, inputs
from qarray import _ffi, _formulations

HERE = Path(__file__).resolve().parent
OURS = {"weight-only": "float32", "W8A8": "int8"}
PEER = {
    "weight-only": "torchao int8 weight-only",
    "W8A8": "torchao int8 dynamic activations (W8A8)",
}


def timed(fn, reps: int, flush=None) -> float:
    for _ in range(3):
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        if flush is not None:
            flush()
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ours_rows(reps: int) -> list[dict]:
    buffer = jnp.asarray(flush_buffer())
    total = jax.jit(jnp.sum)

    def flush():
        jax.block_until_ready(total(buffer))

    product = jax.jit(
        lambda x, q, s, a: qa.linear_q(x, qa.pack(q, s), a), static_argnums=3
    )
    rows = []
    for m, k, n in SHAPES:
        x_np, w_np = inputs(m, k, n)
        x = jnp.asarray(x_np)
        q, s = jax.block_until_ready(qa.unpack(qa.quantize(jnp.asarray(w_np))))
        for label, activations in OURS.items():
            fn = lambda a=activations, x=x, q=q, s=s: product(x, q, s, a)  # noqa: E731
            rows.append(
                {
                    "ours": label,
                    "strategy": _formulations.choose_strategy(
                        m, k, n, activations, "cpu", "nk"
                    ),
                    "shape": [m, k, n],
                    "hot_us": 1e6 * timed(fn, reps),
                    "cold_us": 1e6 * timed(fn, reps, flush),
                }
            )
    return rows


def table(ours: list[dict], peers: list[dict]) -> str:
    lines = [
        "| shape (M, K, N) | ours | us hot / cold | torchao | us hot / cold "
        "| torchao / ours, hot / cold |",
        "|---|---|---|---|---|---|",
    ]
    for row in ours:
        for peer in peers:
            if peer["shape"] != row["shape"] or not peer["peer"].startswith(
                PEER[row["ours"]]
            ):
                continue
            lines.append(
                f"| {tuple(row['shape'])} | {row['ours']} ({row['strategy']}) | "
                f"{row['hot_us']:.0f} / {row['cold_us']:.0f} | {peer['peer']} | "
                f"{peer['hot_us']:.0f} / {peer['cold_us']:.0f} | "
                f"{peer['hot_us'] / row['hot_us']:.2f} / "
                f"{peer['cold_us'] / row['cold_us']:.2f} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peers", nargs="?", default=str(HERE / "peers.json"))
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--out", default=str(HERE / "peers_results.json"))
    args = parser.parse_args()
    peers = json.loads(Path(args.peers).read_text())
    ours = ours_rows(args.reps)
    text = table(ours, peers["rows"])
    report = {
        "kernels": _ffi.status(),
        "torch": peers["torch"],
        "torchao": peers["torchao"],
        "threads": peers["threads"],
        "ours": ours,
        "peers": peers["rows"],
        "table": text,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(text)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
