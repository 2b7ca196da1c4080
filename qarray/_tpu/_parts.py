"""x as a sum of parts the MXU takes: bf16 parts, or int8 parts with a scale
per row. The number of parts is the precision a product asks for.

One bf16 part is x rounded to bf16 (2**-9 of each entry, a TPU's default
pass); each further part is what the previous ones left over, rounded the
same way, so three carry float32's 24 bits exactly. An int8 part quantizes,
per row, what the previous parts left over (``split_int8`` on CPU): two
reach ~(1/254)**2 of each row's largest entry, finer than one bf16 pass for
all but rows whose entries span more than ~100x; three reach float32's
precision at the scale of the row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._numerics import dequantize_rows, on_grid, quantize_rows

# int8 parts standing in for the bf16 parts of each precision: one int8
# part is coarser than one bf16 pass (module doc), so the default takes two
# where a kernel takes no bf16 x (int4's bytes kernel); int8 weights take
# the default's one bf16 part itself
INT8_PARTS = {1: 2, 2: 3, 3: 3}


# JAX's dot algorithms by name (jax.default_matmul_precision takes them):
# the bf16 parts that carry at least the precision each asks for
ALGORITHM_PARTS = {
    "BF16_BF16_BF16": 1,
    "BF16_BF16_F32": 1,
    "ANY_F8_ANY_F8_F32": 1,
    "ANY_F8_ANY_F8_ANY": 1,
    "BF16_BF16_F32_X3": 2,
    "F16_F16_F16": 2,  # 11 bits: two bf16 parts carry 16
    "F16_F16_F32": 2,
    "TF32_TF32_F32": 2,
}


def parts_for(precision, platform: str) -> int:
    """bf16 parts of x a product at ``precision`` takes (JAX's meaning):
    "highest" 3, "high" 2, "default" 1; None reads
    ``jax.default_matmul_precision`` (a precision or a dot algorithm's name:
    ``ALGORITHM_PARTS``, float32's three for any other), and with that unset
    is the platform's default (one pass on a TPU, float32 elsewhere, as CPU
    dots are)."""
    if isinstance(precision, tuple):
        precision = precision[0]  # x's
    if precision is None:
        default = jax.config.jax_default_matmul_precision
        if default is None:
            return 1 if platform == "tpu" else 3
        if default.upper() in ALGORITHM_PARTS:
            return ALGORITHM_PARTS[default.upper()]
        try:
            precision = lax.Precision(default)
        except ValueError:
            return 3
    return {lax.Precision.DEFAULT: 1, lax.Precision.HIGH: 2}.get(precision, 3)


def bf16_head(v):
    """v f32 (any shape) -> (head, rest) f32: ``head`` is v rounded to
    bf16's 8 significant bits (to nearest, ties to even, as a float32 ->
    bf16 conversion rounds; exact as bf16) and ``rest = v - head`` exactly,
    so three heads carry all of float32's 24 bits.

    The rounding is integer arithmetic on v's bits. A float32 -> bf16 ->
    float32 round trip is one a compiler may drop (excess precision): XLA on
    a TPU did, for x's parts, and Mosaic did, for the tile kernel's weights,
    leaving every later part 0 (seen on a v5e: 2e-3 where three parts give
    1e-7). Integer operations are kept, in XLA and inside kernels."""
    v = v.astype(jnp.float32)
    bits = lax.bitcast_convert_type(v, jnp.int32)
    # add half a bf16 step (less one, plus the kept bit: ties to even), then
    # drop the 16 low bits; finite v only (x and weights are)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    head = lax.bitcast_convert_type(bits & jnp.int32(-65536), jnp.float32)
    return head, v - head


def bf16_parts(x, count: int):
    """x f32 (m, k) -> (parts bf16 (count, m, k), scales f32 (count, m) = 1)."""
    parts, rest = [], x.astype(jnp.float32)
    for _ in range(count):
        part, rest = bf16_head(rest)
        parts.append(part.astype(jnp.bfloat16))  # exact: on bf16's grid
    return jnp.stack(parts), jnp.ones((count, x.shape[0]), jnp.float32)


def int8_parts(x, count: int):
    """x f32 (m, k) -> (parts int8 (count, m, k), scales f32 (count, m)):
    x ~ sum_i parts[i] * scales[i][:, None]. One part is ``quantize_rows(x)``,
    the int8-activation product's quantization."""
    parts, scales, rest = [], [], x.astype(jnp.float32)
    for _ in range(count):
        q, s = quantize_rows(rest)
        parts.append(q)
        scales.append(s)
        rest = rest - dequantize_rows(q, s)
    return jnp.stack(parts), jnp.stack(scales)


# int8_pair's ratio of its two parts' scales: the largest whole number whose
# second part stays within int8 (what the first leaves is at most half its
# step: 254 / 2 = 127 steps of the second)
PAIR_RATIO = 254


def int8_pair(x):
    """x f32 (m, k) -> (parts int8 (2, m, k), scales f32 (2, m)), the
    contract of ``int8_parts(x, 2)`` whose parts are the two int8 halves of
    one 16-bit quantization per row: x ~ scales[1] * (254 * parts[0] +
    parts[1]) (``scales[0]``: ``scales[1] * 254`` in float32). A kernel may
    then sum part 0's products times 254 and part 1's in int32 and scale them
    once (int4's bytes kernel, ``pair``). Its precision is two int8 parts':
    ~(1/254)**2 of each row's largest entry."""
    x = x.astype(jnp.float32)
    high, coarse = quantize_rows(x)
    fine = coarse / PAIR_RATIO
    coarse = fine * PAIR_RATIO
    rest = x - dequantize_rows(high, coarse)
    step = jnp.where(fine > 0, fine, 1)[:, None]
    low = on_grid(rest, step, 127).astype(jnp.int8)
    return jnp.stack([high, low]), jnp.stack([coarse, fine])
