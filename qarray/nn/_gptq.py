"""GPTQ: weights quantized column by column, each column's rounding error
spread over the columns not yet quantized through the inverse Hessian of the
layer's output error on calibration inputs (Frantar et al., 2022), so that
``||X W^T - X Q^T||`` is far below round-to-nearest's.

For a layer with weights ``W (out, K)`` and inputs ``X (n, K)`` (a
convolution's: its im2col patches, per group), ``H = X^T X`` plus
``damp * mean(diag(H))`` on the diagonal; the upper Cholesky factor ``U`` of
``H^-1``; then for each column ``i`` in order (by decreasing ``diag(H)``
with ``act_order``): ``q = quantize(W[:, i])``, ``e = (W[:, i] - q) /
U[i, i]``, ``W[:, j] -= e * U[i, j]`` for ``j > i``. int8 keeps one scale
per output channel (round-to-nearest's, from the row's absmax); int4 picks
each group's scale when the column block reaches it (from the updated
weights), or, with ``act_order``, from the original weights first. The
columns go in blocks: within a block one column at a time, the rest of the
matrix updated once per block (one matrix product). The factorisation runs
in float64 (NumPy), the column loop compiled in float32 (XLA): one program
for the whole loop rather than a dispatch per column, which is what makes
large layers affordable (``benchmarks/bench_calibration.py`` times it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.scipy.linalg
import numpy as np
from jax import lax

from .._numerics import QMAX, QMAX4, on_grid

BLOCK = 128  # columns per lazy update


def _scales(w: np.ndarray, qmax: int) -> np.ndarray:
    """absmax / qmax along the last axis of ``w``."""
    return np.abs(w).max(axis=-1) / qmax


def inverse_hessian_factor(h: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """(U, dead): the upper Cholesky factor of ``(H + damp * mean(diag H) I)^-1``
    and the mask of columns no input reaches (``diag(H) == 0``: their weights
    are set to zero, as they meet only zeros)."""
    h = np.array(h, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    mean = np.mean(np.diag(h))
    h[np.diag_indices_from(h)] += damp * mean
    # with J the exchange matrix, chol(J H J) = L gives H = R R^T for the
    # upper R = J L J, so H^-1 = U^T U for the upper U = R^-1 = J L^-1 J:
    # one Cholesky and one triangular solve, where inverting H and factoring
    # the inverse would take a general inverse and a second Cholesky (the
    # solve XLA's, in float32, the column loop's precision; GPTQ's time on
    # large layers: benchmarks/bench_calibration.py)
    lower = np.linalg.cholesky(h[::-1, ::-1])
    inverse = _lower_inverse(lower.astype(np.float32))
    u = np.asarray(inverse, np.float64)[::-1, ::-1]
    return u, dead


@jax.jit
def _lower_inverse(lower):
    """``lower^-1`` of a lower triangular float32 ``(K, K)``: one compiled
    program per K (eagerly the identity and the solve would compile apart;
    NumPy arguments, as ``jnp.asarray`` of one compiles a copy of its own)."""
    eye = jnp.eye(len(lower), dtype=lower.dtype)
    return jax.scipy.linalg.solve_triangular(lower, eye, lower=True)


def _block_size(group_size: int | None) -> int:
    """Columns per lazy update: about BLOCK, and whole int4 groups, so that a
    group's columns are all in one block when its scale is chosen."""
    if group_size is None:
        return BLOCK
    return group_size * max(1, -(-BLOCK // group_size))


@functools.partial(jax.jit, static_argnames=("qmax", "group_size", "block", "fixed"))
def _columns(w, u, scales, *, qmax, group_size, block, fixed):
    """The column loop on ``w (out, K)`` (K a multiple of ``block``, padded
    with zero columns and unit rows of ``u``): the integer values, and the
    scales (``fixed``: ``scales`` as given, one per row or per group; else
    each group's from its columns as updated when the loop reaches it)."""
    out, k = w.shape
    columns = jnp.arange(block)

    def one_block(b, carry):
        w, values, scales = carry
        b0 = b * block
        wb = lax.dynamic_slice(w, (0, b0), (out, block))
        ub = lax.dynamic_slice(u, (b0, 0), (block, k))  # rows of this block

        def one_column(j, inner):
            wb, errors, values, scales = inner
            i = b0 + j
            if group_size is None:
                scale = scales
            else:
                g = i // group_size
                if not fixed:
                    start = lax.dynamic_slice(wb, (0, j), (out, group_size))
                    fresh = jnp.max(jnp.abs(start), axis=1) / qmax
                    current = lax.dynamic_index_in_dim(scales, g, 1, keepdims=False)
                    chosen = jnp.where(i % group_size == 0, fresh, current)
                    scales = lax.dynamic_update_index_in_dim(scales, chosen, g, 1)
                scale = lax.dynamic_index_in_dim(scales, g, 1, keepdims=False)
            column = lax.dynamic_index_in_dim(wb, j, 1, keepdims=False)
            safe = jnp.where(scale > 0, scale, 1.0)
            q = on_grid(column, safe, qmax)
            values = lax.dynamic_update_index_in_dim(values, q, i, 1)
            row = lax.dynamic_slice(ub, (j, b0), (1, block))[0]
            error = (column - q * scale) / row[j]
            later = jnp.where(columns > j, row, 0.0)
            wb = wb - error[:, None] * later[None, :]
            errors = lax.dynamic_update_index_in_dim(errors, error, j, 1)
            return wb, errors, values, scales

        errors = jnp.zeros((out, block), w.dtype)
        wb, errors, values, scales = lax.fori_loop(
            0, block, one_column, (wb, errors, values, scales)
        )
        # the columns past the block: one product, for this block's errors
        past = jnp.arange(k) >= b0 + block
        w = w - errors @ jnp.where(past[None, :], ub, 0.0)
        w = lax.dynamic_update_slice(w, wb, (0, b0))
        return w, values, scales

    values = jnp.zeros_like(w)
    _, values, scales = lax.fori_loop(0, k // block, one_block, (w, values, scales))
    return values, scales


def gptq(
    w: np.ndarray,
    h: np.ndarray,
    *,
    bits: int = 8,
    group_size: int | None = None,
    damp: float = 0.01,
    act_order: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ of ``w (out, K)`` for inputs with ``h = X^T X (K, K)``: the
    integer values ``(out, K)`` (int8 in [-127, 127], int4 in [-7, 7]) and
    the scales (``(out,)``; int4: ``(out, K / group_size)``), so that the
    dequantized weights are ``values * scale`` (per group for int4). The
    factorisation in float64 (NumPy), the column loop in float32 (compiled:
    ``_columns``)."""
    w = np.array(w, np.float64)
    h = np.asarray(h, np.float64)
    out, k = w.shape
    qmax = int(QMAX) if bits == 8 else int(QMAX4)
    dead = np.diag(h) == 0
    w[:, dead] = 0.0
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    u, _ = inverse_hessian_factor(h[np.ix_(order, order)], damp)
    group = None if bits == 8 else group_size
    if bits == 8:
        scales, loop_scales, fixed = _scales(w, qmax), None, True
    elif act_order:
        # static groups (the original weights' scales), read by the permuted
        # loop as one scale per column
        scales = _scales(w.reshape(out, -1, group_size), qmax)
        loop_scales, group, fixed = scales[:, order // group_size], 1, True
    else:
        scales, loop_scales, fixed = None, None, False
    block = _block_size(group)
    padded = -(-k // block) * block
    if scales is None:  # chosen in the loop, the padding's groups too
        scales = np.zeros((out, padded // group_size))
    wp = np.zeros((out, padded))
    wp[:, :k] = w[:, order]
    up = np.eye(padded)
    up[:k, :k] = u
    if loop_scales is None:
        loop_scales = scales
    elif group == 1:
        loop_scales = np.pad(loop_scales, ((0, 0), (0, padded - k)), constant_values=1)
    values, chosen = _columns(
        wp.astype(np.float32),
        up.astype(np.float32),
        np.asarray(loop_scales, np.float32),
        qmax=qmax,
        group_size=group,
        block=block,
        fixed=fixed,
    )
    if not fixed:
        scales = np.asarray(chosen)[:, : k // group_size]
    values = np.asarray(values)[:, :k][:, np.argsort(order)]
    return values.astype(np.int8), np.asarray(scales, np.float32)
