"""Per-input-channel scales chosen on calibration inputs: AWQ's search (and
its clipping of the scaled weights), SmoothQuant's migration, and static
activation ranges.

A layer's weights ``W (out, K)`` (a convolution's ``(out, C * prod(kernel))``,
C outermost) see inputs whose channel ``c`` feeds ``W``'s columns of that
channel. With a channel scale ``s (C,)`` the layer computes ``(x / s) @
Q(W * s)^T`` (``s`` repeated over a kernel's positions): large ``s`` where
the inputs are large gives those weights finer steps (AWQ, Lin et al. 2023),
and moves the input's outlier channels into the weights (SmoothQuant, Xiao
et al. 2022), where per-row int8 activations lose them. AWQ then clips the
scaled weights (``awq_clip``): each row's (int4: each group's) range shrunk
to the ratio of ``AWQ_CLIP_GRID`` whose rounding moves that row's outputs on
the calibration inputs the least.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._numerics import (
    dequantize_groups,
    dequantize_rows,
    quantize_groups,
    quantize_rows,
)
from .._primitives import dequantize, quantize

# AWQ's grid of exponents: s = mean|x|^alpha, alpha = 0 (round-to-nearest)
# to 0.95 (Lin et al.'s n_grid = 20)
AWQ_GRID = tuple(i / 20 for i in range(20))
_FLOOR = 1e-4  # the least scale: channels no input reaches are not blown up
# AWQ's clipping ratios of a row's (int4: a group's) max |w|: 1 (no clipping)
# down to 0.525 in 20 steps (llm-awq's auto_clip: 1 to 0.55 by 0.05)
AWQ_CLIP_GRID = tuple(1 - i / 40 for i in range(20))
_CLIP_ROWS = 256  # weight rows per compiled step of the clipping search, at most
_CLIP_SWEEPS = 2  # int4: passes over a row's groups


def channel_statistics(inputs: np.ndarray, channel_axis: int):
    """(max |x|, mean |x|) per channel of the recorded ``inputs``."""
    x = np.abs(np.moveaxis(np.asarray(inputs, np.float64), channel_axis, -1))
    x = x.reshape(-1, x.shape[-1])
    return x.max(axis=0), x.mean(axis=0)


def columns(s: np.ndarray, per_channel: int) -> np.ndarray:
    """A channel scale ``(C,)`` over the weight columns ``(C * per_channel,)``."""
    return np.repeat(np.asarray(s, np.float64), per_channel)


def weight_channel_absmax(w: np.ndarray, channels: int) -> np.ndarray:
    """max |W| over the columns of each input channel of ``w (out, K)``."""
    return np.abs(w).reshape(w.shape[0], channels, -1).max(axis=(0, 2))


def smoothquant_scale(x_absmax, w_absmax, alpha: float) -> np.ndarray:
    """``max|x_c|^alpha / max|W_c|^(1 - alpha)`` per channel (1 where a
    channel has no input or no weight)."""
    x_absmax, w_absmax = np.asarray(x_absmax), np.asarray(w_absmax)
    live = (x_absmax > 0) & (w_absmax > 0)
    s = np.ones_like(x_absmax)
    s[live] = x_absmax[live] ** alpha / w_absmax[live] ** (1 - alpha)
    return np.clip(s, 1e-5, 1e5)


def static_channel_scale(x_absmax) -> np.ndarray:
    """The channel scale of static per-channel ranges: ``max|x_c| / max_c
    max|x_c|``, so that ``x / s`` has every channel's range the largest one's
    and one activation scale steps each channel by ``max|x_c| / 127``."""
    x_absmax = np.asarray(x_absmax, np.float64)
    top = x_absmax.max() if x_absmax.size else 0.0
    if top == 0:
        return np.ones_like(x_absmax)
    return np.where(x_absmax > 0, x_absmax / top, 1.0)


def awq_candidate(x_mean, alpha: float) -> np.ndarray:
    """AWQ's scale for exponent ``alpha``: ``mean|x|^alpha`` normalised by
    the geometric middle of its range."""
    s = np.maximum(np.asarray(x_mean, np.float64), _FLOOR) ** alpha
    return s / np.sqrt(s.max() * s.min())


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def _output_errors(w, rows, candidates, *, bits, group_size):
    """``||rows (W - Q(W * s) / s)^T||^2`` for each channel scale ``s`` of
    ``candidates (n, K)`` (over the columns): the layer's output errors on
    the inputs ``rows``, the whole search one program."""

    def error(s_cols):
        back = dequantize(quantize(w * s_cols, bits, group_size)) / s_cols
        return jnp.sum((rows @ (w - back).T) ** 2)

    return jax.lax.map(error, candidates)


def _error_rows(features: np.ndarray) -> np.ndarray:
    """Rows ``R`` with ``R^T R = F^T F`` for the inputs ``F (n, K)``: ``F``
    itself, or ``L^T`` of ``F^T F = L L^T`` when that has fewer rows."""
    if features.shape[0] <= features.shape[1]:
        return features
    h = features.T.astype(np.float64) @ features.astype(np.float64)
    h[np.diag_indices_from(h)] += 1e-9 * max(np.mean(np.diag(h)), 1e-30)
    return np.linalg.cholesky(h).T


def awq_scale(w, features, x_mean, *, bits: int, group_size: int | None):
    """The channel scale ``(C,)`` of AWQ's grid (``AWQ_GRID``) whose
    quantized layer has the least output error on ``features (n, K)`` (the
    inputs as the weights ``w (out, K)`` see them), and that error per
    exponent."""
    per_channel = w.shape[1] // len(x_mean)
    # NumPy arguments: jnp.asarray of one compiles a copy program of its own
    rows = _error_rows(np.asarray(features)).astype(np.float32)
    candidates = np.stack(
        [columns(awq_candidate(x_mean, alpha), per_channel) for alpha in AWQ_GRID]
    )
    errors = _output_errors(
        np.asarray(w, np.float32),
        rows,
        candidates.astype(np.float32),
        bits=bits,
        group_size=group_size,
    )
    errors = [float(e) for e in np.asarray(errors)]
    best = AWQ_GRID[int(np.argmin(errors))]
    return awq_candidate(x_mean, best), errors


def _roundtrip(w, group_size: int | None):
    """``w (rows, K)`` quantized and dequantized as the stored layer does it
    (``_numerics``: int8 per row, or int4 per group of ``group_size``)."""
    if group_size is None:
        return dequantize_rows(*quantize_rows(w))
    return dequantize_groups(*quantize_groups(w, group_size))


def _clipped(groups, top, ratio):
    """``groups (rows, n, G)`` clipped to ``+-ratio * top`` (``top`` their
    max |w|, ``ratio`` broadcast against it): the one formula the search
    measures and the stored layer quantizes."""
    bound = ratio * top
    return jnp.clip(groups, -bound, bound)


def _clip_search(w, rows, ratios, *, group_size, sweeps):
    """The index into ``ratios`` of each row's (int4: each group's) clip,
    ``(out, groups)``, for the weights ``w (out, K)`` and the error rows
    ``rows (m, K)`` of their inputs (``awq_clip``)."""
    n, k = w.shape
    size = k if group_size is None else group_size
    count = k // size
    groups = w.reshape(n, count, size)
    top = jnp.max(jnp.abs(groups), axis=-1, keepdims=True)
    blocks = rows.reshape(rows.shape[0], count, size)

    def moved(ratio):  # what rounding the clipped weights moves them by
        back = _roundtrip(_clipped(groups, top, ratio).reshape(n, k), group_size)
        return groups - back.reshape(groups.shape)

    deltas = jax.lax.map(moved, ratios)  # (ratios, out, groups, G)

    def share(delta):  # each group's share of its row's output error
        return jnp.sum(jnp.einsum("mgj,ngj->mng", blocks, delta) ** 2, axis=0)

    own = jnp.argmin(jax.lax.map(share, deltas), axis=0)  # (out, groups)
    if count == 1:
        return own

    def outputs(choice):  # rows @ (the chosen moves)^T: (m, out)
        chosen = jnp.take_along_axis(deltas, choice[None, ..., None], axis=0)[0]
        return jnp.einsum("mgj,ngj->mn", blocks, chosen)

    # a row starts from its groups' own choices, or unclipped where those
    # move its outputs more (the cross terms of correlated inputs): the
    # search never ends above no clipping
    none = jnp.zeros_like(own)
    better = jnp.sum(outputs(own) ** 2, 0) <= jnp.sum(outputs(none) ** 2, 0)
    choice = jnp.where(better[:, None], own, none)

    def step(carry, g):  # group g's ratio of least row error, the rest fixed
        out, choice = carry
        block, candidates = blocks[:, g], deltas[:, :, g]
        old = jnp.take_along_axis(candidates, choice[None, :, g, None], axis=0)[0]
        rest = out - block @ old.T
        tried = rest[None] + jnp.einsum("mj,anj->amn", block, candidates)
        pick = jnp.argmin(jnp.sum(tried**2, axis=1), axis=0)
        new = jnp.take_along_axis(candidates, pick[None, :, None], axis=0)[0]
        return (rest + block @ new.T, choice.at[:, g].set(pick)), None

    carry = (outputs(choice), choice)
    for _ in range(sweeps):
        carry, _ = jax.lax.scan(step, carry, jnp.arange(count))
    return carry[1]


def _clip_to(w, ratio, *, group_size):
    """``w (rows, K)`` with each row (group) clipped to ``ratio (rows,
    groups)`` times its max |w|."""
    n, k = w.shape
    size = k if group_size is None else group_size
    groups = w.reshape(n, k // size, size)
    top = jnp.max(jnp.abs(groups), axis=-1, keepdims=True)
    return _clipped(groups, top, ratio[..., None]).reshape(n, k)


@functools.partial(jax.jit, static_argnames=("group_size", "sweeps"))
def _clip_rows(w, rows, ratios, *, group_size, sweeps):
    """(``w (out, K)`` clipped, the ratios ``(out, groups)``) of the search
    (``_clip_search``): one program per chunk shape."""
    ratio = ratios[_clip_search(w, rows, ratios, group_size=group_size, sweeps=sweeps)]
    return _clip_to(w, ratio, group_size=group_size), ratio


def awq_clip(w, features, s_cols, *, group_size: int | None):
    """AWQ's clipping (llm-awq's ``auto_clip``) of the scaled weights ``w
    (out, K)`` (``W * s``): each row's values clipped to ``r`` times its
    max |w| (int4: each group's of ``group_size`` columns, the group's
    scale), ``r`` from ``AWQ_CLIP_GRID`` (1: no clipping), for the least
    output error ``||F (w_row - Q(clip(w_row)))^T||^2`` of the row, ``F =
    features / s`` the inputs the weights see (``features (n, K)``).

    int8: every ratio tried per row. int4: each group first takes the ratio
    of its own share of the error (``F_g (w_g - Q(clip(w_g)))``, llm-awq's
    choice), or a row none where that moves its outputs more than no
    clipping; then ``_CLIP_SWEEPS`` passes over the groups give each in turn
    the ratio of least row error with the others as they are (correlated
    inputs couple the groups' errors), so no row ends above its unclipped
    error on ``features``.

    Returns (the clipped weights, float32 ``(out, K)``, which the layer
    quantizes: their max |w| sets the stored scales; the ratios ``(out,
    groups)``, int8 one group)."""
    # NumPy throughout, the chunks sliced on the host: eagerly every
    # conversion, slice and concatenation of JAX arrays compiles on its own
    rows = _error_rows(np.asarray(features) / np.asarray(s_cols))
    rows = rows.astype(np.float32)
    grid = np.asarray(AWQ_CLIP_GRID, np.float32)
    w32 = np.asarray(w, np.float32)
    groups = w32.shape[1] // (group_size or w32.shape[1])
    # rows per step: the (m, rows, groups) errors of one ratio stay within
    # 2**24 float32s (64 MiB) whatever the layer's size
    step = int(np.clip(2**24 // (rows.shape[0] * groups), 8, _CLIP_ROWS))
    options = {"group_size": group_size, "sweeps": _CLIP_SWEEPS}
    clipped, ratios = [], []
    for start in range(0, w32.shape[0], step):
        chunk, ratio = _clip_rows(w32[start : start + step], rows, grid, **options)
        clipped.append(np.asarray(chunk))
        ratios.append(np.asarray(ratio))
    return jax.device_put(np.concatenate(clipped)), np.concatenate(ratios)
