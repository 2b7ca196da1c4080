"""qarray's Pallas kernels on the chip, each way and block size against
bf16's dense product, device time inside one program (issue "TPU kernels"):
the measurements behind ``qarray/_tpu``'s defaults and the TPU rule.

    python -m benchmarks.tpu_kernels [--k 8192 --n 8192] [--calls 50]
        [--repeats 3] [--budget 420]
        [--only int8,w8a8,vector,int4,int4_bytes,int4_pair,int4_stored,
                int4_tile_rows,int4_vjp,int4_xla_bf16,vjp,read]
        [--out FILE.json]

Each variant times ``--calls`` dependent products in one jitted
``fori_loop`` (``benchmarks.bench_tpu.device_ms``; a program's dispatch,
~0.5 ms on the lent host, is shared by its calls, so fewer calls narrow every
ratio toward 1), with bf16's ``x @ W.T``
timed in the same run as the baseline, and its relative error against
float32 ``x @ W.T`` at the highest precision (the weights' dequantized
values). A variant Mosaic refuses is recorded with its error, not fatal;
results are written after every variant, and no new variant starts after
``--budget`` seconds (the chip's calls are time-limited). ``read`` is no
product: a kernel that only reads the int8 weights through the same block
pipeline, the most any kernel on them could do at few rows.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from benchmarks.bench_tpu import device_ms, weights
from qarray import _tpu
from qarray._numerics import dequantize_groups

# Pallas' interpreter off the chip: a check that every variant runs
INTERPRET = jax.default_backend() != "tpu"
FEW = (1, 8, 64)
# where int4's bytes kernel hands over to its tile kernel (the TPU rule)
MIDDLE = (128, 256)
MANY = (512, 4096)


def _int8(x, w, **options):
    """linear_q's product on the int8 weights (N, K): layout nk."""
    return _tpu.int8_product(x, *w["q8"], nk=True, interpret=INTERPRET, **options)


def _vjp(x, w, **options):
    """x-bar = y-bar @ W: the int8 weights (N, K) read as layout kn."""
    return _tpu.int8_product(x, *w["q8"], nk=False, interpret=INTERPRET, **options)


def _group(w) -> int:
    """The int4 weights' group size (``bench_tpu.weights``': 128, or K)."""
    packed, scale = w["q4"]
    return 2 * packed.shape[1] // scale.shape[1]


def _int4(x, w, stored=False, **options):
    """linear_q's int4 G=128 product on qarray's bytes, or (``stored``) on
    the same weights held as jnp.int4 (no bitcast a call)."""
    packed, scale = w["q4"]
    return _tpu.int4_product(
        x,
        w["q4_int4"] if stored else packed,
        scale,
        group_size=_group(w),
        interpret=INTERPRET,
        **options,
    )


def _int8_vector(x, w, **options):
    """The vector unit's product (unscaled: the scales multiply after)."""
    return _tpu.int8_vector(x, w["q8"][0], interpret=INTERPRET, **options) * w["q8"][1]


def _read_only(x, w, *, blocks):
    """Reads every int8 weight once, (bn, bk) blocks at a time, computing
    nothing from them but one tile's sum: the pipeline's bound. The output
    depends on x, so the loop cannot hoist the kernel out."""
    weights = w["q8"][0]
    (n, k), (bn, bk) = weights.shape, blocks
    if n % bn or k % bk or bn % 32 or bk % 128:
        raise ValueError(f"read only: blocks {blocks} must tile {weights.shape}")

    def kernel(x_ref, w_ref, o_ref):
        @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
        def _():
            o_ref[...] = x_ref[...]

        o_ref[...] += w_ref[0:8, 0:128].astype(jnp.float32)

    corner = x[:8, :128]
    tile = jnp.zeros((8, 128), jnp.float32).at[: corner.shape[0], : corner.shape[1]]
    tile = tile.set(corner)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid=(n // bn, k // bk),
        in_specs=[
            pl.BlockSpec((8, 128), lambda j, kk: (0, 0)),
            pl.BlockSpec((bn, bk), lambda j, kk: (j, kk)),
        ],
        out_specs=pl.BlockSpec((8, 128), lambda j, kk: (0, 0)),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"),
            vmem_limit_bytes=4 * bn * bk + (16 << 20),
        ),
        interpret=INTERPRET,
    )(tile, weights)
    return jnp.full((x.shape[0], n), out[0, 0])


def _int4_xla_bf16(x, w):
    dense = dequantize_groups(*w["q4"]).astype(jnp.bfloat16)
    dense = lax.optimization_barrier(dense)
    return lax.dot_general(
        x.astype(jnp.bfloat16),
        dense,
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    )


def variants(k: int, n: int, only: set[str]):
    """(family, name, rows, fn(x, w)) for every variant tried."""
    # larger blocks first: fewer grid steps, each step's fixed cost a smaller
    # share of its weights' read
    few_blocks = [(1024, 4096), (2048, 4096), (4096, 2048), (2048, 8192)]
    few_blocks += [(512, 2048), (1024, 2048), (512, 4096), (2048, 1024)]
    many_blocks = [
        (512, 1024, 1024),
        (512, 512, 1024),
        (1024, 1024, 512),
        (256, 512, 2048),
        (512, 512, 2048),
    ]
    # x's parts: one bf16 pass (the default precision's), two int8 (int4's
    # bytes kernel at the default), three int8 ("high" and "highest")
    ways = [("bf16", 1), ("int8", 2), ("int8", 3)]
    out = []
    if "int8" in only:
        for (bn, bk), (mxu, parts) in itertools.product(few_blocks, ways):
            for orient in (
                ("rows", "columns") if bn in (512, 2048) and bk < 8192 else ("rows",)
            ):
                fn = functools.partial(
                    _int8, mxu=mxu, parts=parts, blocks=(512, bn, bk), orient=orient
                )
                out.append(("int8", f"{mxu}x{parts} {orient} bn{bn} bk{bk}", FEW, fn))
        for blocks, (mxu, parts) in itertools.product(many_blocks[:2], ways):
            fn = functools.partial(_int8, mxu=mxu, parts=parts, blocks=blocks)
            out.append(("int8", f"{mxu}x{parts} rows {blocks}", MANY, fn))
    if "w8a8" in only:
        for blocks in many_blocks:
            fn = functools.partial(_int8, mxu="int8", parts=1, blocks=blocks)
            out.append(("w8a8", f"int8x1 rows {blocks}", MANY, fn))
    if "int4" in only:
        int4_blocks = [(512, 1024), (1024, 1024), (512, 2048)]
        for bn, bk2 in int4_blocks:  # the shifts (int8 MXU: int4_bytes)
            fn = functools.partial(
                _int4, mode="groups", mxu="bf16", parts=1, blocks=(512, bn, bk2)
            )
            name = f"groups shifts bf16x1 bn{bn} bk2 {bk2}"
            out.append(("int4", name, FEW + MANY[:1], fn))
        for blocks in [(512, 512, 512), (512, 1024, 512), (256, 512, 1024)]:
            fn = functools.partial(_int4, mode="tile", parts=1, blocks=blocks)
            out.append(("int4", f"tile bf16x1 {blocks}", MANY, fn))
    if "int4_bytes" in only:  # qarray's bytes a word at a time, the int8 MXU
        for bn, bk2 in [(1024, 1024), (2048, 1024), (1024, 2048), (512, 2048)]:
            blocks = (512, bn, bk2)
            fn = functools.partial(_int4, mxu="int8", parts=2, blocks=blocks)
            out.append(("int4", f"bytes int8x2 {blocks}", FEW + MIDDLE + MANY[:1], fn))
        for blocks in [(2048, 1024, 1024), (1024, 2048, 1024), (4096, 512, 1024)]:
            fn = functools.partial(_int4, mxu="int8", parts=2, blocks=blocks)
            out.append(("int4", f"bytes int8x2 {blocks}", MANY, fn))
        fn = functools.partial(_int4, mxu="int8", parts=1, blocks=(512, 1024, 1024))
        out.append(("int4", "bytes int8x1 (W4A8)", FEW + MANY, fn))
    if "int4_pair" in only:  # x as int8_pair: its parts meet in int32
        for bn, bk2 in [(1024, 1024), (2048, 1024), (1024, 2048), (2048, 2048)]:
            blocks = (512, bn, bk2)
            fn = functools.partial(_int4, mxu="int8", parts=2, pair=True, blocks=blocks)
            out.append(("int4", f"bytes int8 pair {blocks}", FEW + MIDDLE, fn))
    if "vector" in only:  # one row on the vector unit (float32's sums)
        for blocks in [(256, 8192), (512, 4096), (1024, 4096), (1024, 2048)]:
            fn = functools.partial(_int8_vector, blocks=blocks)
            out.append(("int8", f"vector {blocks}", (1,), fn))
    if "int4_stored" in only:  # weights kept as jnp.int4 (no bitcast a call)
        for mxu, parts in ways[::-1]:
            fn = functools.partial(
                _int4,
                stored=True,
                mode="groups",
                mxu=mxu,
                parts=parts,
                blocks=(512, 1024, 1024),
            )
            out.append(
                ("int4", f"stored-int4 groups {mxu}x{parts}", FEW + MANY[:1], fn)
            )
    if "int4_tile_rows" in only:  # fewer row blocks: each weight unpacked once
        tile_blocks = [(1024, 1024, 512), (2048, 1024, 512), (1024, 2048, 512)]
        tile_blocks += [(2048, 512, 1024), (4096, 512, 512), (2048, 2048, 256)]
        for blocks in tile_blocks:
            fn = functools.partial(_int4, mode="tile", parts=1, blocks=blocks)
            out.append(("int4", f"tile bf16x1 {blocks}", MIDDLE + MANY, fn))
    if "int4_vjp" in only and k == n:  # y_bar (m, N) @ W: x's rows stand in
        for blocks in [(1024, 2048, 512), (1024, 1024, 1024), (512, 4096, 512)]:
            fn = functools.partial(_int4, mode="tile", parts=1, nk=False, blocks=blocks)
            out.append(("int4_vjp", f"tile kn bf16x1 {blocks}", FEW + MANY[:1], fn))
    if "int4_xla_bf16" in only:  # dequantized to bf16 in HBM once, bf16 dot
        out.append(("int4", "xla dequantized bf16", MANY, _int4_xla_bf16))
    if "read" in only:  # no product: the weights' read alone
        sizes = [(256, 8192), (1024, 8192), (512, 4096), (1024, 2048)]
        # small shapes: each block cut to the weights, once
        for blocks in dict.fromkeys((min(bn, n), min(bk, k)) for bn, bk in sizes):
            fn = functools.partial(_read_only, blocks=blocks)
            out.append(("read", f"read only {blocks}", (1,), fn))
    if "vjp" in only:
        vjp_blocks = [(1024, 2048), (1024, 4096), (2048, 4096)]  # the rule's first
        for (bn, bk), (mxu, parts) in itertools.product(vjp_blocks, ways):
            fn = functools.partial(_vjp, mxu=mxu, parts=parts, blocks=(512, bn, bk))
            out.append(("vjp", f"kn {mxu}x{parts} bn{bn} bk{bk}", (64,), fn))
    return out


def reference(family: str, x, w):
    """float32 x @ W.T (or x @ W for the VJP) at the highest precision."""
    hi = lax.Precision.HIGHEST
    if family == "int4":
        return jnp.dot(x, w["q4_dense"].T, precision=hi)
    if family == "int4_vjp":  # y_bar (m, N) @ W (N, K)
        return jnp.dot(x, w["q4_dense"], precision=hi)
    dense = w["q8"][0].astype(jnp.float32)
    if family == "vjp":  # (N, K) read as (k, n): scales on K's columns
        return jnp.dot(x, dense * w["q8"][1][None, :], precision=hi)
    return jnp.dot(x, (dense * w["q8"][1][:, None]).T, precision=hi)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=420.0)
    parser.add_argument(
        "--only",
        default=(
            "int8,w8a8,vector,int4,int4_bytes,int4_pair,int4_stored,int4_tile_rows,int4_vjp,"
            "int4_xla_bf16,vjp,read"
        ),
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    k, n = args.k, args.n
    w = weights(k, n)
    w["q4_dense"] = dequantize_groups(*w["q4"])  # (N, K) float32
    w["q4_int4"] = _tpu.as_int4(w["q4"][0])
    rng = np.random.default_rng(1)
    xs = {
        m: jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        for m in FEW + MIDDLE + MANY
    }
    baseline = lambda x, w: lax.dot_general(  # noqa: E731
        x, w["bf16"], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    report = {
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "k": k,
        "n": n,
        "calls": args.calls,
        "repeats": args.repeats,
        "bf16_ms": {},
        "variants": [],
    }
    for m, x in xs.items():
        report["bf16_ms"][m] = device_ms(
            baseline, x.astype(jnp.bfloat16), w, k, args.calls, args.repeats
        )
    for family, name, rows, fn in variants(k, n, set(args.only.split(","))):
        for m in rows:
            if time.perf_counter() - start > args.budget:
                report["stopped"] = f"budget {args.budget} s"
                break
            entry = {"family": family, "name": name, "m": m}
            try:
                x = xs[m]
                if family != "read":  # no product to check
                    got = jax.jit(fn)(x, w)
                    want = reference(family, x, w)
                    entry["rel_err"] = float(
                        jnp.linalg.norm(got - want) / jnp.linalg.norm(want)
                    )
                entry["ms"] = device_ms(fn, x, w, k, args.calls, args.repeats)
                entry["vs_bf16"] = report["bf16_ms"][m] / entry["ms"]
            except Exception as error:
                entry["error"] = "".join(traceback.format_exception_only(error))[-600:]
            report["variants"].append(entry)
            print(json.dumps(entry), flush=True)
            if args.out:
                args.out.write_text(json.dumps(report, indent=1))
    report["seconds"] = time.perf_counter() - start
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
