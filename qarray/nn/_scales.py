"""Per-input-channel scales chosen on calibration inputs: AWQ's search,
SmoothQuant's migration, and static activation ranges.

A layer's weights ``W (out, K)`` (a convolution's ``(out, C * prod(kernel))``,
C outermost) see inputs whose channel ``c`` feeds ``W``'s columns of that
channel. With a channel scale ``s (C,)`` the layer computes ``(x / s) @
Q(W * s)^T`` (``s`` repeated over a kernel's positions): large ``s`` where
the inputs are large gives those weights finer steps (AWQ, Lin et al. 2023),
and moves the input's outlier channels into the weights (SmoothQuant, Xiao
et al. 2022), where per-row int8 activations lose them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._ops import dequantize, quantize

# AWQ's grid of exponents: s = mean|x|^alpha, alpha = 0 (round-to-nearest)
# to 0.95 (Lin et al.'s n_grid = 20)
AWQ_GRID = tuple(i / 20 for i in range(20))
_FLOOR = 1e-4  # the least scale: channels no input reaches are not blown up


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
def _output_error(w, rows, s_cols, *, bits, group_size):
    """``||rows (W - Q(W * s) / s)^T||^2``: the layer's output error on the
    inputs ``rows`` with the channel scale ``s`` (over the columns)."""
    back = dequantize(quantize(w * s_cols, bits, group_size)) / s_cols
    return jnp.sum((rows @ (w - back).T) ** 2)


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
    rows = jnp.asarray(_error_rows(np.asarray(features)), jnp.float32)
    w32 = jnp.asarray(w, jnp.float32)
    options = {"bits": bits, "group_size": group_size}
    errors = []
    for alpha in AWQ_GRID:
        s_cols = jnp.asarray(columns(awq_candidate(x_mean, alpha), per_channel))
        errors.append(
            float(_output_error(w32, rows, s_cols.astype(w32.dtype), **options))
        )
    best = AWQ_GRID[int(np.argmin(errors))]
    return awq_candidate(x_mean, best), errors
