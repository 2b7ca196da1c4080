"""The layer kinds ``qarray.nn`` quantizes: one table that ``quantize``,
``evaluate`` and ``plan`` (and ``qarray.checkpoint``'s model files) share.

A kind says which float layers it covers, where their float weights are,
whether GPTQ / AWQ calibrate them, and how one is stored at a precision
(``quantized``); the rows of its stored matrices give its bytes and whether
it packs into int4 groups (``fits_int4``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import equinox as eqx
import jax.numpy as jnp

from .._ops import DEFAULT_GROUP_SIZE
from ._conv import Conv, ConvTranspose
from ._embedding import Embedding
from ._linear import Linear
from ._spectral import SpectralConv

CELLS = (eqx.nn.GRUCell, eqx.nn.LSTMCell)


@dataclass(frozen=True)
class Kind:
    """Float layers of ``types``: their float weights are the fields
    ``weights``; ``calibrated``: GPTQ and AWQ quantize them (the other kinds
    are rounded to nearest)."""

    types: tuple[type, ...]
    weights: tuple[str, ...] = ("weight",)
    calibrated: bool = False


# what quantize replaces, in the order its docstring names them
KINDS = (
    Kind((eqx.nn.Linear,), calibrated=True),
    Kind((eqx.nn.Conv,), calibrated=True),
    Kind((eqx.nn.ConvTranspose,)),
    Kind((eqx.nn.Embedding,)),
    Kind(CELLS, ("weight_ih", "weight_hh")),
    Kind((SpectralConv,)),
)
FLOAT_LAYERS = tuple(t for kind in KINDS for t in kind.types)
# a float32 qarray.nn.Linear (a network file's layer): measured and planned
# in its own layout, never replaced by quantize
_TRAINABLE_LINEAR = Kind((Linear,))
# what a quantized copy holds where a float layer was
QUANTIZED_LAYERS = (Linear, Conv, ConvTranspose, Embedding, SpectralConv)


def kind_of(node) -> Kind | None:
    """The kind of a float layer still to quantize, or None (not a layer,
    or quantized already)."""
    if isinstance(node, Linear):
        return _TRAINABLE_LINEAR if node.trainable else None
    if isinstance(node, SpectralConv) and node.precision != "float32":
        return None
    if isinstance(node, CELLS) and isinstance(node.weight_ih, Linear):
        return None
    return next((k for k in KINDS if isinstance(node, k.types)), None)


def quantizable(node) -> bool:
    return kind_of(node) is not None


def float_weights(layer) -> tuple:
    """A float layer's weights (a cell's two matrices)."""
    return tuple(jnp.asarray(getattr(layer, name)) for name in kind_of(layer).weights)


def rows(layer) -> list[tuple[int, int]]:
    """(rows, entries per row) of each matrix the layer stores quantized."""
    if isinstance(layer, SpectralConv):  # a row per output channel and mode
        return [(layer.out_channels * math.prod(layer.modes), 2 * layer.in_channels)]
    return [(w.shape[0], math.prod(w.shape[1:])) for w in float_weights(layer)]


def fits_int4(layer, group_size: int | None = None) -> bool:
    """Whether the layer packs into int4 groups of ``group_size`` (default
    128) along each stored row (a "kn" Linear does not: its groups run along
    K, its rows' other axis)."""
    if isinstance(layer, Linear) and layer.layout != "nk":
        return False
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    return all(width % group_size == 0 for _, width in rows(layer))


def quantized(layer, precision: str, group_size: int | None = None, *,
              trainable: bool = False, activations: str = "float32",
              matmul_precision=None):  # fmt: skip
    """A float ``layer`` stored at ``precision`` ("float32": as it is): int4
    where it packs (``fits_int4``), else int8, its products at
    ``matmul_precision``. A convolution with a non-zero padding mode, or a
    Linear with a "scalar" side, stays float."""
    if precision == "float32":
        return layer
    if precision == "int4" and not fits_int4(layer, group_size):
        precision = "int8"
    group = (DEFAULT_GROUP_SIZE if group_size is None else group_size) * (
        precision == "int4"
    ) or None
    options = {
        "precision": precision,
        "group_size": group,
        "matmul_precision": matmul_precision,
    }
    if isinstance(layer, Linear):
        return dataclasses.replace(layer, **options)
    if isinstance(layer, SpectralConv):
        return layer.as_precision(trainable=trainable, **options)
    if isinstance(layer, eqx.nn.Embedding):
        return Embedding.from_eqx(layer, trainable=trainable, **options)
    if isinstance(layer, CELLS):
        # the cell applies its matrices as ``weight @ x``: quantized
        # bias-free layers stand in for them (``Linear.__matmul__``)
        def matrix(w):
            return Linear.from_float(
                w, layout="nk", trainable=trainable, activations=activations, **options
            )

        return eqx.tree_at(
            lambda c: (c.weight_ih, c.weight_hh),
            layer,
            (matrix(layer.weight_ih), matrix(layer.weight_hh)),
        )
    if isinstance(layer, eqx.nn.Conv | eqx.nn.ConvTranspose):
        if layer.padding_mode != "ZEROS":
            return layer
        kind = Conv if isinstance(layer, eqx.nn.Conv) else ConvTranspose
        return kind.from_eqx(
            layer, trainable=trainable, activations=activations, **options
        )
    if "scalar" in (layer.in_features, layer.out_features):
        return layer
    return Linear.from_float(
        layer.weight,
        layer.bias,
        layout="nk",
        trainable=trainable,
        activations=activations,
        **options,
    )
