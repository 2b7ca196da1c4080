"""Products with int4 weights (qarray's layout: two nibbles a byte along K,
the low one the even entry; one float32 scale per group of G entries of a
row) as Pallas kernels, layout nk: x (m, k) times packed (n, k / 2).

The packed bytes stream from device memory a block at a time and their
nibbles are unpacked in VMEM, never in HBM. Two ways to apply the group
scales (``mode``):

- ``"groups"``: the nibbles go to the MXU as they are (exact) and each
  group's partial sums are scaled on their way into the float32 sums. On
  the int8 MXU with G a multiple of 128 (``reads_bytes``), the bytes are
  read four to a 32-bit word: two bitwise operations give every byte's low
  or high nibble times 16 as int8, and each group's operand is its low
  nibbles then its high ones, against x's entries reordered to match
  (``_bytes_kernel``). Otherwise each byte is widened and shifted, x is
  split into its even and odd entries (the low nibbles meet the even ones),
  and where a 128-byte chunk holds several groups x's rows come in copies,
  each zeroed outside one group's lanes (``_groups_kernel``).
- ``"tile"``: each block of weights is dequantized in VMEM where it lies
  (a group's scale a column broadcast), split into bf16 parts, and
  multiplied with x's bf16 parts: XLA's dequantized product, the weights
  never written back (``_tile_kernel``). It also computes the VJP's
  product for x, y_bar (m, n) @ W (``nk=False``), the sums over N.

Mode groups also takes weights held as ``jnp.int4`` (n, k) (``as_int4``),
whose blocks Mosaic unpacks itself; qarray holds its bytes, and bitcasting
them in a program relayouts the weights in HBM.

Which form and blocks win at which rows: ``benchmarks/tpu_kernels.py``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._rules import for_tpu
from . import _layout
from ._int8 import MXU
from ._parts import PAIR_RATIO, bf16_head, bf16_parts, int8_pair

_NT = (((1,), (1,)), ((), ()))  # contract the last axes: a (r, c) . b (s, c)
_NN = (((1,), (0,)), ((), ()))  # a (r, c) . b (c, s)


def _unpack(packed):
    """uint8 (a, b) -> (low, high) int32 (a, b), each nibble as 4-bit two's
    complement."""
    v = packed.astype(jnp.int32)
    return (v << 28) >> 28, (v << 24) >> 28


def _mxu_nibbles(v, mxu: str):
    return (
        v.astype(jnp.float32).astype(jnp.bfloat16)
        if mxu == "bf16"
        else v.astype(jnp.int8)
    )


# each byte's high nibble, four bytes to a 32-bit word (0xF0F0F0F0)
_HIGH_NIBBLES = -0x0F0F0F10


def _byte_nibbles(block):
    """uint8 (a, c) packed bytes -> (low, high) int32 words (a / 4, c),
    four bytes a word, whose bytes masked by ``_HIGH_NIBBLES`` are each
    byte's low nibble times 16 (``low``: shifted up) or its high nibble
    times 16 (``high``), as int8 exactly (the nibble's bits in the byte's
    high half). A shift and a mask a word unpack four bytes, where
    ``_unpack`` widens every byte to a word of its own."""
    words = pltpu.bitcast(block, jnp.int32)
    return words << 4, words


def _groups_kernel(*refs, parts, mxu, width, nibbles):
    """refs: x's operands, the weights' block, its scales (groups, bn), x's
    row scales, the output, the sums. ``width``: a group's lanes in the
    weights' block. ``nibbles``: "shifts" pairs x's even entries (e) with
    the low nibbles and its odd ones (o) with the high; "int4" takes x as it
    is against jnp.int4 weights."""
    *x_refs, w_ref, s_ref, xs_ref, out_ref, acc_ref = refs
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    weights = _unpack(w_ref[...]) if nibbles == "shifts" else [w_ref[...]]
    pairs = [
        (x[...], _mxu_nibbles(w, mxu)) for x, w in zip(x_refs, weights, strict=True)
    ]
    scales = s_ref[...]
    copies = max(1, _layout.LANES // width)  # groups in a 128-lane chunk
    r = acc_ref.shape[0]  # x's rows of one copy
    acc = acc_ref[...]
    for c in range(w_ref.shape[1] // _layout.LANES):
        cols = slice(c * _layout.LANES, (c + 1) * _layout.LANES)
        sums = sum(
            lax.dot_general(
                x[:, cols], w[:, cols], _NT, preferred_element_type=MXU[mxu][1]
            )
            for x, w in pairs
        )
        for s in range(copies):
            g = (c * _layout.LANES + s * width) // width  # the group, within the block
            acc += sums[s * r : (s + 1) * r].astype(jnp.float32) * scales[g : g + 1]
    acc_ref[...] = acc

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = _layout.combine_parts(
            acc_ref[...], xs_ref[...], parts, out_ref.shape[0]
        )


def _bytes_kernel(
    x_ref, w_ref, s_ref, xs_ref, out_ref, acc_ref, *, parts, half, live, pair
):
    """Mode groups on qarray's bytes with the int8 MXU (``reads_bytes``).
    Each group's operand is its low nibbles, then its high ones, each
    times 16 (``_byte_nibbles``), against x's entries of that group in the
    same order (its even entries, then its odd ones: ``_halves_by_group``):
    one int8 product a group's 128 entries, each weight entering the MXU
    once and no byte widened. ``s_ref``: the group scales / 16 (groups, bn).

    Each group's sums are scaled on the vector unit, the kernel's main cost
    past a few rows, so only x's ``live`` rows of each part are (its rows
    padded to 8, where int8's tiles pad them to 32); with ``pair`` (x as
    ``int8_pair``, where ``takes_pair``) the two parts' sums meet in int32
    first, exactly, one scaled array where two were. ``xs_ref``: the row
    scales of the rows kept (``pair``: part 1's)."""
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    low, high = _byte_nibbles(w_ref[...])  # words (bn / 4, bk2)
    lanes, turn = _layout.LANES, _layout.LANES // 2
    if half == turn:
        # two groups a 128-byte chunk: a half-turn of the block's lanes
        # brings each group's halves together, the even groups' operands in
        # one array, the odd groups' in the other
        lane = lax.broadcasted_iota(jnp.int32, low.shape, 1) % lanes
        first = lane < turn
        arrays = [
            jnp.where(first, low, pltpu.roll(high, turn, 1)),
            jnp.where(first, pltpu.roll(low, low.shape[1] - turn, 1), high),
        ]
    else:  # whole chunks a group: its low chunks, then its high ones
        arrays = [low, high]
    # the block's operands as int8, unpacked once (each nibble times 16)
    operands = [pltpu.bitcast(a & _HIGH_NIBBLES, jnp.int8) for a in arrays]
    x, scales = x_ref[...], s_ref[...]
    bm = x.shape[0] // parts
    kept = [slice(p * bm, p * bm + live) for p in range(parts)]
    accs = [acc_ref[i * live : (i + 1) * live] for i in range(1 if pair else parts)]
    for g in range(scales.shape[0]):
        start = 2 * half * g  # the group's entries in x's block
        if half == turn:
            chunk = g // 2 * lanes
            pieces = [(start, operands[g % 2][:, chunk : chunk + lanes])]
        else:
            pieces = [
                (start + h * half + c, w[:, g * half + c : g * half + c + lanes])
                for h, w in enumerate(operands)
                for c in range(0, half, lanes)
            ]
        sums = sum(
            lax.dot_general(
                x[:, at : at + lanes], w, _NT, preferred_element_type=jnp.int32
            )
            for at, w in pieces
        )
        rows = [sums[r] for r in kept]
        if pair:
            rows = [rows[0] * PAIR_RATIO + rows[1]]
        accs = [
            a + r.astype(jnp.float32) * scales[g : g + 1]
            for a, r in zip(accs, rows, strict=True)
        ]
    for i, a in enumerate(accs):
        acc_ref[i * live : (i + 1) * live] = a

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = _layout.combine_parts(acc_ref[...], xs_ref[...], len(accs), live)


def takes_pair(group_size: int) -> bool:
    """Whether the bytes kernel may take x as ``int8_pair`` for groups of
    ``group_size`` entries: a group's sums of part 0's products times 254
    plus part 1's stay exact in int32 (each entry at most 255 * 127 * 128,
    a nibble coming times 16): G up to 516, so 512 of the multiples of
    128 the bytes kernel takes."""
    return (PAIR_RATIO + 1) * 127 * 128 * group_size < 2**31


def reads_bytes(group_size: int, mxu: str) -> bool:
    """Whether mode groups reads qarray's bytes a word at a time
    (``_bytes_kernel``: the int8 MXU, G a multiple of 128) rather than
    unpacking each by shifts."""
    return mxu == "int8" and group_size % _layout.LANES == 0


def _halves_by_group(rows, half: int):
    """rows (r, c) -> (r, c), each group of 2 * half entries reordered as its
    even entries, then its odd ones (the order of ``_bytes_kernel``'s
    operands: low nibbles, then high)."""
    r, c = rows.shape
    return rows.reshape(r, c // (2 * half), half, 2).swapaxes(2, 3).reshape(r, c)


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


def _tile_kernel(x_ref, w_ref, s_ref, out_ref, acc_ref, w_tile, *, parts, half, nk):
    """Mode tile. ``w_ref``: packed bytes (bn, bk2); ``s_ref``: the block's
    group scales (bn, groups); ``w_tile``: the dequantized weights' bf16
    parts (parts, bn, 2 bk2). ``nk``: ``x_ref`` holds x's bf16 parts stacked
    (parts * bm, 2 bk2), each block of K its even entries, then its odd
    ones, and the sums run over K; else (the VJP's ``y_bar @ W``) ``x_ref``
    holds y_bar's parts (parts * bm, bn), the sums run over N and come out
    (bm, 2 bk2) in the tile's order. The grid's last axis is the sums'.

    Each 128-byte chunk is dequantized where it lies, a group's scale a
    column broadcast (no transposes), its low nibbles into the first half of
    the bf16 tile and its high ones into the second; large row blocks
    dequantize each weight once or a few times a product."""
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    bk2 = w_ref.shape[1]
    scales = s_ref[...]
    for c in range(bk2 // _layout.LANES):
        cols = slice(c * _layout.LANES, (c + 1) * _layout.LANES)
        by_lane = _chunk_scales(scales, c, half)
        for h, nibbles in enumerate(_unpack(w_ref[:, cols])):
            w = nibbles.astype(jnp.float32) * by_lane
            at = slice(h * bk2 + c * _layout.LANES, h * bk2 + (c + 1) * _layout.LANES)
            for j in range(parts):  # bf16 parts, exact but the last
                head, w = bf16_head(w) if j < parts - 1 else (w, None)
                w_tile[j, :, at] = head.astype(jnp.bfloat16)
    x, bm = x_ref[...], out_ref.shape[0]
    dims = _NT if nk else _NN
    acc = acc_ref[...]
    for j in range(parts):  # x's parts i < parts - j meet the weights' part j
        sums = lax.dot_general(
            x[: (parts - j) * bm], w_tile[j], dims, preferred_element_type=jnp.float32
        )
        acc += sums.reshape(parts - j, bm, -1).sum(0)
    acc_ref[...] = acc

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = acc_ref[...]


def _tile_product(
    x, packed, scale, *, half: int, parts: int, blocks, nk: bool, interpret
):
    """Mode tile (``_tile_kernel``), x and the dequantized weights each in
    ``parts`` bf16 parts, qarray's int4 bytes (n, k / 2) and scales
    (n, k / G): ``nk``, x f32 (m, k) -> x @ W.T f32 (m, n); else x f32
    (m, n) (the VJP's y_bar) -> x @ W f32 (m, k)."""
    m = x.shape[0]
    n, k2 = packed.shape
    xparts, xscales = bf16_parts(x, parts)
    (mp, bm), (np_, bn), (kp2, bk2) = padded_blocks(
        m, k2, n, half, xparts.dtype, blocks, group_rows=1
    )
    if nk:
        rows, _ = _layout.stack_parts(xparts, xscales, mp, bm, 2 * kp2)
        # each block of K: its even entries, then its odd ones (the tile's)
        rows = rows.reshape(-1, kp2 // bk2, bk2, 2).swapaxes(2, 3)
        rows = rows.reshape(-1, 2 * kp2)
    else:
        rows, _ = _layout.stack_parts(xparts, xscales, mp, bm, np_)
    w = jnp.pad(packed, ((0, np_ - n), (0, kp2 - k2)))
    groups = bk2 // half
    scales = jnp.pad(
        scale.astype(jnp.float32), ((0, np_ - n), (0, kp2 // half - scale.shape[1]))
    )
    # by block of K, whole rows: (K blocks, n, groups a block)
    scales = scales.reshape(np_, kp2 // bk2, groups).transpose(1, 0, 2)
    r = parts * bm
    if nk:  # grid (rows, N, K): the sums over K
        grid = (mp // bm, np_ // bn, kp2 // bk2)
        x_spec = pl.BlockSpec((r, 2 * bk2), lambda i, j, kk: (i, kk))
        w_index = lambda i, j, kk: (j, kk)  # noqa: E731
        out_spec = pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j))
        out_shape, out_block = (mp, np_), (bm, bn)
    else:  # grid (rows, K, N): the sums over N
        grid = (mp // bm, kp2 // bk2, np_ // bn)
        x_spec = pl.BlockSpec((r, bn), lambda i, kk, j: (i, j))
        w_index = lambda i, kk, j: (j, kk)  # noqa: E731
        out_spec = pl.BlockSpec((bm, 2 * bk2), lambda i, kk, j: (i, kk))
        out_shape, out_block = (mp, 2 * kp2), (bm, 2 * bk2)
    # x's, the bytes' and the scales' blocks, the output's, the bf16 tile,
    # the float32 sums (scratch) and one dot's sums (a temporary)
    params = _layout.compiler_params(
        r * x_spec.block_shape[1] * 2,
        bn * bk2,
        bn * groups * 4,
        math.prod(out_block) * 4,
        parts * bn * bk2 * 2,
        math.prod(out_block) * 4,
        r * out_block[1] * 4,
    )
    out = pl.pallas_call(
        functools.partial(_tile_kernel, parts=parts, half=half, nk=nk),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=grid,
        in_specs=[
            x_spec,
            pl.BlockSpec((bn, bk2), w_index),
            pl.BlockSpec((None, bn, groups), lambda *ids: (*w_index(*ids)[::-1], 0)),
        ],
        out_specs=out_spec,
        scratch_shapes=[
            pltpu.VMEM(out_block, jnp.float32),
            pltpu.VMEM((parts, bn, 2 * bk2), jnp.bfloat16),
        ],
        compiler_params=params,
        interpret=interpret,
    )(rows, w, scales)
    if nk:
        return out[:m, :n]
    # each block of K came out as its even entries, then its odd ones
    out = out[:m].reshape(m, kp2 // bk2, 2, bk2).swapaxes(2, 3)
    return out.reshape(m, 2 * kp2)[:, : 2 * k2]


def _k_blocks(k2: int, half: int, largest: int, group_rows: int = 8) -> tuple[int, int]:
    """(_layout.padded k / 2, packed bk): whole groups a block; a block of
    several holds a multiple of ``group_rows`` groups (the groups kernels'
    scales block (groups, bn) tiles by 8 rows; the tile kernel's holds all of
    a block's groups along its last axis: 1)."""
    kp2 = _layout.padded(k2, math.lcm(_layout.LANES, half))
    unit = math.lcm(_layout.LANES, group_rows * half)
    if kp2 <= max(largest, unit):  # one block: no padding to group_rows groups
        return kp2, kp2
    kp2 = _layout.padded(k2, unit)
    return kp2, _layout.divisor_block(kp2, max(largest, unit), unit)


def padded_blocks(m: int, k2: int, n: int, half: int, dtype, blocks, group_rows=8):
    """x's rows, the output columns and K's packed bytes, each padded to its
    block, and the blocks: ((mp, bm), (np, bn), (kp2, bk2)) for x (m, 2 k2)
    in ``dtype``'s parts, n output columns, groups of 2 ``half`` entries and
    ``blocks`` (bm, bn, packed bk) upper bounds (``group_rows``:
    ``_k_blocks``')."""
    bm, bn, bk2 = blocks
    kp2, bk2 = _k_blocks(k2, half, bk2, group_rows)
    mp, bm = _layout.row_blocks(m, dtype, bm)
    np_ = _layout.padded(n, _layout.LANES)
    return (mp, bm), (np_, _layout.divisor_block(np_, bn)), (kp2, bk2)


def _int4_product(
    x,
    packed,
    scale,
    *,
    group_size: int,
    mode: str = "groups",
    mxu: str = "bf16",
    parts: int = 1,
    pair: bool = False,
    nk: bool = True,
    blocks: tuple[int, int, int] | None = None,
    interpret: bool = False,
):
    """x f32 (m, k) times int4 weights -> f32 (m, n): ``packed`` uint8
    (n, k / 2), ``scale`` f32 (n, k / G) (qarray's layout, module doc); or
    ``packed`` jnp.int4 (n, k) (``as_int4``), which Mosaic unpacks (mode
    groups; ``benchmarks/tpu_kernels.py``'s int4_stored: faster than the
    shifts, but a bitcast of qarray's bytes in the program is a relayout of
    the weights in HBM on a TPU, so only weights held as jnp.int4 gain).

    ``mode``: ``"groups"`` or ``"tile"`` (module doc); ``mxu`` (groups):
    ``"bf16"`` or ``"int8"``; ``parts``: x's parts of that kind (``_parts``;
    in mode tile the weights' bf16 parts too); ``pair`` (the bytes kernel,
    two int8 parts): x as ``int8_pair``, whose parts meet in int32.
    ``nk=False`` (mode tile): the VJP's product, x f32 (m, n) (y_bar) times
    the weights (n, k) -> f32 (m, k). ``blocks``: (bm, bn, packed bk) upper
    bounds."""
    m = x.shape[0]
    n, k = packed.shape[0], x.shape[1] if nk else packed.shape[1] * 2
    if 0 in (m, k, n):
        return jnp.zeros((m, n if nk else k), jnp.float32)
    if mode not in ("groups", "tile"):
        raise ValueError(f"unknown int4 mode {mode!r}: 'groups' or 'tile'")
    half = group_size // 2
    if group_size % 2 or (_layout.LANES % half and half % _layout.LANES):
        raise ValueError(
            f"group_size {group_size}: G / 2 must divide 128 or be a multiple of it"
        )
    if packed.dtype == jnp.int4:
        nibbles = "int4"
        if mode != "groups":
            raise ValueError("jnp.int4 weights take mode 'groups'")
    elif mode == "groups" and reads_bytes(group_size, mxu):
        nibbles = "bytes"
    else:
        nibbles = "shifts"
    if pair and (nibbles != "bytes" or parts != 2 or not takes_pair(group_size)):
        raise ValueError(
            "pair: the bytes kernel (int8 MXU, G a multiple of 128, at most "
            f"512: int32 sums) on two int8 parts of x, not {nibbles} x{parts} "
            f"with group_size {group_size}"
        )
    if not nk and mode != "tile":
        raise ValueError("nk=False (the VJP's y_bar @ W) takes mode 'tile'")
    if mode == "tile":
        return _tile_product(
            x,
            packed,
            scale,
            half=half,
            parts=parts,
            blocks=blocks,
            nk=nk,
            interpret=interpret,
        )
    split, _ = MXU[mxu]
    xparts, xscales = int8_pair(x) if pair else split(x, parts)
    (mp, bm), (np_, bn), (kp2, bk2) = padded_blocks(
        m, k // 2, n, half, xparts.dtype, blocks
    )
    # a group's lanes in the weights' block, and x's lanes a block and which
    # of its entries: int4 entries (x as it is, and so for bytes, reordered
    # by _halves_by_group), or bytes unpacked by shifts (x's even entries,
    # then its odd ones)
    if nibbles == "shifts":
        width, span, bk = half, kp2, bk2
        entries = [slice(0, None, 2), slice(1, None, 2)]
    else:
        width, span, bk, entries = 2 * half, 2 * kp2, 2 * bk2, [slice(None)]
    copies = max(1, _layout.LANES // width)
    stacked = []
    for entry in entries:
        rows, row_scales = _layout.stack_parts(
            xparts[..., entry], xscales, mp, bm, span
        )
        if copies > 1:  # one copy per group of a chunk, zero elsewhere
            lane_group = (jnp.arange(span) % _layout.LANES) // width
            rows = rows.reshape(mp // bm, 1, parts * bm, span)
            rows = jnp.where(lane_group == jnp.arange(copies)[:, None, None], rows, 0)
            rows = rows.reshape(-1, span)
        if nibbles == "bytes":
            rows = _halves_by_group(rows, half)
        stacked.append(rows)
    # the weights' lanes a block: bytes stay packed, two entries to a lane
    w_span, w_bk = (kp2, bk2) if nibbles == "bytes" else (span, bk)
    w = jnp.pad(packed, ((0, np_ - n), (0, w_span - packed.shape[1])))
    groups_t = jnp.pad(
        scale.astype(jnp.float32), ((0, np_ - n), (0, kp2 // half - scale.shape[1]))
    ).T
    r = copies * parts * bm
    x_spec = pl.BlockSpec((r, bk), lambda i, j, kk: (i, kk))
    in_specs = [
        *[x_spec] * len(stacked),
        pl.BlockSpec((bn, w_bk), lambda i, j, kk: (j, kk)),
        pl.BlockSpec((bk2 // half, bn), lambda i, j, kk: (kk, j)),
    ]
    out_rows = bm
    if nibbles == "bytes":
        # x's rows the bytes kernel scales and writes: one block of rows
        # keeps only its rows padded to 8 (int8 pads them to 32)
        live = min(bm, _layout.padded(m, 8)) if mp == bm else bm
        groups_t = groups_t / 16  # its nibbles come times 16 (exact)
        kernel = functools.partial(
            _bytes_kernel, parts=parts, half=half, live=live, pair=pair
        )
        row_scales = row_scales.reshape(mp // bm, parts, bm)
        row_scales = (row_scales[:, 1:] if pair else row_scales)[..., :live]
        out_rows = live
        acc_rows = row_scales.shape[1] * live
        row_scales = row_scales.reshape(-1, 1)
    else:
        kernel = functools.partial(
            _groups_kernel, parts=parts, mxu=mxu, width=width, nibbles=nibbles
        )
        acc_rows = parts * bm
    in_specs.append(pl.BlockSpec((acc_rows, 1), lambda i, j, kk: (i, 0)))
    args = [*stacked, w, groups_t, row_scales]
    params = _layout.compiler_params(
        len(stacked) * r * bk * stacked[0].dtype.itemsize,
        9 * bn * bk2,
        3 * r * bn * 4,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp // bm * out_rows, np_), jnp.float32),
        grid=(mp // bm, np_ // bn, kp2 // bk2),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((out_rows, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((acc_rows, bn), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
    )(*args)
    return out[:m, :n]


_jitted = jax.jit(
    _int4_product,
    static_argnames=(
        "group_size",
        "mode",
        "mxu",
        "parts",
        "pair",
        "nk",
        "blocks",
        "interpret",
    ),
)


def int4_product(x, packed, scale, *, group_size: int, **options):
    """``_int4_product`` (its doc: the arguments), compiled once per
    combination of the static options, the blocks resolved from the TPU rule
    before the cache is asked; TypeError where the operands' shapes do not
    agree, ValueError for a group size the kernels do not take."""
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"group_size {group_size}: a positive even number")
    nk = options.get("nk", True)
    per_entry = {jnp.dtype(jnp.uint8): 2, jnp.dtype(jnp.int4): 1}.get(packed.dtype)
    agree = x.ndim == 2 and packed.ndim == 2 and per_entry is not None
    if agree:
        n, k = packed.shape[0], per_entry * packed.shape[1]
        agree = (
            x.shape[1] == (k if nk else n)
            and k % group_size == 0
            and scale.shape == (n, k // group_size)
        )
    if not agree:
        x_shape = "x (m, k)" if nk else "y_bar (m, n)"
        raise TypeError(
            f"int4_product: x {x.shape}, packed {packed.dtype}{packed.shape} and "
            f"scale {scale.shape} do not agree for group_size {group_size} "
            f"({x_shape}, packed uint8 (n, k / 2) or jnp.int4 (n, k), "
            "scale (n, k / group_size))"
        )
    mode = options.get("mode", "groups")
    bytes_kernel = packed.dtype == jnp.uint8 and mode == "groups"
    if bytes_kernel and reads_bytes(group_size, options.get("mxu", "bf16")):
        mode = "bytes"
    options["blocks"] = options.get("blocks") or getattr(
        for_tpu(), f"int4_{mode}_blocks", None
    )
    return _jitted(x, packed, scale, group_size=group_size, **options)
