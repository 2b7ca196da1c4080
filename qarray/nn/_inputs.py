"""What a calibrated ``Linear`` or ``Conv`` does to its input before the
product: divide it by a per-input-channel scale (AWQ's and SmoothQuant's,
the weights having been multiplied by it before quantization) and round it
to the int8 grid of a static activation scale (calibrated, not measured per
call)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._numerics import QMAX, on_grid


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


class InputScales:
    """A mixin for ``Linear`` and ``Conv``: their optional
    ``channel_scale`` and ``activation_scale`` leaves applied to ``x``."""

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
