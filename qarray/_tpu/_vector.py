"""Products of a few rows of x with int8 or int4 weights on a TPU's vector
unit, not its MXU: layout nk, float32 products and sums.

With one row of x each weight is used once. The MXU takes its weights in at
most 128 values a cycle, slower than int8 or int4 weights arrive from device
memory; the vector unit converts each block of weights to float32 and
multiplies it by x's row broadcast over the block's rows, summing 128 lanes
at a time, and each output's 128 lanes are summed once at the end
(``benchmarks/tpu_kernels.py``'s vector rows against the MXU's). Every
product and sum is float32's, so the result is float32's at any precision
asked for. Each further row of x costs the vector unit as much again: the
TPU rule's ``vector_max_rows`` says how many rows it takes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._rules import for_tpu
from . import _layout

# rows of x a call takes: one (8, 128) tile of float32
MAX_ROWS = 8


def _int8_kernel(x_ref, w_ref, o_ref, acc_ref, *, rows):
    """x (8, bk) f32, weights (bn, bk) int8 -> o (bn, 8): x's row r's sums
    in column r. acc (rows, bn, 128): each row's lane-wise sums."""
    kk = pl.program_id(1)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    accs = [acc_ref[r] for r in range(rows)]
    for c in range(w_ref.shape[1] // _layout.LANES):
        cols = slice(c * _layout.LANES, (c + 1) * _layout.LANES)
        w = w_ref[:, cols].astype(jnp.float32)
        for r in range(rows):
            accs[r] += w * x_ref[r : r + 1, cols]
    for r in range(rows):
        acc_ref[r] = accs[r]

    @pl.when(kk == pl.num_programs(1) - 1)
    def _():
        for r in range(rows):
            o_ref[:, r : r + 1] = jnp.sum(acc_ref[r], axis=1, keepdims=True)


def _int4_kernel(xe_ref, xo_ref, w_ref, s_ref, o_ref, acc_ref, *, rows, half):
    """x's even and odd entries (8, bk2) f32, packed bytes (bn, bk2) uint8,
    their groups' scales (bn, bk2 / half) -> o (bn, 8), as ``_int8_kernel``.
    G a multiple of 128: each 128-byte chunk is one group's or two groups'
    halves (half = 64: lanes 0-63 and 64-127)."""
    kk = pl.program_id(1)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    lanes = _layout.LANES
    shape = acc_ref.shape[1:]
    first = lax.broadcasted_iota(jnp.int32, shape, 1) < lanes // 2
    accs = [acc_ref[r] for r in range(rows)]
    for c in range(w_ref.shape[1] // lanes):
        cols = slice(c * lanes, (c + 1) * lanes)
        v = w_ref[:, cols].astype(jnp.int32)
        low = ((v << 28) >> 28).astype(jnp.float32)  # 4-bit two's complement
        high = ((v << 24) >> 28).astype(jnp.float32)
        g = c * lanes // half  # the chunk's (first) group
        if half < lanes:
            scale = jnp.where(first, s_ref[:, g : g + 1], s_ref[:, g + 1 : g + 2])
        else:
            scale = s_ref[:, g : g + 1]
        for r in range(rows):
            sums = low * xe_ref[r : r + 1, cols] + high * xo_ref[r : r + 1, cols]
            accs[r] += sums * scale
    for r in range(rows):
        acc_ref[r] = accs[r]

    @pl.when(kk == pl.num_programs(1) - 1)
    def _():
        for r in range(rows):
            o_ref[:, r : r + 1] = jnp.sum(acc_ref[r], axis=1, keepdims=True)


def _call(kernel, xs, w, extra, *, bn, bk, rows, extra_block, interpret):
    """The grid (output blocks, K blocks) over xs (each (8, kp)), weights
    (np, kp) and ``extra`` (np, kp / (bk / extra_block)) -> (np, 8)."""
    np_, kp = w.shape
    in_specs = [pl.BlockSpec((MAX_ROWS, bk), lambda j, kk: (0, kk))] * len(xs)
    in_specs.append(pl.BlockSpec((bn, bk), lambda j, kk: (j, kk)))
    args = [*xs, w]
    if extra is not None:
        in_specs.append(pl.BlockSpec((bn, extra_block), lambda j, kk: (j, kk)))
        args.append(extra)
    params = _layout.compiler_params(
        len(xs) * MAX_ROWS * bk * 4, bn * bk, rows * bn * _layout.LANES * 4, grid_rank=2
    )
    return pl.pallas_call(
        functools.partial(kernel, rows=rows),
        out_shape=jax.ShapeDtypeStruct((np_, MAX_ROWS), jnp.float32),
        grid=(np_ // bn, kp // bk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bn, MAX_ROWS), lambda j, kk: (j, 0)),
        scratch_shapes=[pltpu.VMEM((rows, bn, _layout.LANES), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
    )(*args)


def _rows(x, width: int):
    """x (m, k) -> float32 (8, width), zeros past m rows and k entries."""
    m, k = x.shape
    return jnp.pad(x.astype(jnp.float32), ((0, MAX_ROWS - m), (0, width - k)))


def _int8_vector(x, qvalue, *, blocks, interpret=False):
    m, k = x.shape
    n = qvalue.shape[0]
    if 0 in (m, k, n):
        return jnp.zeros((m, n), jnp.float32)
    np_, kp = _layout.padded(n, _layout.LANES), _layout.padded(k, _layout.LANES)
    bn, bk = _layout.divisor_block(np_, blocks[0]), _layout.divisor_block(kp, blocks[1])
    w = jnp.pad(qvalue, ((0, np_ - n), (0, kp - k)))
    out = _call(
        _int8_kernel, [_rows(x, kp)], w, None,
        bn=bn, bk=bk, rows=m, extra_block=None, interpret=interpret,
    )  # fmt: skip
    return out[:n, :m].T


def _int4_vector(x, packed, scale, *, group_size, blocks, interpret=False):
    m, k = x.shape
    n, k2 = packed.shape
    if 0 in (m, k, n):
        return jnp.zeros((m, n), jnp.float32)
    half = group_size // 2
    # a block of K holds whole groups, and its scales' block is all of the
    # row's groups or a multiple of 128 of them
    unit = _layout.LANES * half
    kp2 = _layout.padded(k2, max(half, _layout.LANES))
    if kp2 > unit:
        kp2 = _layout.padded(k2, unit)
        bk2 = _layout.divisor_block(kp2, max(blocks[1], unit), unit)
    else:
        bk2 = kp2
    np_ = _layout.padded(n, _layout.LANES)
    bn = _layout.divisor_block(np_, blocks[0])
    w = jnp.pad(packed, ((0, np_ - n), (0, kp2 - k2)))
    groups = jnp.pad(
        scale.astype(jnp.float32), ((0, np_ - n), (0, kp2 // half - scale.shape[1]))
    )
    xs = [_rows(x[:, entry], kp2) for entry in (slice(0, None, 2), slice(1, None, 2))]
    out = _call(
        functools.partial(_int4_kernel, half=half), xs, w, groups,
        bn=bn, bk=bk2, rows=m, extra_block=bk2 // half, interpret=interpret,
    )  # fmt: skip
    return out[:n, :m].T


_int8_jitted = jax.jit(_int8_vector, static_argnames=("blocks", "interpret"))
_int4_jitted = jax.jit(
    _int4_vector, static_argnames=("group_size", "blocks", "interpret")
)


def _check_rows(x, name: str):
    if x.ndim != 2 or x.shape[0] > MAX_ROWS:
        raise TypeError(f"{name} takes x (m, k) with m <= {MAX_ROWS}, got {x.shape}")


def int8_vector(x, qvalue, *, blocks=None, interpret: bool = False):
    """x f32 (m, k), m <= 8, times int8 weights (n, k) -> f32 (m, n):
    ``x @ qvalue.T``, unscaled (the caller's per-channel scales multiply
    the output). ``blocks``: (bn, bk) upper bounds (default: the TPU rule's
    ``vector_blocks``). TypeError where the operands do not agree."""
    _check_rows(x, "int8_vector")
    if qvalue.ndim != 2 or qvalue.dtype != jnp.int8 or qvalue.shape[1] != x.shape[1]:
        raise TypeError(
            f"int8_vector: x {x.shape} and int8 weights (n, k) do not agree: "
            f"{qvalue.dtype}{qvalue.shape}"
        )
    blocks = blocks or for_tpu().vector_blocks
    return _int8_jitted(x, qvalue, blocks=blocks, interpret=interpret)


def int4_vector(x, packed, scale, *, group_size: int, blocks=None, interpret=False):
    """x f32 (m, k), m <= 8, times int4 weights (qarray's packed uint8
    (n, k / 2), scales f32 (n, k / G)) -> f32 (m, n), for G a multiple of
    128 (ValueError otherwise). ``blocks``: (bn, packed bk) upper bounds
    (default: the TPU rule's ``vector_blocks``; a block of K is at least 128
    groups or all of them). TypeError where the operands do not agree."""
    _check_rows(x, "int4_vector")
    if group_size <= 0 or group_size % _layout.LANES:
        raise ValueError(f"int4_vector: group_size {group_size}, a multiple of 128")
    k, n = x.shape[1], packed.shape[0]
    agree = (
        packed.ndim == 2
        and packed.dtype == jnp.uint8
        and 2 * packed.shape[1] == k
        and k % group_size == 0
        and scale.shape == (n, k // group_size)
    )
    if not agree:
        raise TypeError(
            f"int4_vector: x {x.shape}, packed {packed.dtype}{packed.shape} and "
            f"scale {scale.shape} do not agree for group_size {group_size} "
            "(packed uint8 (n, k / 2), scale (n, k / group_size))"
        )
    blocks = blocks or for_tpu().vector_blocks
    return _int4_jitted(
        x, packed, scale, group_size=group_size, blocks=blocks, interpret=interpret
    )
