"""``qarray.nn.Embedding``: a quantized ``eqx.nn.Embedding``."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._primitives import dequantize, pack, quantize
from ._weights import (
    QuantizedWeights,
    check_modes,
    checked_group_size,
    checked_parts,
)


class Embedding(QuantizedWeights):
    """A lookup table of quantized rows: ``index -> weight[index]``, shape
    ``(embedding_size,)``, as ``eqx.nn.Embedding`` (an integer index per call;
    ``jax.vmap`` for many).

    Each row of the table ``(num_embeddings, embedding_size)`` is quantized on
    its own: int8 with one scale per row (``row = qvalue[i] * scale[i]``), or
    int4 packed with one scale per group of ``group_size`` entries. Stored
    (``qvalue``, ``scale``): the lookup reads the row's integers and scales,
    and the gradient with respect to the scales is exact; trainable
    (``weight`` float32, bfloat16 or float16): the looked-up row is quantized
    on every call, with a straight-through gradient in the table's dtype.
    ``precision="float32"`` keeps the table as it is.

    Lookups answer in the float table's dtype: the trainable table's own, a
    stored one's ``dtype`` (recorded when it was quantized: a bfloat16
    model's embeddings stay bfloat16). ``matmul_precision`` is the
    precision of a ``qnn.lora`` adapter's product on this table (a lookup
    has none of its own); ``QuantConfig`` gives it to every layer.
    """

    # the fields it shares: QuantizedWeights'
    dtype: str = eqx.field(static=True)  # the lookups' (a dtype's name)

    def __init__(
        self,
        weight=None,
        *,
        qvalue=None,
        scale=None,
        precision: str = "int8",
        group_size: int | None = None,
        stored_error: float | None = None,
        dtype=None,
        matmul_precision=None,
    ):
        """``dtype``: a stored table's lookups' (default float32); a float
        ``weight`` gives its own (``dtype`` is then not used)."""
        group_size = checked_group_size("Embedding", precision, group_size, "float32")
        check_modes("Embedding", "float32", weight, qvalue, scale, "qvalue and scale")
        checked_parts("Embedding", weight, qvalue, scale, precision, group_size)
        self._keep_weights(
            weight, qvalue, scale, precision, group_size, stored_error, matmul_precision
        )
        if weight is not None:
            dtype = weight.dtype
        self.dtype = np.dtype(np.float32 if dtype is None else dtype).name

    @classmethod
    def from_eqx(
        cls,
        layer: eqx.nn.Embedding,
        *,
        trainable: bool = False,
        precision: str = "int8",
        group_size: int | None = None,
        matmul_precision=None,
    ) -> Embedding:
        """The quantized counterpart of an ``eqx.nn.Embedding``: its table kept
        float and quantized row by row on every call (``trainable=True``) or
        quantized now and stored."""
        table = cls(
            jnp.asarray(layer.weight),
            precision=precision,
            group_size=group_size,
            matmul_precision=matmul_precision,
        )
        return table if trainable else table.frozen()

    def __call__(self, x, *, key=None):
        """``x``: an integer index -> its row ``(embedding_size,)``; ``key`` is
        accepted and unused (equinox's convention)."""
        del key
        if self.precision == "float32":
            return jnp.asarray(self.weight)[x]
        if self.trainable:  # straight-through: the identity for cotangents
            row = jnp.asarray(self.weight)[x]
            qw = quantize(row[None], self._bits, self.group_size)
            return dequantize(qw)[0].astype(row.dtype)
        qvalue, scale = jnp.asarray(self.qvalue)[x], jnp.asarray(self.scale)[x]
        qw = pack(qvalue[None], scale[None], self._bits, self.group_size)
        return dequantize(qw)[0].astype(self.dtype)
