"""Products with int8 weights as Pallas kernels: x (m, k) times int8 weights
streamed from device memory a block at a time, in either layout.

Each (bn, bk) block of weights is read once per block of x's rows and goes
to the MXU in one of two ways (``mxu``):

- ``"bf16"``: converted to bf16 in VMEM (int8 values are exact in bf16) and
  multiplied with x's bf16 parts, summing in float32;
- ``"int8"``: as it is, with x's int8 parts, summing in int32 (exact), at
  the MXU's int8 rate and with nothing to convert. One int8 part is the
  int8-activation product (``quantize_rows(x)``).

x's parts are stacked as rows of one operand (``_layout.stack_parts``), so
the weights enter the MXU once for all of them; their sums meet at the last
K step, times x's row scales and the weights' column scales. Which way and
which blocks win at which rows: ``benchmarks/tpu_kernels.py`` on the chip.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._rules import for_tpu
from ._layout import (
    LANES,
    combine_parts,
    compiler_params,
    divisor_block,
    padded,
    row_blocks,
    stack_parts,
)
from ._parts import bf16_parts, int8_parts

# what each way feeds the MXU and what one block's sums come out in: int8
# sums are exact in int32 for one block of K (127 * 127 * bk < 2**31), and
# the blocks meet in float32, so no K overflows them
MXU = {"bf16": (bf16_parts, jnp.float32), "int8": (int8_parts, jnp.int32)}


def _mxu_weights(w, mxu: str):
    # through float32: a v5e's vector unit has no bf16 path (exact either way)
    return w.astype(jnp.float32).astype(jnp.bfloat16) if mxu == "bf16" else w


def _rows_kernel(x_ref, w_ref, xs_ref, ws_ref, o_ref, acc_ref, *, parts, nk, mxu):
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    dims = (((1,), (1,)) if nk else ((1,), (0,)), ((), ()))
    w = _mxu_weights(w_ref[...], mxu)
    sums = lax.dot_general(x_ref[...], w, dims, preferred_element_type=MXU[mxu][1])
    acc_ref[...] += sums.astype(jnp.float32)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        total = combine_parts(acc_ref[...], xs_ref[...], parts, o_ref.shape[0])
        o_ref[...] = total * ws_ref[...]


def _columns_kernel(w_ref, x_ref, ws_ref, o_ref, acc_ref, *, mxu):
    """The transposed orientation, layout nk: (bn, bk) weights times the
    stacked rows (r, bk) -> (bn, r), the weights as the streamed operand."""
    kk = pl.program_id(1)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    w = _mxu_weights(w_ref[...], mxu)
    sums = lax.dot_general(
        w, x_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=MXU[mxu][1]
    )
    acc_ref[...] += sums.astype(jnp.float32)

    @pl.when(kk == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(jnp.float32) * ws_ref[...]


def _int8_product(
    x,
    qvalue,
    scale,
    *,
    nk: bool,
    mxu: str = "bf16",
    parts: int = 1,
    blocks: tuple[int, int, int] | None = None,
    orient: str = "rows",
    interpret: bool = False,
):
    """x f32 (m, k) times int8 weights -> f32 (m, n).

    ``nk``: ``qvalue (n, k)``, else ``(k, n)``; ``scale (n,)`` multiplies
    output column j (``linear_q``: ``(x @ qvalue.T) * scale``). ``mxu``:
    ``"bf16"`` or ``"int8"`` (module doc); ``parts``: x's parts of that kind
    (``_parts``). ``blocks``: (bm, bn, bk) upper bounds (default: the TPU
    rule's ``int8_blocks``).
    ``orient="columns"`` (layout nk, one block of rows) streams the weights
    as the MXU's left operand. Every axis is padded with zeros to its block."""
    m, k = x.shape
    n = qvalue.shape[0] if nk else qvalue.shape[1]
    if 0 in (m, k, n):  # nothing to read (an empty contraction sums to 0)
        return jnp.zeros((m, n), jnp.float32)
    split = MXU[mxu][0]
    xparts, xscales = split(x, parts)
    bm, bn, bk = blocks
    mp, bm = row_blocks(m, xparts.dtype, bm)
    kp, np_ = padded(k, LANES), padded(n, LANES)
    bk, bn = divisor_block(kp, bk), divisor_block(np_, bn)
    rows, row_scales = stack_parts(xparts, xscales, mp, bm, kp)
    w_pad = ((0, np_ - n), (0, kp - k)) if nk else ((0, kp - k), (0, np_ - n))
    w = jnp.pad(qvalue, w_pad)
    scale = jnp.pad(scale.astype(jnp.float32), (0, np_ - n))
    r = parts * bm  # stacked rows a block
    block_bytes = (r * bk * rows.dtype.itemsize, bn * bk, 3 * r * bn * 4)
    if orient == "columns":
        if not nk or mp != bm:
            raise ValueError("orient='columns' takes layout nk and one block of rows")
        acc = pl.pallas_call(
            functools.partial(_columns_kernel, mxu=mxu),
            out_shape=jax.ShapeDtypeStruct((np_, r), jnp.float32),
            grid=(np_ // bn, kp // bk),
            in_specs=[
                pl.BlockSpec((bn, bk), lambda j, kk: (j, kk)),
                pl.BlockSpec((r, bk), lambda j, kk: (0, kk)),
                pl.BlockSpec((bn, 1), lambda j, kk: (j, 0)),
            ],
            out_specs=pl.BlockSpec((bn, r), lambda j, kk: (j, 0)),
            scratch_shapes=[pltpu.VMEM((bn, r), jnp.float32)],
            compiler_params=compiler_params(*block_bytes, grid_rank=2),
            interpret=interpret,
        )(w, rows, scale.reshape(np_, 1))
        out = combine_parts(acc.T, row_scales, parts, bm)
        return out[:m, :n]
    w_spec = (
        pl.BlockSpec((bn, bk), lambda i, j, kk: (j, kk))
        if nk
        else pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))
    )
    out = pl.pallas_call(
        functools.partial(_rows_kernel, parts=parts, nk=nk, mxu=mxu),
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        grid=(mp // bm, np_ // bn, kp // bk),
        in_specs=[
            pl.BlockSpec((r, bk), lambda i, j, kk: (i, kk)),
            w_spec,
            pl.BlockSpec((r, 1), lambda i, j, kk: (i, 0)),
            pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((r, bn), jnp.float32)],
        compiler_params=compiler_params(*block_bytes),
        interpret=interpret,
    )(rows, w, row_scales, scale.reshape(1, np_))
    return out[:m, :n]


_jitted = jax.jit(
    _int8_product,
    static_argnames=("nk", "mxu", "parts", "blocks", "orient", "interpret"),
)


def int8_product(x, qvalue, scale, *, nk: bool, **options):
    """``_int8_product`` (its doc: the arguments), compiled once per
    combination of the static options, the blocks resolved from the TPU rule
    before the cache is asked (an ``overriding`` in force is a new entry);
    TypeError where the operands' shapes do not agree."""
    if x.ndim != 2 or qvalue.ndim != 2 or qvalue.dtype != jnp.int8:
        raise TypeError(
            f"int8_product takes x (m, k) and int8 weights (2-D), got x {x.shape} "
            f"and {qvalue.dtype}{qvalue.shape}"
        )
    k, n = (qvalue.shape[1], qvalue.shape[0]) if nk else qvalue.shape
    if x.shape[1] != k or scale.shape != (n,):
        layout = "(n, k)" if nk else "(k, n)"
        raise TypeError(
            f"int8_product: x {x.shape}, weights {layout} {qvalue.shape} and "
            f"scale {scale.shape} do not agree (scale (n,))"
        )
    options["blocks"] = options.get("blocks") or for_tpu().int8_blocks
    return _jitted(x, qvalue, scale, nk=nk, **options)
