"""A Fourier neural operator (FNO) for the steady heat equation of
examples/cnn_surrogate (Darcy flow: -div(exp(log_k) grad u) = 1, u = 0 on
the boundary), with its spectral weights quantized by qarray.

``log_k (1, G, G) -> u (1, G, G)``: the field and the cell-centre coordinates
lifted pointwise to ``WIDTH`` channels, zero-padded by ``PAD`` cells on the
high side of each axis (the FFT's periodicity then meets zeros, as the
boundary condition asks), ``BLOCKS`` Fourier blocks ``gelu(SpectralConv(h) +
Conv1x1(h))`` with ``MODES`` x ``MODES`` modes, cropped back, and projected
pointwise. The spectral weights are most of the parameters;
``qarray.nn.quantize`` stores them int8 (or int4) with the 1 x 1
convolutions.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

import qarray.nn as qnn

GRID = 32
WIDTH = 20
MODES = 10
BLOCKS = 4
PAD = 8


def coordinates(grid: int = GRID) -> jax.Array:
    """The cell centres' (x, y) as two (G, G) channels."""
    centres = (jnp.arange(grid) + 0.5) / grid
    return jnp.stack(jnp.meshgrid(centres, centres, indexing="ij"))


class FNO(eqx.Module):
    """log_k (1, G, G) -> u (1, G, G); ``u_scale`` puts the output in the
    solver's units (an array leaf: model files hold arrays only)."""

    lift: eqx.nn.Conv2d
    spectral: list
    pointwise: list
    hidden: eqx.nn.Conv2d
    project: eqx.nn.Conv2d
    u_scale: jax.Array

    def __init__(self, key, width: int = WIDTH, modes: int = MODES, u_scale=1.0):
        keys = jax.random.split(key, 2 * BLOCKS + 3)
        self.lift = eqx.nn.Conv2d(3, width, 1, key=keys[0])
        self.spectral = [
            qnn.SpectralConv(width, width, (modes, modes), key=k)
            for k in keys[1 : BLOCKS + 1]
        ]
        self.pointwise = [
            eqx.nn.Conv2d(width, width, 1, key=k)
            for k in keys[BLOCKS + 1 : 2 * BLOCKS + 1]
        ]
        self.hidden = eqx.nn.Conv2d(width, 4 * width, 1, key=keys[-2])
        self.project = eqx.nn.Conv2d(4 * width, 1, 1, key=keys[-1])
        self.u_scale = jnp.asarray(u_scale, jnp.float32)

    def __call__(self, log_k, *, key=None):
        grid = log_k.shape[-1]
        # the coordinates in the field's dtype: a bfloat16 model stays bfloat16
        h = self.lift(jnp.concatenate([log_k, coordinates(grid).astype(log_k.dtype)]))
        h = jnp.pad(h, ((0, 0), (0, PAD), (0, PAD)))
        for i, (spectral, pointwise) in enumerate(
            zip(self.spectral, self.pointwise, strict=True)
        ):
            h = spectral(h) + pointwise(h)
            h = h if i == BLOCKS - 1 else jax.nn.gelu(h)
        h = h[:, :grid, :grid]
        return self.project(jax.nn.gelu(self.hidden(h))) * self.u_scale
