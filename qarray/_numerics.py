"""qarray's numerics, defined once: the int8 row quantizer, the int4 group
quantizer and its nibble packing, dequantizing, and the relative weight
error, each in jnp (traced: the primitives, ``qarray.nn``) and in NumPy
(model files: no compilation, and correctly rounded division).

int8, per row: ``scale = max|row| / QMAX``, ``qvalue = round_half_even(x /
scale)`` clipped to ``[-QMAX, QMAX]``; an all-zero row has scale 0 and
qvalues 0 (the division is guarded), and NaN entries quantize to 0: XLA
converts a NaN to integer 0 on every platform, so the traced forms leave it
to the cast (a select per entry cost W8A8's x 3-4% on a TPU: docs/
accelerators.md), where NumPy's cast is undefined and its forms select 0.

int4, per group of ``G`` entries of a row: the same with ``QMAX4``, values
in ``[-7, 7]`` packed two a byte as 4-bit two's complement, the low nibble
holding the even index.

The C++ kernels' one row quantizer (``qarray/_cpu/quantize_row.h``, NaN rows
included) computes the same values; ``tests/qarray/test_cpu_kernels.py`` and
the C++ test program (``make test-kernels``) hold them to these.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

QMAX = 127.0  # int8 values in [-QMAX, QMAX]
# terms of int8 x int8 products whose sum int32 holds exactly, whatever
# their signs: QMAX * QMAX each
INT32_EXACT_TERMS = int((2**31 - 1) // (QMAX * QMAX))
QMAX4 = 7.0  # int4 values in [-QMAX4, QMAX4]
NUMPY_ROWS = 256  # NumPy quantizers: rows at a time (temporaries stay small)


# --- the quantizer, once: jnp (traced) or NumPy arrays alike


def on_grid(x, step, qmax: float, xp=jnp):
    """``round_half_even(x / step)`` clipped to ``[-qmax, qmax]`` (float):
    ``x``'s levels on a grid of ``step`` (broadcast against ``x``)."""
    return xp.clip(xp.round(x / step), -qmax, qmax)


def absmax(x, qmax: float, xp=jnp):
    """x f32[..., g] -> (levels int8[..., g], scale f32[...]): each group
    along the last axis on the grid of ``max|group| / qmax`` (module doc: a
    zero group has scale 0, NaN entries level 0). ``xp``: ``jnp`` (traced;
    XLA:CPU's vectorised float32 division is within 1 ulp, not always
    correctly rounded: so is ``scale``) or ``np`` (correctly rounded)."""
    scale = (xp.max(xp.abs(x), axis=-1, initial=0) / xp.float32(qmax)).astype(
        xp.float32
    )
    divisor = xp.where(scale > 0, scale, xp.float32(1))[..., None]
    levels = on_grid(x, divisor, qmax, xp)
    if xp is not jnp:  # module doc: XLA's cast gives NaN 0, NumPy's is undefined
        levels = xp.where(xp.isnan(levels), 0, levels)
    return levels.astype(xp.int8), scale


# --- jnp (traced)


def quantize_rows(x):
    """x f32[..., n] -> (qvalue int8[..., n], scale f32[...]), per row
    (module doc)."""
    return absmax(x, QMAX)


def dequantize_rows(qvalue, scale):
    """int8[..., n], f32[...] -> f32[..., n]: ``qvalue * scale[..., None]``."""
    return qvalue.astype(jnp.float32) * scale[..., None]


def quantize_groups(x, group_size: int):
    """x f32[..., n] -> (uint8[..., n / 2], scale f32[..., n / G]): int4 per
    group of ``group_size`` entries of a row, packed (module doc)."""
    *lead, n = x.shape
    values, scale = absmax(x.reshape(*lead, n // group_size, group_size), QMAX4)
    return pack_nibbles(values.reshape(*lead, n)), scale


def pack_nibbles(values):
    """int8[..., n] in [-8, 7] -> uint8[..., n / 2]: low nibble = even index
    (jnp or NumPy arrays alike)."""
    nibbles = (values.astype(np.int16) & 0xF).astype(np.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_nibbles(packed):
    """uint8[..., n / 2] -> int8[..., n]: each nibble as 4-bit two's complement."""
    low = ((packed & 0xF) ^ 8).astype(jnp.int8) - 8
    high = ((packed >> 4) ^ 8).astype(jnp.int8) - 8
    return jnp.stack([low, high], axis=-1).reshape(
        *packed.shape[:-1], 2 * packed.shape[-1]
    )


def dequantize_groups(packed, scale):
    """uint8[..., n / 2], f32[..., n / G] -> f32[..., n]: each value times
    its group's scale."""
    values = unpack_nibbles(packed).astype(jnp.float32)
    return _scaled_by_group(values, scale)


def _scaled_by_group(values, scale):
    """f32[..., n] values, f32[..., n / G] scales -> f32[..., n]: each group
    of G entries times its scale (n = 0 rows hold no group)."""
    *lead, n = values.shape
    groups = scale.shape[-1]
    size = n // groups if groups else 0
    return (values.reshape(*lead, groups, size) * scale[..., None]).reshape(*lead, n)


def as_int4(packed):
    """uint8[..., n / 2] -> jnp.int4[..., n], the same bytes: a bitcast (the
    low nibble is the even entry in both)."""
    nibbles = lax.bitcast_convert_type(packed, jnp.int4)
    return nibbles.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_groups_bf16(packed, scale):
    """``dequantize_groups`` rounded once to bf16, the bytes read as
    ``jnp.int4`` (``as_int4``): on a TPU the bitcast is a relayout of the
    weights in device memory, and still XLA ran this ahead of
    ``unpack_nibbles``' shifts at every row timed (docs/accelerators.md, the
    int4 rows). The product with each group's scale is float32's, as
    ``dequantize_groups``'."""
    values = as_int4(packed).astype(jnp.float32)
    return _scaled_by_group(values, scale).astype(jnp.bfloat16)


def relative_error(w, w_hat):
    """``||w - w_hat|| / ||w||`` (0 for zero ``w``)."""
    norm = jnp.linalg.norm(w)
    return jnp.linalg.norm(w - w_hat) / jnp.where(norm > 0, norm, 1)


# --- NumPy (model files), by row chunks


def quantize_rows_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``quantize_rows`` in NumPy, ``NUMPY_ROWS`` rows at a time: model files
    need no compilation (whose memory a server would keep), and NumPy's
    division is correctly rounded where XLA's may be 1 ulp off (a row entry
    exactly on a rounding tie can differ by one step between the two)."""
    chunks = [
        absmax(rows.astype(np.float32, copy=False), QMAX, np)
        for rows in _row_chunks(np.asarray(w))
    ]
    return tuple(np.concatenate(parts) for parts in zip(*chunks, strict=True))


def quantize_groups_np(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``quantize_groups`` in NumPy (2-D ``w``): ``(packed uint8 (N, K / 2),
    scale (N, K / G))``."""
    packed, scales = [], []
    for rows in _row_chunks(np.asarray(w)):
        groups = rows.astype(np.float32).reshape(rows.shape[0], -1, group_size)
        values, scale = absmax(groups, QMAX4, np)
        packed.append(pack_nibbles(values.reshape(rows.shape[0], -1)))
        scales.append(scale)
    return np.concatenate(packed), np.concatenate(scales)


def relative_error_np(w: np.ndarray, qvalue: np.ndarray, scale: np.ndarray) -> float:
    """``||w - qvalue * scale|| / ||w||`` in float64 (0 for zero w), int8
    weights with one scale per row."""
    err2 = norm2 = 0.0
    for rows, q, s in zip(
        _row_chunks(w), _row_chunks(qvalue), _row_chunks(scale), strict=True
    ):
        rows = rows.astype(np.float64)
        deq = q.astype(np.float64) * s.astype(np.float64)[:, None]
        err2 += float(np.sum((rows - deq) ** 2))
        norm2 += float(np.sum(rows**2))
    return 0.0 if norm2 == 0 else (err2 / norm2) ** 0.5


def relative_error4_np(w: np.ndarray, packed: np.ndarray, scale: np.ndarray) -> float:
    """``||w - W|| / ||w||`` for int4 weights W (packed, one scale per group)."""
    low = (packed & 0xF).astype(np.int16)
    high = (packed >> 4).astype(np.int16)
    values = np.stack([low, high], -1).reshape(packed.shape[0], -1)
    values = np.where(values > 7, values - 16, values).astype(np.float64)
    groups = values.reshape(*scale.shape, -1) * scale.astype(np.float64)[..., None]
    w64 = np.asarray(w, np.float64)
    norm = np.linalg.norm(w64)
    if norm == 0:
        return 0.0
    return float(np.linalg.norm(w64 - groups.reshape(w.shape)) / norm)


def _row_chunks(a: np.ndarray, rows: int = NUMPY_ROWS):
    return (a[i : i + rows] for i in range(0, max(a.shape[0], 1), rows))
