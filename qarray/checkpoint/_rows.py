"""qarray's quantizers in NumPy, by row chunks, and the weight errors they
report: what model files are written and loaded with (no compilation, and
correctly rounded division)."""

from __future__ import annotations

import numpy as np

from .._kernels import QMAX4


def quantize_rows(
    w: np.ndarray, chunk_rows: int = 256
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row absmax int8, qarray's quantizer in NumPy: ``(qvalue, scale)``
    with ``scale = max|row| / 127``, ``qvalue = round_half_even(w / scale)``
    (an all-zero row: scale 0, qvalue 0).

    NumPy rather than a jitted ``qarray.quantize``: loading a model needs no
    compilation (whose memory a server would keep), and NumPy's division is
    correctly rounded where XLA's may be 1 ulp off (so a row entry exactly on
    a rounding tie can differ by one step between the two). Rows are
    independent, so they go ``chunk_rows`` at a time: the float32 temporaries
    stay a few MB whatever the matrix.
    """
    qvalues, scales = [], []
    for rows in _row_chunks(np.asarray(w), chunk_rows):
        rows = rows.astype(np.float32, copy=False)
        scale = (np.max(np.abs(rows), axis=-1, initial=0) / np.float32(127)).astype(
            np.float32
        )
        divisor = np.where(scale > 0, scale, np.float32(1))[:, None]
        qvalues.append(np.clip(np.round(rows / divisor), -127, 127).astype(np.int8))
        scales.append(scale)
    return np.concatenate(qvalues), np.concatenate(scales)


def quantize_groups(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """qarray's int4 quantizer in NumPy (``quantize(w, bits=4, group_size=G)``):
    ``(packed uint8 (N, K / 2), scale (N, K / G))``, by row chunks."""
    packed, scales = [], []
    for rows in _row_chunks(np.asarray(w), 256):
        groups = rows.astype(np.float32).reshape(rows.shape[0], -1, group_size)
        scale = (np.max(np.abs(groups), axis=-1, initial=0) / np.float32(QMAX4)).astype(
            np.float32
        )
        divisor = np.where(scale > 0, scale, np.float32(1))[..., None]
        values = np.clip(np.round(groups / divisor), -QMAX4, QMAX4).astype(np.int8)
        nibbles = (values.reshape(rows.shape[0], -1).astype(np.int16) & 0xF).astype(
            np.uint8
        )
        packed.append(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4))
        scales.append(scale)
    return np.concatenate(packed), np.concatenate(scales)


def relative_error4(w: np.ndarray, packed: np.ndarray, scale: np.ndarray) -> float:
    """||w - W|| / ||w|| for int4 weights W (packed, one scale per group)."""
    low = (packed & 0xF).astype(np.int16)
    high = (packed >> 4).astype(np.int16)
    values = np.stack([low, high], -1).reshape(packed.shape[0], -1)
    values = np.where(values > 7, values - 16, values).astype(np.float64)
    groups = values.reshape(*scale.shape, -1) * scale.astype(np.float64)[..., None]
    w64 = np.asarray(w, np.float64)
    norm = np.linalg.norm(w64)
    return (
        0.0
        if norm == 0
        else float(np.linalg.norm(w64 - groups.reshape(w.shape)) / norm)
    )


def relative_error(
    w: np.ndarray, qvalue: np.ndarray, scale: np.ndarray, chunk_rows: int = 256
) -> float:
    """||w - qvalue * scale|| / ||w|| in float64 (0 for zero w), by row chunks."""
    err2 = norm2 = 0.0
    for rows, q, s in zip(
        _row_chunks(w, chunk_rows),
        _row_chunks(qvalue, chunk_rows),
        _row_chunks(scale, chunk_rows),
        strict=True,
    ):
        rows = rows.astype(np.float64)
        deq = q.astype(np.float64) * s.astype(np.float64)[:, None]
        err2 += float(np.sum((rows - deq) ** 2))
        norm2 += float(np.sum(rows**2))
    return 0.0 if norm2 == 0 else (err2 / norm2) ** 0.5


def _row_chunks(a: np.ndarray, rows: int):
    return (a[i : i + rows] for i in range(0, max(a.shape[0], 1), rows))
