"""What every layer with quantized weights shares (``Linear``, ``Conv``,
``Embedding``, ``SpectralConv``): float weights quantized on every call
(trainable) or stored ones, as a QArray, their export and their error."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax.numpy as jnp
from jax import lax

from .._numerics import relative_error
from .._ops import PRECISION_BITS, check_precision
from .._primitives import dequantize, pack, quantize, unpack

# a product's precision, as jnp.dot takes it (``check_precision``)
MatmulPrecision = str | lax.Precision | tuple | None


def checked_matmul_precision(owner: str, value):
    """A layer's (or ``QuantConfig``'s) ``matmul_precision`` once the
    primitives' rule (``check_precision``: JAX's meaning, as ``jnp.dot``'s
    ``precision``) accepts it, as given: a list becomes a tuple, as the
    value is a static field (hashed) and part of a frozen config."""
    check_precision(f"{owner}: matmul_precision", value)
    return tuple(value) if isinstance(value, list) else value


def quantization_error(w, qw):
    """``||w - dequantize(qw)|| / ||w||`` (0 for zero weights), without a
    derivative: a diagnostic."""
    return lax.stop_gradient(relative_error(w, dequantize(qw)))


class QuantizedWeights:
    """A mixin for the quantized layers. The layer declares ``weight`` (its
    float weights when trainable, else None), ``qvalue`` and ``scale`` (when
    stored), ``precision``, ``group_size`` and ``stored_error``, and gives
    ``_weight_rows(weight)``: its weights as the 2-D matrix that is quantized
    row by row (default: as they are)."""

    @property
    def trainable(self) -> bool:
        """Float weights, quantized on every call unless float32 (else
        stored)."""
        return self.weight is not None

    def _weight_rows(self, weight):
        return weight

    def quantized(self):
        """The weights as a QArray (``q8[rows, K]``, or ``q4`` for int4) of
        ``_weight_rows``' shape; traced code. A float32 layer has none."""
        if self.precision == "float32":
            name = type(self).__name__
            raise TypeError(f"a float32 {name} has no quantized weights.")
        bits = PRECISION_BITS[self.precision]
        if self.trainable:
            rows = self._weight_rows(jnp.asarray(self.weight))
            return quantize(rows, bits, self.group_size)
        qvalue, scale = jnp.asarray(self.qvalue), jnp.asarray(self.scale)
        return pack(qvalue, scale, bits, self.group_size)

    def weight_error(self, qw=None):
        """``||w - W|| / ||w||``, the relative quantization error of the float
        weights (0 for zero weights): computed for a trainable layer (with
        ``qw``, its ``quantized()`` when the caller holds it), the one recorded
        at quantization for a stored layer (0 if not known), 0 for float32. A
        diagnostic: it carries no derivative."""
        if self.precision == "float32":
            return jnp.float32(0.0)
        if not self.trainable:
            return jnp.float32(self.stored_error or 0.0)
        qw = self.quantized() if qw is None else qw
        return quantization_error(self._weight_rows(jnp.asarray(self.weight)), qw)

    def frozen(self):
        """The stored layer a trainable one quantizes to (itself if stored or
        float32): the export after quantization-aware training. Eager."""
        if not self.trainable or self.precision == "float32":
            return self
        qvalue, scale, error = stored_parts(self)
        return dataclasses.replace(
            self, weight=None, qvalue=qvalue, scale=scale, stored_error=float(error)
        )


@eqx.filter_jit
def stored_parts(layer: QuantizedWeights):
    """(qvalue, scale, relative weight error) a trainable layer stores when
    frozen; compiled, as eagerly each primitive would compile on its own
    (which made quantizing a model take seconds)."""
    qw = layer.quantized()
    qvalue, scale = unpack(qw)
    return qvalue, scale, layer.weight_error(qw)
