"""Array-level (lojax) implementations behind the primitives' ``expand``.

Everything here takes and returns plain arrays: the primitives own the types,
these functions own the arithmetic, and the choice of formulation.

How ``matmul_q`` computes ``x[m, k] @ (qvalue[k, n] * scale[k])``
-----------------------------------------------------------------
The per-row weight scales run along the contraction axis, so they always fold
into ``x`` first (``v = x * scale``) and the product runs against the int8
payload. How it runs is a deterministic function of the static shapes, the
``activations`` mode and the backend (``choose_strategy``):

========== ================================ =========================================
strategy   what                             why / accuracy
========== ================================ =========================================
chunked    K in L2-sized row chunks: each   XLA:CPU never fuses an int8 -> f32 convert
           chunk's int8 rows converted to   into a dot: a whole-matrix convert writes a
           f32 and multiplied, accumulated  full f32 copy (4x the int8 bytes). Chunks
           in f32 (``fori_loop``)           keep the copy in cache. Exact f32 math.
split_int8 ``v`` split per row into a high   Two int8 x int8 -> int32 products in one
           and a low int8 part (scale       dot (rows stacked), the fast int8 kernel.
           ``max|v|/127``, then the         ``v`` is represented to ~2e-5 relative,
           residual's): ``v ~ a1 q1 + a2    far below the weights' own quantization.
           q2``
bf16       ``v`` and the int8 payload in    For large M the dot dominates; bf16 with
           bf16, f32 accumulation           f32 accumulation. ``v`` rounded to bf16
                                            (~1.7e-3 relative): weight-only error stays
                                            <= 9e-3 for Gaussian data at K = 4096.
int8_dot   (``activations="int8"``) ``v``   int8 x int8 -> int32, rows padded to a
           quantized per row, one int8 dot  multiple of 8 (XLA:CPU's int8 kernel is
                                            slow for a single row).
dequantize ``v @ qvalue.astype(f32)``       Backends that fuse the convert into the
                                            dot (GPU); the reference formulation.
========== ================================ =========================================

Operands sharded over explicit mesh axes take the ``dequantize`` / plain int8
formulations, which keep every axis in place for sharding propagation. On CPU,
weight-only: ``chunked`` for M < 4 (bandwidth-bound; also no full f32
copy of the weights), ``bf16`` for M >= 256, ``split_int8`` between. With
``activations="int8"``: ``chunked`` on the quantized rows for M = 1,
``int8_dot`` otherwise. Elsewhere: ``dequantize`` (weight-only) and
``int8_dot``. The measurements behind these thresholds are in
``benchmarks/`` (``make bench``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

QMAX = 127.0

WEIGHT_ONLY_STRATEGIES = ("chunked", "split_int8", "bf16", "dequantize")
INT8_STRATEGIES = ("chunked", "int8_dot")

# a chunk's f32 copy of int8 rows stays within this many bytes (L2-sized)
CHUNK_BYTES = 2 * 1024 * 1024


def quantize_rows(x):
    """Symmetric per-row absmax quantization.

    x: f32[..., n] -> (qvalue int8[..., n], scale f32[...]) with
    ``scale = max|row| / 127`` and ``qvalue = round_half_even(x / scale)``
    clipped to [-127, 127]. (XLA:CPU's vectorised float32 division is within
    1 ulp, not always correctly rounded: so is ``scale``.)
    """
    scale = jnp.max(jnp.abs(x), axis=-1, initial=0.0) / QMAX
    # an all-zero row has scale 0: divide by 1 instead, so its qvalues are 0
    # rather than NaN (NaN -> int8 casts are platform-defined)
    divisor = jnp.where(scale > 0, scale, 1.0)[..., None]
    scaled = jnp.round(x / divisor)
    # NaN entries (only reachable by calling the library with NaN) become 0
    scaled = jnp.where(jnp.isnan(scaled), 0.0, scaled)
    qvalue = jnp.clip(scaled, -QMAX, QMAX).astype(jnp.int8)
    return qvalue, scale


def dequantize_rows(qvalue, scale):
    """int8[..., n], f32[...] -> f32[..., n]: ``qvalue * scale[..., None]``."""
    return qvalue.astype(jnp.float32) * scale[..., None]


def choose_strategy(m: int, k: int, n: int, activations: str, platform: str) -> str:
    """The formulation ``matmul`` uses for x[m, k] @ q8[k, n] (see module doc)."""
    del k, n  # the thresholds measured so far depend on M alone
    if platform != "cpu":
        return "int8_dot" if activations == "int8" else "dequantize"
    if activations == "int8":
        return "chunked" if m == 1 else "int8_dot"
    if m < 4:
        return "chunked"
    return "bf16" if m >= 256 else "split_int8"


def matmul(x, qvalue, scale, activations="float32", strategy=None):
    """x f32[..., k] @ (qvalue int8[k, n] * scale f32[k]) -> f32[..., n].

    ``activations="int8"`` quantizes ``x * scale`` per row first. ``strategy``
    forces a formulation (tests, benchmarks); by default ``choose_strategy``
    picks one per backend at lowering time.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = qvalue.shape[1]
    m = math.prod(lead)
    if _explicitly_sharded(x) or _explicitly_sharded(qvalue):
        return _sharded(x * scale, qvalue, activations)
    v = (x * scale).reshape(m, k)  # per-row weight scales fold into x
    if activations == "int8":
        xq, xscale = quantize_rows(v)
        run = lambda s: _int8_activations(xq, xscale, qvalue, s)  # noqa: E731
    else:
        run = lambda s: _weight_only(v, qvalue, s)  # noqa: E731
    if strategy is not None:
        y = run(strategy)
    else:
        cpu, other = (choose_strategy(m, k, n, activations, p) for p in ("cpu", "gpu"))
        y = (
            run(cpu)
            if cpu == other
            else lax.platform_dependent(
                cpu=lambda: run(cpu), default=lambda: run(other)
            )
        )
    return y.reshape(*lead, n)


def _explicitly_sharded(a) -> bool:
    """Whether ``a``'s type partitions an axis over an explicit mesh axis."""
    return any(p is not None for p in jax.typeof(a).sharding.spec)


def _sharded(v, qvalue, activations):
    """The plain formulations, rank kept: explicit sharding propagates through
    them as the typing rule declared (rows like x's, columns like qvalue's),
    where padding, stacking or reshaping rows would need resharding."""
    dims = (((v.ndim - 1,), (0,)), ((), ()))
    if activations == "int8":
        xq, xscale = quantize_rows(v)
        acc = lax.dot_general(xq, qvalue, dims, preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * xscale[..., None]
    return lax.dot_general(v, qvalue.astype(jnp.float32), dims)


def _weight_only(v, qvalue, strategy):
    if strategy == "chunked":
        return _chunked(v, qvalue)
    if strategy == "split_int8":
        return _split_int8(v, qvalue)
    if strategy == "bf16":
        return _dot(v.astype(jnp.bfloat16), qvalue.astype(jnp.bfloat16), jnp.float32)
    if strategy == "dequantize":
        return _dot(v, qvalue.astype(jnp.float32))
    raise ValueError(f"unknown weight-only strategy {strategy!r}")


def _int8_activations(xq, xscale, qvalue, strategy):
    if strategy == "chunked":
        acc = _chunked(xq.astype(jnp.float32), qvalue)  # integer sums, in f32
    elif strategy == "int8_dot":
        acc = _int8_dot(xq, qvalue).astype(jnp.float32)
    else:
        raise ValueError(f"unknown int8-activation strategy {strategy!r}")
    return acc * xscale[:, None]


def _dot(lhs, rhs, preferred_element_type=None):
    """lhs[m, k] . rhs[k, n] -> [m, n]."""
    dims = (((1,), (0,)), ((), ()))
    return lax.dot_general(
        lhs, rhs, dims, preferred_element_type=preferred_element_type
    )


def _int8_dot(lhs_q, qvalue):
    """int8[m, k] . int8[k, n] -> int32[m, n], rows padded to a multiple of 8."""
    m = lhs_q.shape[0]
    pad = -m % 8
    acc = _dot(jnp.pad(lhs_q, ((0, pad), (0, 0))), qvalue, jnp.int32)
    return acc[:m]


def _split_int8(v, qvalue):
    """v f32[m, k] @ int8[k, n] as two int8 products: v ~ a1 q1 + a2 q2 per row."""
    m = v.shape[0]
    q1, a1 = quantize_rows(v)
    q2, a2 = quantize_rows(v - dequantize_rows(q1, a1))
    acc = _int8_dot(jnp.concatenate([q1, q2]), qvalue).astype(jnp.float32)
    return acc[:m] * a1[:, None] + acc[m:] * a2[:, None]


def _chunked(v, qvalue):
    """v f32[m, k] @ int8[k, n] -> f32[m, n], converting K-chunks of rows."""
    k = v.shape[1]
    n = qvalue.shape[1]
    chunk = max(
        8, min(1024, 2 ** int(math.log2(max(1, CHUNK_BYTES // (4 * max(n, 1))))))
    )
    chunk = min(chunk, max(k, 1))
    full = k // chunk

    if k == 0:
        return _dot(v, qvalue.astype(jnp.float32))

    def chunk_product(i):
        start = i * chunk
        rows = lax.dynamic_slice_in_dim(qvalue, start, chunk, axis=0)
        cols = lax.dynamic_slice_in_dim(v, start, chunk, axis=1)
        return _dot(cols, rows.astype(jnp.float32))

    # start from the first chunk's product rather than zeros: the carry then
    # has the operands' type (inside shard_map, their varying axes) from the start
    acc = chunk_product(0)
    acc = lax.fori_loop(1, full, lambda i, acc: acc + chunk_product(i), acc)
    if k % chunk:  # the last partial chunk
        tail = full * chunk
        acc = acc + _dot(v[:, tail:], qvalue[tail:].astype(jnp.float32))
    return acc
