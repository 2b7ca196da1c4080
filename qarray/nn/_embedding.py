"""``qarray.nn.Embedding``: a quantized ``eqx.nn.Embedding``."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .._ops import PRECISION_BITS
from .._primitives import dequantize, pack, quantize
from ._linear import check_modes, checked_group_size, checked_parts
from ._weights import QuantizedWeights


class Embedding(QuantizedWeights, eqx.Module):
    """A lookup table of quantized rows: ``index -> weight[index]``, shape
    ``(embedding_size,)``, as ``eqx.nn.Embedding`` (an integer index per call;
    ``jax.vmap`` for many).

    Each row of the table ``(num_embeddings, embedding_size)`` is quantized on
    its own: int8 with one scale per row (``row = qvalue[i] * scale[i]``), or
    int4 packed with one scale per group of ``group_size`` entries. Stored
    (``qvalue``, ``scale``): the lookup reads the row's integers and scales,
    and the gradient with respect to the scales is exact; trainable
    (``weight`` float32): the looked-up row is quantized on every call, with a
    straight-through gradient. ``precision="float32"`` keeps the table as it is.
    """

    weight: jax.Array | None
    qvalue: jax.Array | None
    scale: jax.Array | None
    precision: str = eqx.field(static=True)
    group_size: int | None = eqx.field(static=True)
    stored_error: float | None = eqx.field(static=True)

    def __init__(
        self,
        weight=None,
        *,
        qvalue=None,
        scale=None,
        precision: str = "int8",
        group_size: int | None = None,
        stored_error: float | None = None,
    ):
        group_size = checked_group_size("Embedding", precision, group_size, "float32")
        check_modes("Embedding", "float32", weight, qvalue, scale, "qvalue and scale")
        checked_parts("Embedding", weight, qvalue, scale, precision, group_size)
        self.weight, self.qvalue, self.scale = weight, qvalue, scale
        self.precision, self.group_size = precision, group_size
        self.stored_error = stored_error

    @classmethod
    def from_eqx(
        cls,
        layer: eqx.nn.Embedding,
        *,
        trainable: bool = False,
        precision: str = "int8",
        group_size: int | None = None,
    ) -> Embedding:
        """The quantized counterpart of an ``eqx.nn.Embedding``: its table kept
        float and quantized row by row on every call (``trainable=True``) or
        quantized now and stored."""
        table = cls(
            jnp.asarray(layer.weight), precision=precision, group_size=group_size
        )
        return table if trainable else table.frozen()

    @property
    def _bits(self) -> int:
        return PRECISION_BITS[self.precision]

    def _quantized(self, rows):
        return quantize(rows, self._bits, self.group_size)

    def __call__(self, x, *, key=None):
        """``x``: an integer index -> its row ``(embedding_size,)``; ``key`` is
        accepted and unused (equinox's convention)."""
        del key
        if self.precision == "float32":
            return jnp.asarray(self.weight)[x]
        if self.trainable:  # straight-through: the identity for cotangents
            return dequantize(self._quantized(jnp.asarray(self.weight)[x][None]))[0]
        qvalue, scale = jnp.asarray(self.qvalue)[x], jnp.asarray(self.scale)[x]
        return dequantize(pack(qvalue[None], scale[None], self._bits, self.group_size))[
            0
        ]
