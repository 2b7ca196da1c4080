"""A candidate for ``qarray/_tpu``'s int4 mode "tile" at many rows, written
without the chip (no device time was left that session): timed beside the
current tile kernel by ``python -m benchmarks.tpu_kernels --only
int4_tile_rows`` (family names ``tile`` and ``candidate tile``), checked
against NumPy in Pallas' interpreter by ``tests/test_bench_tpu.py``.

Why it might lead: the current tile kernel transposes every block of
nibbles so that a group's scale is a row broadcast (two transposes of
(bn, bk2) int32 a block on the chip's XLU). Here each 128-byte chunk is
dequantized where it lies, a group's scale a column broadcast, its low
nibbles into the first half of a bf16 tile in VMEM and its high ones into
the second, against x's entries of each block of K reordered to match (its
even entries, then its odd ones); the scales come as whole rows by block of
K ((K blocks, n, groups a block)). With large row blocks (the
``int4_tile_rows`` sweep: up to 4096 rows) each weight is dequantized once
or a few times a product, where XLA's dequantized dot runs at 0.47x of bf16
at 4096 rows (docs/accelerators.md) and qwix's int4 at 0.83x.

If it leads there, it replaces ``_tile_kernel`` in ``qarray/_tpu/_int4.py``
and the TPU rule's int4 rows past ``int4_bytes_max_rows`` take it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qarray._tpu import _layout
from qarray._tpu._int4 import _unpack, padded_blocks
from qarray._tpu._parts import bf16_head, bf16_parts

_NT = (((1,), (1,)), ((), ()))  # contract the last axes: a (r, c) . b (s, c)


def _chunk_scales(scales, c: int, half: int):
    """The scales of 128-byte chunk ``c`` of a weights' block: scales f32
    (bn, groups of the block) -> (bn, 1) where one group spans the chunk,
    else (bn, 128), each lane its group's scale (a group: ``half`` bytes)."""
    if half >= _layout.LANES:
        g = c * _layout.LANES // half
        return scales[:, g : g + 1]
    first = c * _layout.LANES // half
    lane = lax.broadcasted_iota(jnp.int32, (scales.shape[0], _layout.LANES), 1)
    by_lane = jnp.broadcast_to(scales[:, first : first + 1], lane.shape)
    for t in range(1, _layout.LANES // half):
        by_lane = jnp.where(
            lane >= t * half, scales[:, first + t : first + t + 1], by_lane
        )
    return by_lane


def _kernel(x_ref, w_ref, s_ref, out_ref, acc_ref, w_tile, *, parts, half, per_byte):
    """``x_ref``: x's bf16 parts stacked (parts * bm, 2 bk2), each block of K
    its even entries, then its odd ones; ``w_ref``: packed bytes (bn, bk2);
    ``s_ref``: the block's group scales (bn, groups), or (``per_byte``)
    each byte's group's scale (bn, bk2); ``w_tile``: the dequantized
    weights' bf16 parts (parts, bn, 2 bk2)."""
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    bk2 = w_ref.shape[1]
    scales = None if per_byte else s_ref[...]
    for c in range(bk2 // _layout.LANES):
        cols = slice(c * _layout.LANES, (c + 1) * _layout.LANES)
        by_lane = s_ref[:, cols] if per_byte else _chunk_scales(scales, c, half)
        for h, nibbles in enumerate(_unpack(w_ref[:, cols])):
            w = nibbles.astype(jnp.float32) * by_lane
            at = slice(h * bk2 + c * _layout.LANES, h * bk2 + (c + 1) * _layout.LANES)
            for j in range(parts):  # bf16 parts, exact but the last
                head, w = bf16_head(w) if j < parts - 1 else (w, None)
                w_tile[j, :, at] = head.astype(jnp.bfloat16)
    x, bm = x_ref[...], out_ref.shape[0]
    acc = acc_ref[...]
    for j in range(parts):  # x's parts i < parts - j meet the weights' part j
        sums = lax.dot_general(
            x[: (parts - j) * bm], w_tile[j], _NT, preferred_element_type=jnp.float32
        )
        acc += sums.reshape(parts - j, bm, -1).sum(0)
    acc_ref[...] = acc

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = acc_ref[...]


@functools.partial(
    jax.jit,
    static_argnames=("group_size", "parts", "blocks", "per_byte", "interpret"),
)
def tile_product(
    x, packed, scale, *, group_size, parts=1, blocks, per_byte=False, interpret=False
):
    """x f32 (m, k) times int4 weights (qarray's layout: packed uint8
    (n, k / 2), scale f32 (n, k / G)) -> f32 (m, n); ``blocks``: (bm, bn,
    packed bk) upper bounds, as ``qarray._tpu.int4_product``'s.

    ``per_byte``: each packed byte's scale repeated in device memory (n,
    k / 2), so that a chunk's scales are a plain block, no lane slices of a
    value: four times the bytes of the weights read again per row block, a
    fallback whose time says what the kernel costs should Mosaic refuse the
    column slices."""
    m, k = x.shape
    n, half = packed.shape[0], group_size // 2
    xparts, xscales = bf16_parts(x, parts)
    (mp, bm), (np_, bn), (kp2, bk2) = padded_blocks(
        m, k // 2, n, half, xparts.dtype, blocks
    )
    rows, _ = _layout.stack_parts(xparts, xscales, mp, bm, 2 * kp2)
    rows = rows.reshape(-1, kp2 // bk2, bk2, 2).swapaxes(2, 3).reshape(-1, 2 * kp2)
    w = jnp.pad(packed, ((0, np_ - n), (0, kp2 - packed.shape[1])))
    groups = bk2 // half
    scales = jnp.pad(
        scale.astype(jnp.float32), ((0, np_ - n), (0, kp2 // half - scale.shape[1]))
    )
    if per_byte:
        scales = jnp.repeat(scales, half, axis=1)  # (np, kp2)
        scale_spec = pl.BlockSpec((bn, bk2), lambda i, j, kk: (j, kk))
        scale_bytes = bn * bk2 * 4
    else:
        scales = scales.reshape(np_, kp2 // bk2, groups).transpose(1, 0, 2)
        scale_spec = pl.BlockSpec((None, bn, groups), lambda i, j, kk: (kk, j, 0))
        scale_bytes = bn * groups * 4
    r = parts * bm
    # x's, the bytes' and the scales' blocks, the output's, the bf16 tile,
    # the float32 sums (scratch) and one dot's sums (a temporary)
    params = _layout.compiler_params(
        r * 2 * bk2 * 2,
        bn * bk2,
        scale_bytes,
        bm * bn * 4,
        parts * bn * bk2 * 2,
        bm * bn * 4,
        r * bn * 4,
    )
    out = pl.pallas_call(
        functools.partial(_kernel, parts=parts, half=half, per_byte=per_byte),
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        grid=(mp // bm, np_ // bn, kp2 // bk2),
        in_specs=[
            pl.BlockSpec((r, 2 * bk2), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bn, bk2), lambda i, j, kk: (j, kk)),
            scale_spec,
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[
            pltpu.VMEM((bm, bn), jnp.float32),
            pltpu.VMEM((parts, bn, 2 * bk2), jnp.bfloat16),
        ],
        compiler_params=params,
        interpret=interpret,
    )(rows, w, scales)
    return out[:m, :n]
