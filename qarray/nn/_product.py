"""What ``Linear`` and ``Conv`` share beyond their weights: both multiply
their float input by the quantized weights and add a bias, and a calibrated
layer first divides its input by a per-input-channel scale (AWQ's and
SmoothQuant's, the weights having been multiplied by it before quantization)
and rounds it to the int8 grid of a static activation scale (calibrated, not
measured per call)."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._numerics import QMAX, on_grid
from ._weights import QuantizedWeights


def check_input_scales(
    owner: str, channel_scale, activation_scale, channels: int, activations: str
) -> None:
    """``channel_scale`` float32 ``(channels,)`` and ``activation_scale``
    float32 ``()`` (which needs ``activations="int8"``), each optional."""
    for name, value, shape in (
        ("channel_scale", channel_scale, (channels,)),
        ("activation_scale", activation_scale, ()),
    ):
        if value is None:
            continue
        dtype = getattr(value, "dtype", None)
        if dtype is None or np.dtype(dtype) != np.float32 or value.shape != shape:
            got = (
                type(value).__name__
                if dtype is None
                else f"{np.dtype(dtype).name}{tuple(value.shape)}"
            )
            raise TypeError(
                f"{owner} requires {name} to be a float32 array of shape {shape}, "
                f"got {got}."
            )
    if activation_scale is not None and activations != "int8":
        raise ValueError(
            f"{owner}: a static activation_scale quantizes the input to int8: it "
            f"needs activations='int8', got {activations!r}."
        )


def static_int8(x, scale):
    """``x`` on the int8 grid of ``scale``: ``clip(round(x / scale), -127,
    127) * scale``, with a straight-through gradient (the identity)."""
    q = on_grid(x, scale, QMAX) * scale
    return x + lax.stop_gradient(q - x)


class QuantizedProduct(QuantizedWeights):
    """The base of ``Linear`` and ``Conv``: quantized weights that multiply
    ``x``, and the fields of that product (after the weights' in the
    dataclass, before the layer's own):

    - ``bias``: added to the product (its shape is the layer's to check);
    - ``channel_scale`` ``(C,)``: ``x`` divided by it per input channel;
    - ``activation_scale`` ``()``: ``x`` rounded to its int8 grid;
    - ``activations``: "float32" (weight-only) or "int8" (``x`` quantized
      per row too).
    """

    bias: jax.Array | None
    channel_scale: jax.Array | None
    activation_scale: jax.Array | None
    activations: str = eqx.field(static=True)

    def _keep_inputs(
        self, bias, channel_scale, activation_scale, activations: str, channels: int
    ) -> None:
        """Set the product's fields (from ``__init__``, once the layer checked
        its weights and bias); the input scales are checked here against the
        layer's ``channels`` input channels."""
        check_input_scales(
            type(self).__name__, channel_scale, activation_scale, channels, activations
        )
        self.bias, self.activations = bias, activations
        self.channel_scale, self.activation_scale = channel_scale, activation_scale

    def _prepared(self, x, channel_axis: int):
        """(``x`` divided by ``channel_scale`` along ``channel_axis`` and put
        on the static int8 grid, the activations the product then takes:
        "float32" once ``x`` is on the grid, as the weight-only product of
        the rounded input is the int8 x int8 product's value, to float32
        rounding). ``x`` keeps its dtype (the float32 scales would promote a
        bfloat16 one): the layer answers in it."""
        x = jnp.asarray(x)
        dtype = x.dtype
        if self.channel_scale is not None:
            shape = [1] * x.ndim
            shape[channel_axis] = -1
            scale = lax.stop_gradient(jnp.asarray(self.channel_scale))
            x = (x / scale.reshape(shape)).astype(dtype)
        if self.activation_scale is None:
            return x, self.activations
        scale = lax.stop_gradient(jnp.asarray(self.activation_scale))
        return static_int8(x, scale).astype(dtype), "float32"

    def _plus_bias(self, y, spatial: int = 0):
        """``y (..., out, *spatial)`` plus the bias ``(..., out)``, in y's
        dtype: x's, which the layer answers in (a bfloat16 ``x`` with a
        float32 bias stays bfloat16)."""
        if self.bias is None:
            return y
        return y + self.bias.astype(y.dtype)[(..., *(None,) * spatial)]

    def with_input_scales(self, channel_scale=None, activation_scale=None):
        """This layer with a per-input-channel ``channel_scale`` (the
        weights already multiplied by it) and a static ``activation_scale``
        (and ``activations="int8"``)."""
        activations = "int8" if activation_scale is not None else self.activations
        # replace runs __init__, which checks the scales
        return dataclasses.replace(
            self,
            channel_scale=channel_scale,
            activation_scale=activation_scale,
            activations=activations,
        )
