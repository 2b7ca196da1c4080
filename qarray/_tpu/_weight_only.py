"""The weight-only int8 product as a Pallas kernel: x (m, k) times int8
weights streamed from device memory a block at a time.

Few rows of x are bound by the weights' bytes: each (bn, bk) block of int8
weights is read once, converted to bf16 in VMEM (int8 values are exact in
bf16) and multiplied with x's matching columns on the MXU, summing in
float32 across K; the per-output-channel scales multiply the sums at the
last K step. x's precision is a number of bf16 parts (``parts_for``): one
is a TPU's default precision (x rounded to bf16), three represent float32
x to about 2**-24 of each entry, so "highest" costs three passes where
XLA's float32 dot takes six.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# block sides tried, largest first: each must divide the padded axis; int8
# weights tile by (32, 128) on a TPU, float32 x by (8, 128)
K_BLOCKS = (2048, 1024, 512, 256, 128)
N_BLOCKS = (512, 256, 128)
LANES, SUBLANES = 128, 8


def parts_for(precision, platform: str) -> int:
    """bf16 parts of x a product at ``precision`` takes (JAX's meaning):
    "highest" 3, "high" 2, "default" 1; None reads
    ``jax.default_matmul_precision``, and with that unset is the platform's
    default (one pass on a TPU, float32 elsewhere, as CPU dots are)."""
    if isinstance(precision, tuple):
        precision = precision[0]  # x's
    if precision is None:
        default = jax.config.jax_default_matmul_precision
        if default is None:
            return 1 if platform == "tpu" else 3
        try:
            precision = lax.Precision(default)
        except ValueError:
            return 3
    return {lax.Precision.DEFAULT: 1, lax.Precision.HIGH: 2}.get(precision, 3)


def _kernel(x_ref, w_ref, s_ref, o_ref, acc_ref, *, parts: int, nk: bool):
    kk = pl.program_id(1)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    # exact: |int8| <= 127; through float32, as a v5e has no bf16 VPU path
    w = w_ref[...].astype(jnp.float32).astype(jnp.bfloat16)
    dims = (((1,), (1,)) if nk else ((1,), (0,)), ((), ()))
    rest = x_ref[...].astype(jnp.float32)
    total = acc_ref[...]
    for _ in range(parts):  # x = sum of bf16 parts, each what the last left
        part = rest.astype(jnp.bfloat16)
        total += lax.dot_general(part, w, dims, preferred_element_type=jnp.float32)
        rest = rest - part.astype(jnp.float32)
    acc_ref[...] = total

    @pl.when(kk == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = acc_ref[...] * s_ref[...]


def _block(size: int, choices) -> int:
    return next(b for b in choices if size % b == 0)


def _padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("nk", "parts", "interpret"))
def weight_only_product(x, qvalue, scale, *, nk: bool, parts: int, interpret: bool):
    """x f32 (m, k) times int8 weights -> f32 (m, n).

    ``nk``: ``qvalue (n, k)`` with ``scale (n,)`` per output channel
    (``linear_q``: ``(x @ qvalue.T) * scale``); else ``qvalue (k, n)`` with
    ``scale (n,)`` multiplying the output (``matmul_q`` folds its per-row
    scales into x and passes ones). ``parts``: bf16 parts of x
    (``parts_for``). Axes are padded with zeros to the blocks (8 rows, 128
    lanes), which adds nothing to the sums."""
    m, k = x.shape
    n = qvalue.shape[0] if nk else qvalue.shape[1]
    if 0 in (m, k, n):  # nothing to read (an empty contraction sums to 0)
        return jnp.zeros((m, n), jnp.float32)
    mp, kp, np_ = _padded(max(m, 1), SUBLANES), _padded(k, LANES), _padded(n, LANES)
    bk, bn = _block(kp, K_BLOCKS), _block(np_, N_BLOCKS)
    x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    w_pad = ((0, np_ - n), (0, kp - k)) if nk else ((0, kp - k), (0, np_ - n))
    qvalue = jnp.pad(qvalue, w_pad)
    scale = jnp.pad(scale, (0, np_ - n)).reshape(1, np_)
    w_spec = (
        pl.BlockSpec((bn, bk), lambda j, kk: (j, kk))
        if nk
        else pl.BlockSpec((bk, bn), lambda j, kk: (kk, j))
    )
    out = pl.pallas_call(
        functools.partial(_kernel, parts=parts, nk=nk),
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        grid=(np_ // bn, kp // bk),
        in_specs=[
            pl.BlockSpec((mp, bk), lambda j, kk: (0, kk)),
            w_spec,
            pl.BlockSpec((1, bn), lambda j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((mp, bn), lambda j, kk: (0, j)),
        scratch_shapes=[pltpu.VMEM((mp, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary")
        ),
        interpret=interpret,
    )(x, qvalue, scale)
    return out[:m, :n]
