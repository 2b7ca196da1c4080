"""Blocks and padding shared by the kernels: every axis is padded with zeros
to its block (zeros add nothing to a sum), and x's parts are stacked as rows
of one operand, so that each block of weights enters the MXU once for all
parts."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

LANES = 128
# rows of a block of x: int8 operands tile by (32, 128) on a TPU, 32-bit and
# bf16 ones by (8, 128) and (16, 128)
ROW_MULTIPLE = {jnp.dtype(jnp.int8): 32, jnp.dtype(jnp.bfloat16): 16}


def padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def divisor_block(size: int, largest: int, multiple: int = LANES) -> int:
    """The largest block <= ``largest`` (a multiple of ``multiple``) dividing
    ``size`` (itself a multiple of ``multiple``)."""
    block = min(largest, size) // multiple * multiple
    while size % block:
        block -= multiple
    return block


def row_blocks(m: int, dtype, largest: int) -> tuple[int, int]:
    """(padded m, rows a block) for m rows of x in ``dtype``: one block up to
    ``largest`` rows, else blocks of ``largest``."""
    unit = ROW_MULTIPLE.get(jnp.dtype(dtype), 8)
    if padded(m, unit) <= largest:
        return padded(m, unit), padded(m, unit)
    return padded(m, largest), largest


def stack_parts(parts, scales, mp: int, bm: int, kp: int):
    """parts (p, m, k), scales (p, m) -> (rows (mb * p * bm, kp),
    row scales f32 (mb * p * bm, 1)): block i of x's rows holds part 0's bm
    rows, then part 1's, ... (mb = mp / bm)."""
    p, m, k = parts.shape
    parts = jnp.pad(parts, ((0, 0), (0, mp - m), (0, kp - k)))
    scales = jnp.pad(scales, ((0, 0), (0, mp - m)))
    mb = mp // bm
    rows = parts.reshape(p, mb, bm, kp).transpose(1, 0, 2, 3).reshape(-1, kp)
    row_scales = scales.reshape(p, mb, bm).transpose(1, 0, 2).reshape(-1, 1)
    return rows, row_scales


def combine_parts(acc, row_scales, parts: int, bm: int):
    """acc (parts * bm, n), row scales (parts * bm, 1) -> (bm, n): the sum of
    each part's rows times its scales."""
    total = acc[0:bm].astype(jnp.float32) * row_scales[0:bm]
    for i in range(1, parts):
        rows = slice(i * bm, (i + 1) * bm)
        total += acc[rows].astype(jnp.float32) * row_scales[rows]
    return total


def compiler_params(*block_bytes: int, grid_rank: int = 3):
    """Mosaic's parameters for a grid whose last axis is K (the sums carry
    across it: "arbitrary") and whose others are independent ("parallel"),
    with scoped VMEM for the double-buffered blocks of ``block_bytes`` and
    room for the compiler's own temporaries (a TPU core has 128 MiB; the
    default scope is 16)."""
    limit = min(2 * sum(block_bytes) + (16 << 20), 100 << 20)
    return pltpu.CompilerParams(
        dimension_semantics=("parallel",) * (grid_rank - 1) + ("arbitrary",),
        vmem_limit_bytes=limit,
    )
