"""Array-level (lojax) implementations behind the primitives' ``expand``.

Everything here takes and returns plain arrays: the primitives own the types,
these functions own the arithmetic.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

QMAX = 127.0


def quantize_rows(x):
    """Symmetric per-row absmax quantization.

    x: f32[..., n] -> (qvalue int8[..., n], scale f32[...]) with
    ``scale = max|row| / 127`` and ``qvalue = round_half_even(x / scale)``
    clipped to [-127, 127]. (XLA:CPU's vectorised float32 division is within
    1 ulp, not always correctly rounded: so is ``scale``.)
    """
    scale = jnp.max(jnp.abs(x), axis=-1) / QMAX
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


def _contract_last_first(lhs, rhs, preferred_element_type=None):
    """lhs[..., k] . rhs[k, n] -> [..., n]."""
    dims = (((lhs.ndim - 1,), (0,)), ((), ()))
    return lax.dot_general(
        lhs, rhs, dims, preferred_element_type=preferred_element_type
    )


def matmul_weight_only(x, qvalue, scale):
    """x f32[..., k] @ (qvalue int8[k, n] * scale f32[k]) -> f32[..., n].

    The per-row weight scales run along the contraction axis, so they fold into
    ``x`` and the product runs against the int8 payload.
    """
    return _contract_last_first(x * scale, qvalue.astype(jnp.float32))


def matmul_int8_activations(x, qvalue, scale):
    """Like ``matmul_weight_only``, with ``x * scale`` quantized per row too.

    The product is int8 x int8 with int32 accumulation, rescaled once per
    output row by the activation scale.
    """
    xq, xscale = quantize_rows(x * scale)
    acc = _contract_last_first(xq, qvalue, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * xscale[..., None]
