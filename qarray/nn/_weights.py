"""What every layer with quantized weights shares (``Linear``, ``Conv``,
``Embedding``, ``SpectralConv``): the base module ``QuantizedWeights``, whose
fields are the weights (float ones quantized on every call, or stored int8 /
int4 parts) and how they are kept (precision, group size, the error recorded
at quantization, the products' precision), the checks a layer runs on them
before it keeps them, their QArray, their export and their error."""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._numerics import relative_error
from .._ops import (
    DEFAULT_GROUP_SIZE,
    FLOAT_DTYPES,
    PRECISION_BITS,
    PRECISIONS,
    check_activations,
    check_group_size,
    check_precision,
)
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


def dtype_str(a) -> str:
    """``float32(8, 16)``: an array's dtype and shape, for error messages."""
    return f"{np.dtype(a.dtype).name}{tuple(a.shape)}"


def require_array(name: str, a, dtype, min_rank: int, owner: str) -> None:
    """A TypeError unless ``a`` is an array of ``dtype`` (or one of a tuple
    of dtypes) and rank >= ``min_rank``."""
    names = [np.dtype(d).name for d in (dtype if isinstance(dtype, tuple) else [dtype])]
    if not hasattr(a, "dtype") or np.dtype(a.dtype).name not in names:
        got = dtype_str(a) if hasattr(a, "dtype") else type(a).__name__
        want = (
            names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        )
        raise TypeError(f"{owner} requires {name} to be a {want} array, got {got}.")
    if a.ndim < min_rank:
        raise TypeError(
            f"{owner} requires {name} of rank >= {min_rank}, got {dtype_str(a)}."
        )


def check_modes(owner: str, activations, weight, qvalue, scale, stored: str) -> None:
    """A layer's ``activations`` value, and that it has exactly one of float
    ``weight`` (trainable) and the stored parts (``stored`` names them)."""
    check_activations(owner, activations)
    if (weight is None) == (qvalue is None and scale is None):
        got = "both" if weight is not None else "neither"
        raise TypeError(
            f"{owner} takes either weight (trainable) or {stored} (stored), got {got}."
        )


def checked_group_size(
    owner: str,
    precision,
    group_size,
    activations,
    precisions=PRECISIONS,
    hint="",
    w4a8=False,
) -> int | None:
    """The group size a layer of ``precision`` keeps (int4: ``group_size`` or
    the default; otherwise None), once ``precision`` is one of
    ``precisions`` and an int4 layer is weight-only (unless ``w4a8``: int8
    activations allowed with int4 weights)."""
    if precision not in precisions:
        raise ValueError(
            f"{owner} requires precision in {precisions}{hint}, got {precision!r}."
        )
    if precision != "int4":
        return None
    if activations != "float32" and not w4a8:
        raise ValueError(f"{owner} with precision 'int4' is weight-only.")
    return check_group_size(
        f"{owner}: group_size", DEFAULT_GROUP_SIZE if group_size is None else group_size
    )


def checked_parts(
    owner: str, weight, qvalue, scale, precision: str, group_size
) -> None:
    """A layer's weights, once ``check_modes`` passed: stored parts given
    together (not for float32) and fitting (``stored_width``), or float32
    ``weight (..., out, K)`` whose K the int4 group size divides."""
    if weight is None:
        if qvalue is None or scale is None:
            raise TypeError(f"{owner} takes qvalue and scale together.")
        if precision == "float32":
            raise TypeError(
                f"{owner} with precision 'float32' takes weight (not quantized)."
            )
        stored_width(owner, qvalue, scale, precision, group_size)
        return
    require_array("weight", weight, FLOAT_DTYPES, 2, owner)
    if precision == "int4" and weight.shape[-1] % group_size:
        raise TypeError(
            f"{owner} (int4) requires K = {weight.shape[-1]} (weight "
            f"{dtype_str(weight)}) to be a multiple of group_size {group_size}."
        )


def stored_width(owner: str, qvalue, scale, precision: str, group_size) -> int:
    """K, the input width of a stored layer's parts, once they fit: int8
    ``qvalue (..., out, K)`` with a float32 scale per row ``(..., out)``;
    int4 uint8 ``qvalue (..., out, K / 2)`` with ``scale (..., out, K / G)``."""
    if precision == "int4":
        require_array("qvalue", qvalue, np.uint8, 2, owner)
        require_array("scale", scale, np.float32, 2, owner)
        k = 2 * qvalue.shape[-1]
        want = (*qvalue.shape[:-1], k // group_size)
        if k % group_size or tuple(scale.shape) != want:
            raise TypeError(
                f"{owner} requires qvalue uint8 (out, K / 2) and scale (out, K / "
                f"{group_size}) for int4: scale of shape {want} for qvalue "
                f"{dtype_str(qvalue)} (K = {k}), got {dtype_str(scale)}."
            )
        return k
    require_array("qvalue", qvalue, np.int8, 2, owner)
    require_array("scale", scale, np.float32, 1, owner)
    if tuple(scale.shape) != tuple(qvalue.shape[:-1]):
        raise TypeError(
            f"{owner} requires scale.shape == qvalue.shape[:-1] (one scale per "
            f"row), got {dtype_str(qvalue)} and {dtype_str(scale)}."
        )
    return qvalue.shape[-1]


def quantization_error(w, qw):
    """``||w - dequantize(qw)|| / ||w||`` (0 for zero weights), without a
    derivative: a diagnostic."""
    return lax.stop_gradient(relative_error(w, dequantize(qw)))


class QuantizedWeights(eqx.Module):
    """The base of the quantized layers: their weights, in one of three forms,
    and how they are kept.

    - trainable: ``weight``, float (float32, bfloat16 or float16), quantized
      on every call (``qvalue`` and ``scale`` None);
    - stored: ``qvalue`` (int8 ``(rows, K)``, or int4 packed: uint8
      ``(rows, K / 2)``) and its float32 ``scale`` (``(rows,)``, int4:
      ``(rows, K / group_size)``), ``weight`` None;
    - ``precision="float32"``: ``weight`` used as it is, never quantized.

    A layer declares only its own fields (they follow these in the
    dataclass, so the leaves flatten as ``weight, qvalue, scale``, then the
    layer's), checks its weights in its ``__init__`` with the checks of this
    module and keeps them with ``_keep_weights``; it gives
    ``_weight_rows(weight)``, its float weights as the 2-D matrix that is
    quantized row by row (default: as they are).
    """

    weight: jax.Array | None
    qvalue: jax.Array | None
    scale: jax.Array | None
    precision: str = eqx.field(static=True)
    group_size: int | None = eqx.field(static=True)  # int4 only
    # the relative error of the float weights a stored layer was quantized
    # from (None: given as parts, not known)
    stored_error: float | None = eqx.field(static=True)
    # the products' ``precision`` (JAX's meaning: checked_matmul_precision)
    matmul_precision: MatmulPrecision = eqx.field(static=True)

    def _keep_weights(
        self,
        weight,
        qvalue,
        scale,
        precision: str,
        group_size: int | None,
        stored_error: float | None,
        matmul_precision,
    ) -> None:
        """Set the shared fields (from ``__init__``, once the layer checked
        its weights); ``matmul_precision`` is checked here."""
        self.weight, self.qvalue, self.scale = weight, qvalue, scale
        self.precision, self.group_size = precision, group_size
        self.stored_error = stored_error
        self.matmul_precision = checked_matmul_precision(
            type(self).__name__, matmul_precision
        )

    @property
    def trainable(self) -> bool:
        """Float weights, quantized on every call unless float32 (else
        stored)."""
        return self.weight is not None

    @property
    def _bits(self) -> int:
        return PRECISION_BITS[self.precision]

    def _weight_rows(self, weight):
        return weight

    def quantized(self):
        """The weights as a QArray (``q8[rows, K]``, or ``q4`` for int4) of
        ``_weight_rows``' shape; traced code. A float32 layer has none."""
        if self.precision == "float32":
            name = type(self).__name__
            raise TypeError(f"a float32 {name} has no quantized weights.")
        if self.trainable:
            rows = self._weight_rows(jnp.asarray(self.weight))
            return quantize(rows, self._bits, self.group_size)
        qvalue, scale = jnp.asarray(self.qvalue), jnp.asarray(self.scale)
        return pack(qvalue, scale, self._bits, self.group_size)

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
        return frozen_together([self])[0]


def frozen_together(layers: list) -> list:
    """``[layer.frozen() for layer in layers]``, the trainable ones'
    quantization one compiled program (a model's layers: one compile rather
    than one per layer shape)."""
    live = [layer.trainable and layer.precision != "float32" for layer in layers]
    todo = [layer for layer, t in zip(layers, live, strict=True) if t]
    parts = iter(stored_parts(without_stored_errors(todo)) if todo else ())
    out = []
    for layer, t in zip(layers, live, strict=True):
        if t:
            qvalue, scale, error = next(parts)
            stored = {"qvalue": qvalue, "scale": scale, "stored_error": float(error)}
            layer = dataclasses.replace(layer, weight=None, **stored)
        out.append(layer)
    return out


@eqx.filter_jit
def stored_parts(layers: list) -> list:
    """(qvalue, scale, relative weight error) each trainable layer stores
    when frozen; compiled as one program, as eagerly each primitive would be
    compiled and dispatched on its own, again for every layer of a model."""

    def parts(layer: QuantizedWeights):
        qw = layer.quantized()
        qvalue, scale = unpack(qw)
        return qvalue, scale, layer.weight_error(qw)

    return [parts(layer) for layer in layers]


def without_stored_errors(tree):
    """``tree`` with every quantized layer's ``stored_error`` None (what it
    computes unchanged): the error is a static field, so a compiled function
    handed layers of other recorded errors (a calibration's, each its own)
    would be traced and compiled anew for each."""

    def clear(node):
        if isinstance(node, QuantizedWeights) and node.stored_error is not None:
            return dataclasses.replace(node, stored_error=None)
        return node

    return jax.tree.map(
        clear, tree, is_leaf=lambda node: isinstance(node, QuantizedWeights)
    )


def dequantized(layer: QuantizedWeights) -> jax.Array:
    """A stored layer's weights dequantized, float32 ``(rows, K)``: one
    compiled program per shape and precision (eagerly every primitive would
    compile apart; the layer's static fields, its recorded error among them,
    left out of the key)."""
    return _unpacked(
        layer.qvalue, layer.scale, bits=layer._bits, group_size=layer.group_size
    )


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def _unpacked(qvalue, scale, *, bits, group_size):
    return dequantize(pack(qvalue, scale, bits, group_size))
