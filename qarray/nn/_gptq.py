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
matrix updated once per block (one matrix product). Float64 throughout.
"""

from __future__ import annotations

import numpy as np

from .._ops import QMAX4

QMAX8 = 127
BLOCK = 128  # columns per lazy update


def _scales(w: np.ndarray, qmax: int) -> np.ndarray:
    """absmax / qmax along the last axis of ``w``."""
    return np.abs(w).max(axis=-1) / qmax


def _round(column: np.ndarray, scale: np.ndarray, qmax: int) -> np.ndarray:
    # a zero scale belongs to zero weights: any divisor rounds them to 0
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(column / safe), -qmax, qmax)


def inverse_hessian_factor(h: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """(U, dead): the upper Cholesky factor of ``(H + damp * mean(diag H) I)^-1``
    and the mask of columns no input reaches (``diag(H) == 0``: their weights
    are set to zero, as they meet only zeros)."""
    h = np.array(h, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    mean = np.mean(np.diag(h))
    h[np.diag_indices_from(h)] += damp * mean
    inverse = np.linalg.inv(np.linalg.cholesky(h))  # L^-1, H = L L^T
    # H^-1 = L^-T L^-1; its upper factor U (H^-1 = U^T U) is chol(H^-1)^T
    u = np.linalg.cholesky(inverse.T @ inverse).T
    return u, dead


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
    dequantized weights are ``values * scale`` (per group for int4)."""
    w = np.array(w, np.float64)
    out, k = w.shape
    qmax = QMAX8 if bits == 8 else QMAX4
    u, dead = inverse_hessian_factor(h, damp)
    w[:, dead] = 0.0
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    inverse_order = np.argsort(order)
    w = w[:, order]
    # the factor of the permuted H: recompute on the permuted matrix
    if act_order:
        hp = np.array(h, np.float64)[np.ix_(order, order)]
        u, _ = inverse_hessian_factor(hp, damp)
    if bits == 8:
        row_scale = _scales(w, qmax)
        groups = None
    else:
        groups = np.zeros((out, k // group_size))
        if act_order:  # static groups: scales of the original weights
            original = w[:, inverse_order].reshape(out, -1, group_size)
            groups = _scales(original, qmax)
    values = np.zeros((out, k))
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        block = w[:, b0:b1].copy()
        errors = np.zeros_like(block)
        for j in range(b1 - b0):
            i = b0 + j  # position in the (permuted) order
            column = order[i]
            if bits == 8:
                scale = row_scale
            else:
                g = column // group_size
                if not act_order and column % group_size == 0:
                    # the group's scale from its weights as updated so far:
                    # those past the block with the block's pending update
                    inside = block[:, j : j + group_size]
                    past = w[:, b1 : i + group_size] - errors[:, :j] @ u[
                        b0:i, b1 : i + group_size
                    ]
                    rest = np.concatenate([inside, past], axis=1)
                    groups[:, g] = _scales(rest, qmax)
                scale = groups[:, g]
            q = _round(block[:, j], scale, qmax)
            values[:, i] = q
            error = (block[:, j] - q * scale) / u[i, i]
            block[:, j + 1 :] -= np.outer(error, u[i, i + 1 : b1])
            errors[:, j] = error
        w[:, b1:] -= errors @ u[b0:b1, b1:]
    values = values[:, inverse_order]
    if bits == 8:
        return values.astype(np.int8), row_scale.astype(np.float32)
    return values.astype(np.int8), groups.astype(np.float32)
