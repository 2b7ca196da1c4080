"""Every Pallas kernel qarray/_tpu holds, with the blocks the TPU rule gives
it, lowers to a Mosaic module for a TPU here, where no TPU is attached
(``jax.export`` for platform "tpu": tracing and Pallas' TPU lowering, not
libtpu's compiler). Pallas' interpreter, which the numerics tests use off
the chip, runs any block of any shape with any jnp operation; this lowering
is what refuses a block that does not tile by (8, 128) (int8's (32, 128))
or an operation Mosaic has no rule for, so CI sees those without a chip.
The shapes: the benchmarks' (K = N = 8192, rows 1 to 4096, several blocks
on every axis) and odd ones (every axis padded)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from qarray import _tpu

SHAPES = [(1, 8192, 8192), (64, 8192, 8192), (4096, 8192, 8192), (70, 1216, 300)]
# K a multiple of every group size (256); its packed bytes padded to blocks
INT4_SHAPES = [*SHAPES[:3], (70, 1280, 300)]


def _lowers_to_mosaic(fn, *shapes):
    """The StableHLO of ``fn`` exported for a TPU: one Mosaic custom call a
    kernel (AssertionError naming the text otherwise)."""
    exported = export.export(jax.jit(fn), platforms=["tpu"])(*shapes)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text, text[:2000]
    return text


def _operands(m, k, n, *, weights):
    x = jax.ShapeDtypeStruct((m, k), jnp.float32)
    if weights == "int8":
        return x, jax.ShapeDtypeStruct((n, k), jnp.int8)
    return x, jax.ShapeDtypeStruct((n, k // 2), jnp.uint8)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("nk", [True, False], ids=["nk", "kn"])
@pytest.mark.parametrize("mxu,parts", [("bf16", 1), ("int8", 1), ("int8", 3)])
def test_int8_kernels_lower_for_a_tpu(shape, nk, mxu, parts):
    m, k, n = shape
    x, w = _operands(m, k, n, weights="int8")
    if not nk:
        w = jax.ShapeDtypeStruct((k, n), jnp.int8)
    scale = jax.ShapeDtypeStruct((n,), jnp.float32)
    fn = functools.partial(_tpu.int8_product, nk=nk, mxu=mxu, parts=parts)
    _lowers_to_mosaic(fn, x, w, scale)


@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[3:], ids=str)
def test_the_vector_kernel_lowers_for_a_tpu(shape):
    m, k, n = shape
    x, w = _operands(min(m, _tpu.VECTOR_MAX_ROWS), k, n, weights="int8")
    _lowers_to_mosaic(_tpu.int8_vector, x, w)


@pytest.mark.parametrize("shape", INT4_SHAPES, ids=str)
@pytest.mark.parametrize(
    "mode,mxu,parts,group_size",
    [
        ("groups", "int8", 1, 128),  # bytes kernel, W4A8
        ("groups", "int8", 2, 128),  # bytes kernel, weight-only
        ("groups", "int8", 2, 256),
        ("pair", "int8", 2, 128),  # bytes kernel on int8_pair's halves
        ("groups", "bf16", 1, 128),  # shifts
        ("groups", "bf16", 1, 32),  # shifts, several groups a chunk
        ("tile", "bf16", 1, 64),
        ("tile", "bf16", 3, 64),
    ],
)
def test_int4_kernels_lower_for_a_tpu(shape, mode, mxu, parts, group_size):
    m, k, n = shape
    x, packed = _operands(m, k, n, weights="int4")
    scale = jax.ShapeDtypeStruct((n, k // group_size), jnp.float32)
    pair = mode == "pair"
    fn = functools.partial(
        _tpu.int4_product,
        group_size=group_size,
        mode="groups" if pair else mode,
        mxu=mxu,
        parts=parts,
        pair=pair,
    )
    _lowers_to_mosaic(fn, x, packed, scale)


def test_int4_weights_held_as_jnp_int4_lower_for_a_tpu():
    x = jax.ShapeDtypeStruct((8, 8192), jnp.float32)
    w = jax.ShapeDtypeStruct((8192, 8192), jnp.int4)
    scale = jax.ShapeDtypeStruct((8192, 64), jnp.float32)
    fn = functools.partial(_tpu.int4_product, group_size=128, mxu="bf16")
    _lowers_to_mosaic(fn, x, w, scale)


@pytest.mark.parametrize(
    "blocks", [(1024, 2048, 512), (4096, 512, 512), (2048, 2048, 256)], ids=str
)
def test_the_int4_tile_kernel_lowers_for_a_tpu_at_many_rows(blocks):
    """Mode tile at tpu_kernels' int4_tile_rows blocks, 4096 rows (a row
    block of up to 4096 rows: each weight dequantized once a product)."""
    x, packed = _operands(4096, 8192, 8192, weights="int4")
    scale = jax.ShapeDtypeStruct((8192, 64), jnp.float32)
    fn = functools.partial(
        _tpu.int4_product, group_size=128, mode="tile", blocks=blocks
    )
    _lowers_to_mosaic(fn, x, packed, scale)


@pytest.mark.parametrize("m", [8, 512])
def test_the_vjps_int4_tile_kernel_lowers_for_a_tpu(m):
    """Mode tile's y_bar @ W (``nk=False``) at the rule's blocks, K = N = 8192."""
    g = jax.ShapeDtypeStruct((m, 8192), jnp.float32)
    packed = jax.ShapeDtypeStruct((8192, 4096), jnp.uint8)
    scale = jax.ShapeDtypeStruct((8192, 64), jnp.float32)
    fn = functools.partial(_tpu.int4_product, group_size=128, mode="tile", nk=False)
    _lowers_to_mosaic(fn, g, packed, scale)


def test_a_block_mosaic_cannot_tile_is_refused_here():
    """The check this file relies on: a kernel whose block breaks the
    (8, 128) tiling (a (4, 100) block of a (8, 200) array) fails to lower
    for a TPU, while the interpreter would run it."""
    from jax.experimental import pallas as pl

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def fn(x):
        return pl.pallas_call(
            copy,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(2, 2),
            in_specs=[pl.BlockSpec((4, 100), lambda i, j: (i, j))],
            out_specs=pl.BlockSpec((4, 100), lambda i, j: (i, j)),
        )(x)

    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        _lowers_to_mosaic(fn, jax.ShapeDtypeStruct((8, 200), jnp.float32))
