"""Where the kernels' GEMM overtakes their dot tiles (a rule's ``gemm_rows``,
``qarray/_rules.py``),
row count by row count, with the weights cold or hot.

    .venv/bin/python -m benchmarks.gemm_crossover [--activations float32|int8]
        [--size 4096] [--copies 16] [--rows 1,2,3,4,6,8]

Times ``linear_q``'s kernel (layout nk) on x f32[m, size] against ``copies``
int8 weights (size, size) taken in turn: 16 copies of 4096 x 4096 (256 MiB)
stream from memory as a many-layer model's do, one copy stays in cache. Each
row count runs with the GEMM forced (``gemm_rows`` 1) and with the dot tiles
forced (``gemm_rows`` past any row count), each through
``_rules.overriding``, alternating for ``--rounds``; a side's figure is its
best round's median. Weight-only rows are ``split_levels`` int8 rows each,
which is what the threshold counts.
docs/kernels.md keeps the figures; not a `make bench` suite (a threshold
is decided once per CPU family, not tracked run to run).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

FORCED = {"gemm": 1, "tiles": 1 << 20}


def _median_ms(fn, calls: list[tuple], reps: int) -> float:
    import jax

    for args in calls[:2]:
        jax.block_until_ready(fn(*args))
    times = []
    for i in range(reps):
        args = calls[i % len(calls)]
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def crossover(activations: str, size: int, copies: int, rows, rounds=2, reps=40):
    """[(m, gemm ms, tiles ms)] for x f32[m, size] @ W^T, W int8 (size, size)."""
    import jax
    import jax.numpy as jnp

    import qarray as qa
    from qarray import _ffi, _formulations, _rules

    if not _ffi.available():
        raise SystemExit(f"qarray's CPU kernels do not run here: {_ffi.status()}")
    rng = np.random.default_rng(0)
    weights = [
        qa.unpack(qa.quantize(jnp.asarray(rng.standard_normal((size, size)))))
        for _ in range(copies)
    ]
    results = []
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, size)), jnp.float32)
        calls = [(x, q, s) for q, s in weights]
        best = dict.fromkeys(FORCED, float("inf"))
        for _ in range(rounds):
            for side, gemm_rows in FORCED.items():
                # read when the call is traced: a fresh jit per side
                with _rules.overriding(gemm_rows=gemm_rows):
                    fn = jax.jit(
                        lambda x, q, s: _formulations.linear(
                            x, q, s, activations, "kernel"
                        )
                    )
                    best[side] = min(best[side], _median_ms(fn, calls, reps))
        results.append((m, best["gemm"], best["tiles"]))
    return results


def main() -> None:
    from qarray import _ffi

    parser = argparse.ArgumentParser(prog="benchmarks.gemm_crossover")
    parser.add_argument("--activations", choices=("float32", "int8"), default="int8")
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--rows", default="4,6,8,10,12,16")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    rule = _ffi.rule()
    parts = rule.int8_rows(1, args.activations)
    print(
        f"{_ffi.status()}; {args.activations}, ({args.size}, {args.size}) x "
        f"{args.copies}; rule {rule.name!r}: gemm_rows {rule.gemm_rows} int8 rows"
    )
    print("| rows of x (int8 rows) | GEMM ms | dot tiles ms | tiles / GEMM | runs |")
    print("|---|---|---|---|---|")
    for m, gemm, tiles in crossover(
        args.activations, args.size, args.copies, rows, args.rounds
    ):
        runs = "GEMM" if m * parts >= rule.gemm_rows else "dot tiles"
        print(
            f"| {m} ({m * parts}) | {gemm:.3f} | {tiles:.3f} | {tiles / gemm:.2f} "
            f"| {runs} |"
        )


if __name__ == "__main__":
    main()
