"""Calibrated quantization of any equinox model: ``qnn.quantize(model,
method="gptq", data=X)``.

Layer by layer, in the model's tree order, each ``eqx.nn.Linear`` and
``eqx.nn.Conv`` that ``qnn.quantize`` would replace gets the inputs that reach
it on the calibration data, through the layers before it as already
quantized: the model runs on ``data`` (``jax.vmap`` over its leading axis,
as ``qnn.evaluate`` does) with that layer wrapped in a recorder
(``jax.debug.callback`` of its input). Its ``H = X^T X`` (a convolution's
over its im2col patches, one per group) goes to ``_gptq.gptq``, and the
layer is stored with the values and scales GPTQ chose. Every other layer is
quantized as ``qnn.quantize`` does it (round-to-nearest).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._kernels import pack_nibbles
from ._conv import Conv
from ._gptq import gptq
from ._linear import Linear

METHODS = ("rtn", "gptq")
_TARGETS = (eqx.nn.Linear, eqx.nn.Conv)


class _Recorder(eqx.Module):
    """``layer`` as it is, its every input handed to ``sink(index, x)``."""

    layer: Any
    index: int = eqx.field(static=True)
    sink: Callable = eqx.field(static=True)

    def __call__(self, x, *, key=None):
        jax.debug.callback(functools.partial(self.sink, self.index), x)
        return self.layer(x)


def _is_target(node) -> bool:
    return isinstance(node, _TARGETS)


def _map_targets(model, replace: Callable):
    """``model`` with its i-th Linear / Conv (tree order) ``replace(i, node)``."""
    count = iter(range(10**9))
    return jax.tree.map(
        lambda n: replace(next(count), n) if _is_target(n) else n,
        model,
        is_leaf=_is_target,
    )


def _hessians(layer, inputs: np.ndarray) -> list[np.ndarray]:
    """``X^T X`` per group of the layer's weight rows (one for a Linear)."""
    if isinstance(layer, eqx.nn.Linear):
        x = inputs.reshape(-1, inputs.shape[-1]).astype(np.float64)
        return [x.T @ x]
    nsp = layer.num_spatial_dims
    x = inputs.reshape(-1, *inputs.shape[-nsp - 1 :])  # (examples, C, *spatial)
    space = "DHW"[3 - nsp :]
    patches = lax.conv_general_dilated_patches(
        jnp.asarray(x),
        layer.kernel_size,
        layer.stride,
        layer.padding,
        rhs_dilation=layer.dilation,
        dimension_numbers=("NC" + space, "OI" + space, "NC" + space),
    )
    # features (C, *kernel), C outermost: a group's channels are a slice
    features = np.asarray(patches).reshape(patches.shape[0], patches.shape[1], -1)
    per_group = features.shape[1] // layer.groups
    hessians = []
    for g in range(layer.groups):
        part = features[:, g * per_group : (g + 1) * per_group]
        flat = np.moveaxis(part, 1, -1).reshape(-1, per_group).astype(np.float64)
        hessians.append(flat.T @ flat)
    return hessians


def _gptq_layer(layer, stored, hessians, damp: float, act_order: bool):
    """(``stored``, the round-to-nearest ``qarray.nn`` layer of ``layer``,
    with the values and scales GPTQ gives the float weights instead; those
    weights dequantized, in the float layer's shape)."""
    w = np.asarray(layer.weight, np.float64).reshape(layer.weight.shape[0], -1)
    bits = 4 if stored.precision == "int4" else 8
    rows = np.array_split(np.arange(w.shape[0]), len(hessians))
    values, scales = [], []
    for index, h in zip(rows, hessians, strict=True):
        v, s = gptq(w[index], h, bits=bits, group_size=stored.group_size, damp=damp,
                    act_order=act_order)  # fmt: skip
        values.append(v)
        scales.append(s)
    values, scale = np.concatenate(values), np.concatenate(scales)
    if bits == 4:
        groups = values.reshape(*scale.shape, -1) * scale[..., None].astype(np.float64)
        back = groups.reshape(values.shape)
        qvalue = np.asarray(pack_nibbles(jnp.asarray(values)))
    else:
        back = values * scale[:, None].astype(np.float64)
        qvalue = values
    error = float(np.linalg.norm(w - back) / max(np.linalg.norm(w), 1e-30))
    parts = (jnp.asarray(qvalue), jnp.asarray(scale))
    new = eqx.tree_at(lambda n: (n.qvalue, n.scale), stored, parts)
    dense = jnp.asarray(back.reshape(layer.weight.shape), jnp.float32)
    return dataclasses.replace(new, stored_error=error), dense


def calibrated(model, data, quantize_layer: Callable, *, damp=0.01, act_order=False):
    """``model`` with each ``eqx.nn.Linear`` / ``eqx.nn.Conv`` that
    ``quantize_layer`` (``qnn.quantize``'s conversion of one layer) stores
    int8 or int4 quantized by GPTQ on ``data`` instead, in tree order, each
    on the inputs the layers before it hand it (module doc); the others as
    they are (``qnn.quantize`` converts them after).

    The layers before run as float layers holding their dequantized GPTQ
    weights: the weight-only products of the stored layers, in a model of
    unchanging structure, so one compiled forward serves every layer (with
    ``activations="int8"`` the calibration inputs are the weight-only
    model's)."""
    data = jnp.asarray(data)
    seen: list[tuple[int, np.ndarray]] = []

    def sink(index, x):
        seen.append((index, np.asarray(x)))

    recording = _map_targets(model, lambda i, n: _Recorder(n, i, sink))
    run = eqx.filter_jit(lambda m, d: jax.vmap(m)(d))
    layers = [n for n in jax.tree.leaves(model, is_leaf=_is_target) if _is_target(n)]
    chosen = {}
    for i, layer in enumerate(layers):
        stored = quantize_layer(layer)
        if not isinstance(stored, Linear | Conv) or stored.precision == "float32":
            continue  # ``where`` declined it, or it stays float
        seen.clear()
        jax.block_until_ready(run(recording, data))
        jax.effects_barrier()
        inputs = np.stack([x for index, x in seen if index == i])
        chosen[i], dense = _gptq_layer(
            layer, stored, _hessians(layer, inputs), damp, act_order
        )
        # (the recorders' layers are the targets here: tree order as before)
        recording = _map_targets(
            recording,
            lambda j, n, i=i, dense=dense: (
                eqx.tree_at(lambda m: m.weight, n, dense) if j == i else n
            ),
        )
    return _map_targets(model, lambda i, n: chosen.get(i, n))
