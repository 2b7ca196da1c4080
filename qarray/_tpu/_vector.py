"""Products of a few rows of x with int8 weights on a TPU's vector unit,
not its MXU: layout nk, float32 products and sums.

With one row of x each weight is used once. The MXU takes its weights in at
most 128 values a cycle, no faster than int8 weights arrive from device
memory; the vector unit converts each block of weights to float32 and
multiplies it by x's row broadcast over the block's rows, summing 128 lanes
at a time, and each output's 128 lanes are summed once at the end. Every
product and sum is float32's, so the result is float32's at any precision
asked for, within a few percent of the MXU's one bf16 part at one row on a
v5e (``benchmarks/tpu_kernels.py --only vector,int8``; docs/accelerators.md).
Each further row of x costs the vector unit as much again: the TPU rule's
``vector_max_rows`` says how many rows it takes. (int4 weights, whose
nibbles take more work to unpack, were slower here than on the MXU:
docs/accelerators.md.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._rules import for_tpu
from . import _layout

# rows of x a call takes: one (8, 128) tile of float32
VECTOR_MAX_ROWS = 8


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


def _rows(x, width: int):
    """x (m, k) -> float32 (8, width), zeros past m rows and k entries."""
    m, k = x.shape
    return jnp.pad(x.astype(jnp.float32), ((0, VECTOR_MAX_ROWS - m), (0, width - k)))


def _int8_vector(x, qvalue, *, blocks, interpret=False):
    m, k = x.shape
    n = qvalue.shape[0]
    if 0 in (m, k, n):
        return jnp.zeros((m, n), jnp.float32)
    np_, kp = _layout.padded(n, _layout.LANES), _layout.padded(k, _layout.LANES)
    bn, bk = _layout.divisor_block(np_, blocks[0]), _layout.divisor_block(kp, blocks[1])
    w = jnp.pad(qvalue, ((0, np_ - n), (0, kp - k)))
    out = pl.pallas_call(
        functools.partial(_int8_kernel, rows=m),
        out_shape=jax.ShapeDtypeStruct((np_, VECTOR_MAX_ROWS), jnp.float32),
        grid=(np_ // bn, kp // bk),
        in_specs=[
            pl.BlockSpec((VECTOR_MAX_ROWS, bk), lambda j, kk: (0, kk)),
            pl.BlockSpec((bn, bk), lambda j, kk: (j, kk)),
        ],
        out_specs=pl.BlockSpec((bn, VECTOR_MAX_ROWS), lambda j, kk: (j, 0)),
        scratch_shapes=[pltpu.VMEM((m, bn, _layout.LANES), jnp.float32)],
        compiler_params=_layout.compiler_params(
            VECTOR_MAX_ROWS * bk * 4, bn * bk, m * bn * _layout.LANES * 4, grid_rank=2
        ),
        interpret=interpret,
    )(_rows(x, kp), w)
    return out[:n, :m].T


_int8_jitted = jax.jit(_int8_vector, static_argnames=("blocks", "interpret"))


def int8_vector(x, qvalue, *, blocks=None, interpret: bool = False):
    """x f32 (m, k), m <= 8, times int8 weights (n, k) -> f32 (m, n):
    ``x @ qvalue.T``, unscaled (the caller's per-channel scales multiply
    the output). ``blocks``: (bn, bk) upper bounds (default: the TPU rule's
    ``vector_blocks``). TypeError where the operands do not agree."""
    if x.ndim != 2 or x.shape[0] > VECTOR_MAX_ROWS:
        raise TypeError(
            f"int8_vector takes x (m, k) with m <= {VECTOR_MAX_ROWS}, got {x.shape}"
        )
    if qvalue.ndim != 2 or qvalue.dtype != jnp.int8 or qvalue.shape[1] != x.shape[1]:
        raise TypeError(
            f"int8_vector: x {x.shape} and int8 weights (n, k) do not agree: "
            f"{qvalue.dtype}{qvalue.shape}"
        )
    blocks = blocks or for_tpu().vector_blocks
    return _int8_jitted(x, qvalue, blocks=blocks, interpret=interpret)
