"""``qarray.nn.Linear``: one quantized dense layer as an equinox module."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from .._ops import FLOAT_DTYPES, LAYOUTS
from .._primitives import linear_q, matmul_q
from ._product import QuantizedProduct
from ._weights import (
    check_modes,
    checked_group_size,
    checked_parts,
    dtype_str,
    require_array,
)


class Linear(QuantizedProduct):
    """One quantized dense layer: ``x (..., K) -> x @ W + bias (..., N)``.

    ``W`` is int8 with one float32 scale per row of the stored matrix
    (``W = qvalue * scale[..., None]``, read as ``(K, N)`` for layout "kn" and
    as ``(N, K)``, PyTorch's ``(out, in)``, for "nk"). Two modes:

    - stored (``qvalue`` int8 and ``scale`` float32 given): serving; the
      int8 payload is what the product reads;
    - trainable (``weight`` float32, bfloat16 or float16 given):
      quantization-aware training; the weights are quantized (from their own
      values, scales float32) on every call and their gradient is the dense
      product's (straight-through), in the weights' dtype.

    ``x`` is float32, bfloat16 or float16 and the output is in x's dtype:
    the product runs in float32 (``linear_q``) and is rounded once to x's
    dtype, and the bias (of any of those dtypes: a bfloat16 model's stays
    bfloat16) is added in x's dtype, so a bfloat16 ``x`` with a float32 bias
    answers bfloat16 rather than promoting to float32. ``matmul_precision``
    is the products' ``precision`` (``QuantConfig.matmul_precision``: JAX's
    meaning; None, the default, is ``jax.default_matmul_precision``).

    ``activations="int8"`` quantizes ``x`` per row too (an int8 x int8
    product); ``"float32"`` (default) keeps it. Gradients with respect to
    ``x``, ``bias`` and ``scale`` are exact for the quantized layer.

    ``precision``: ``"int8"`` (above, the default); ``"int4"``: weights
    ``(N, K)`` (layout "nk") in groups of ``group_size`` along K, stored
    packed (``qvalue`` uint8 ``(N, K / 2)``, ``scale`` ``(N, K / G)``),
    weight-only or, with ``activations="int8"``, W4A8; ``"float32"``:
    ``weight`` used as given, not quantized.

    Every leaf is a plain array (``qvalue``, ``scale``, ``weight``, ``bias``)
    and the QArray is built inside the call: a QArray passed to a jitted
    function takes JAX's Python dispatch path for hi types, which costs more
    than a small layer's product (``benchmarks/bench_matmul.py``), while a
    module of arrays goes through ``jax.jit`` / ``eqx.filter_jit`` like any
    other. Leaves may carry leading batch axes when a network maps them
    (``with_batch_rank``).

    Calibrated layers (``qnn.quantize(..., method="awq")``, ``smoothquant=``,
    ``static=True``) may carry ``channel_scale`` ``(K,)``: ``x`` is divided
    by it per input channel (the stored weights were multiplied by it before
    quantization), and ``activation_scale`` ``()``: with
    ``activations="int8"``, ``x`` is rounded to the int8 grid of that fixed
    scale instead of one measured per row (straight-through gradient).
    """

    # the fields it shares: QuantizedWeights' (weight, qvalue, scale,
    # precision, group_size, stored_error, matmul_precision) and
    # QuantizedProduct's (bias, channel_scale, activation_scale, activations)
    layout: str = eqx.field(static=True)

    def __init__(
        self,
        weight=None,
        bias=None,
        *,
        qvalue=None,
        scale=None,
        layout: str = "nk",
        activations: str = "float32",
        stored_error: float | None = None,
        precision: str = "int8",
        group_size: int | None = None,
        channel_scale=None,
        activation_scale=None,
        matmul_precision=None,
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"Linear requires layout in {LAYOUTS}, got {layout!r}.")
        group_size = checked_group_size(
            "Linear", precision, group_size, activations, w4a8=True
        )
        if precision == "int4" and layout != "nk":
            raise ValueError(
                "Linear with precision 'int4' requires layout 'nk' (weights "
                f"(N, K), groups along K), got {layout!r}."
            )
        check_modes("Linear", activations, weight, qvalue, scale, "qvalue and scale")
        checked_parts("Linear", weight, qvalue, scale, precision, group_size)
        self._keep_weights(
            weight, qvalue, scale, precision, group_size, stored_error, matmul_precision
        )
        self.layout = layout
        if bias is not None:
            require_array("bias", bias, FLOAT_DTYPES, 1, "Linear")
            if bias.shape[-1] != self.out_features:
                raise TypeError(
                    f"Linear requires bias of shape (..., {self.out_features}) for "
                    f"weights {dtype_str(self._stored)} (layout {layout!r}), got "
                    f"{dtype_str(bias)}."
                )
        self._keep_inputs(
            bias, channel_scale, activation_scale, activations, self.in_features
        )

    @classmethod
    def from_float(
        cls,
        weight,
        bias=None,
        *,
        layout: str = "nk",
        trainable: bool = False,
        activations: str = "float32",
        precision: str = "int8",
        group_size: int | None = None,
        matmul_precision=None,
    ) -> Linear:
        """A layer from float weights (``(N, K)`` for "nk", ``(K, N)`` for
        "kn"; float32, bfloat16 or float16): kept float and quantized on every
        call (``trainable=True``), or quantized now and stored (the default;
        int8, or int4 packed, or as given for ``precision="float32"``)."""
        layer = cls(
            jnp.asarray(weight),
            None if bias is None else jnp.asarray(bias),
            layout=layout,
            activations=activations,
            precision=precision,
            group_size=group_size,
            matmul_precision=matmul_precision,
        )
        return layer if trainable else layer.frozen()

    @property
    def _stored(self):
        return self.weight if self.weight is not None else self.qvalue

    @property
    def in_features(self) -> int:
        shape = self._stored.shape
        if self.precision == "int4" and not self.trainable:
            return 2 * shape[-1]
        return shape[-2] if self.layout == "kn" else shape[-1]

    @property
    def out_features(self) -> int:
        shape = self._stored.shape
        return shape[-1] if self.layout == "kn" else shape[-2]

    def __call__(self, x, *, key=None):
        """``x (..., K) -> (..., N)``; ``key`` is accepted and unused (equinox's
        convention: ``eqx.nn.Sequential`` passes one to every layer)."""
        del key
        if self.precision == "float32":
            return self.product(x)
        return self.product(x, self.quantized())

    def __matmul__(self, x):
        """``W @ x`` for ``x (K,)`` or ``(K, B)`` (a bias-free layer): how
        equinox's recurrent cells apply their weight matrices, so a quantized
        layer can stand in for one (``qnn.quantize`` of a ``GRUCell``)."""
        if self.bias is not None:
            raise TypeError(
                "Linear @ x is the bias-free product: this layer has a bias."
            )
        x = jnp.asarray(x)
        if x.ndim == 1:
            return self(x)
        return jnp.swapaxes(self(jnp.swapaxes(x, -1, -2)), -1, -2)

    def product(self, x, qw=None):
        """``x (..., K) -> (..., N)`` with the quantized weights ``qw``
        (``self.quantized()``, when the caller already holds it; unused for a
        float32 layer)."""
        x, activations = self._prepared(x, -1)
        precision = self.matmul_precision
        if self.precision == "float32":  # as given: exact gradients
            w = jnp.asarray(self.weight)
            w = w if self.layout == "kn" else jnp.swapaxes(w, -1, -2)
            y = jnp.matmul(x, w, precision=precision).astype(x.dtype)
        else:
            qw = self.quantized() if qw is None else qw
            product = matmul_q if self.layout == "kn" else linear_q
            y = product(x, qw, activations, precision=precision)
        return self._plus_bias(y)

    def placed(self, put: Callable, model: str) -> Linear:
        """This layer with ``put(array, spec)`` applied to each array: its
        output channels over mesh axis ``model`` ((K, N): columns; (N, K):
        rows, with their scales), the rest whole."""
        if self.layout == "kn":
            weights, scales = jax.P(None, model), jax.P(None)
        elif self.precision == "int4":  # a scale per group: (N, K / G)
            weights, scales = jax.P(model, None), jax.P(model, None)
        else:
            weights, scales = jax.P(model, None), jax.P(model)

        def on(a, spec):
            return None if a is None else put(a, spec)

        return dataclasses.replace(
            self,
            weight=on(self.weight, weights),
            qvalue=on(self.qvalue, weights),
            scale=on(self.scale, scales),
            bias=on(self.bias, jax.P(model)),
            channel_scale=on(self.channel_scale, jax.P(None)),
            activation_scale=on(self.activation_scale, jax.P()),
        )

    def with_batch_rank(self, rank: int) -> Linear:
        """Leaves with size-1 axes after their batch axes, ``rank`` of them:
        batch axes index x's leading axes from the left."""

        def pad(a, core):
            if a is None:
                return None
            lead = a.ndim - core
            return a.reshape(*a.shape[:lead], *(1,) * (rank - lead), *a.shape[lead:])

        return dataclasses.replace(
            self,
            weight=pad(self.weight, 2),
            qvalue=pad(self.qvalue, 2),
            scale=pad(self.scale, 2 if self.precision == "int4" else 1),
            bias=pad(self.bias, 1),
        )
