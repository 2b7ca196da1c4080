"""LoRA adapters on quantized layers (QLoRA): ``qnn.lora(model, rank,
key=k)`` trains a low-rank correction next to frozen int8 / int4 weights, and
``qnn.merge(model)`` folds it back into float weights for re-quantization.

A ``Linear`` with stored weights ``W (N, K)`` becomes ``LoRA(base, a, b)``:
``y = base(x) + (alpha / rank) * (x a^T) b^T`` with ``a (rank, K)`` small
random and ``b (N, rank)`` zero (so the adapted model starts as the base).
A ``Conv``'s adapter is a ``rank``-channel convolution with the layer's
kernel, stride, padding and dilation (``a (rank, C, *kernel)``), then a
1 x 1 one (``b (N, rank)``); groups 1. The base's arrays are frozen: only
``a`` and ``b`` are adapter leaves (``lora_spec`` marks them for
``eqx.partition``), so gradients, optimiser state and the wire carry only
those; the base's products read its quantized payload, and no float copy of
its weights exists (``merge`` makes one, once, at the end).
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from .._ops import dequantize
from ._conv import Conv, ConvTranspose
from ._linear import Linear


class Adapter(eqx.Module):
    """A ``Linear`` layer's low-rank update without the layer: ``x (..., K)
    -> (alpha / rank) (x a^T) b^T (..., N)``, ``a (rank, K)``, ``b (N,
    rank)``. What a ``Network`` adds to its layers (the Tesseract contract's
    ``lora`` field); ``LoRA`` holds one with its base."""

    a: jax.Array
    b: jax.Array
    alpha: float = eqx.field(static=True)

    @property
    def rank(self) -> int:
        return self.a.shape[-2]

    def __call__(self, x):
        return (self.alpha / self.rank) * ((x @ jnp.swapaxes(self.a, -1, -2)) @
                                           jnp.swapaxes(self.b, -1, -2))  # fmt: skip


class LoRA(eqx.Module):
    """A frozen quantized layer (``base``: a ``qarray.nn.Linear`` or
    ``Conv``) and its trainable low-rank adapter ``a``, ``b`` (module doc);
    called as the base is."""

    base: Any
    a: jax.Array
    b: jax.Array
    alpha: float = eqx.field(static=True)

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def __call__(self, x, *, key=None):
        del key
        frozen = jax.tree.map(lax.stop_gradient, self.base)
        return frozen(x) + (self.alpha / self.rank) * self.update(x)

    def update(self, x):
        """The adapter's term ``(x a^T) b^T`` (a convolution: the ``rank``
        channels of the kernel-shaped ``a``, then ``b`` pointwise)."""
        x = jnp.asarray(x)
        if isinstance(self.base, Linear):
            return Adapter(self.a, self.b, float(self.rank))(x)
        base = self.base
        nsp = len(base.kernel_size)
        space = "DHW"[3 - nsp :]
        numbers = ("NC" + space, "OI" + space, "NC" + space)
        batched = x.ndim == nsp + 2
        params = base._conv_parameters()
        low = lax.conv_general_dilated(
            x if batched else x[None],
            self.a,
            params["window_strides"],
            params["padding"],
            lhs_dilation=params.get("lhs_dilation"),
            rhs_dilation=params["rhs_dilation"],
            dimension_numbers=numbers,
        )
        out = jnp.einsum("nr,br...->bn...", self.b, low)
        return out if batched else out[0]


def _widths(layer) -> tuple[int, int, tuple[int, ...]]:
    """(inputs, outputs, the kernel) of a stored quantized layer."""
    if isinstance(layer, Conv):
        if layer.groups != 1 or isinstance(layer, ConvTranspose):
            raise TypeError(
                "lora adapts convolutions of groups 1 (not transposed ones), got "
                f"{type(layer).__name__} with groups={layer.groups}."
            )
        return layer.in_channels, layer.out_channels, tuple(layer.kernel_size)
    shape = jax.typeof(layer.quantized()).shape  # (N, K) "nk", (K, N) "kn"
    n, k = shape if layer.layout == "nk" else shape[::-1]
    return k, n, ()


def _adaptable(node) -> bool:
    """What ``lora`` adapts: a stored quantized ``Linear`` or ``Conv``."""
    return isinstance(node, Linear | Conv) and not node.trainable


def adapter_shapes(model, rank: int, where=None) -> list[tuple[tuple, tuple]]:
    """``(a.shape, b.shape)`` of each adapter ``lora(model, rank)`` makes,
    in tree order: ``a (rank, K, *kernel)``, ``b (N, rank)``."""
    shapes = []
    for node in jax.tree.leaves(model, is_leaf=_adaptable):
        if _adaptable(node) and (where is None or where(node)):
            k, n, kernel = _widths(node)
            shapes.append(((rank, k, *kernel), (n, rank)))
    return shapes


def with_adapters(model, adapters, *, alpha: float, where=None):
    """``model`` with the i-th layer ``lora`` would adapt wrapped in
    ``LoRA(layer, a_i, b_i, alpha)`` for ``adapters[i] = (a_i, b_i)`` (left
    as it is where ``adapters[i]`` is None): how a served model takes the
    adapters of a request."""
    given = iter(adapters)

    def wrap(node):
        if not _adaptable(node) or (where is not None and not where(node)):
            return node
        pair = next(given)
        return node if pair is None else LoRA(node, *pair, float(alpha))

    return jax.tree.map(wrap, model, is_leaf=_adaptable)


def lora(model, rank: int, *, alpha: float | None = None, where=None, key):
    """``model`` with every stored quantized ``Linear`` and ``Conv`` (that
    ``where(layer)`` accepts) wrapped in a ``LoRA`` of ``rank`` (``alpha``
    defaults to ``rank``: a scale of 1); ``a`` uniform in
    ``+-1 / sqrt(fan_in)``, ``b`` zero."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora requires a positive int rank, got {rank!r}.")
    adapters = []
    for i, (a, b) in enumerate(adapter_shapes(model, rank, where)):
        bound = 1.0 / math.sqrt(math.prod(a[1:]))
        sub = jax.random.fold_in(key, i)
        adapters.append(
            (
                jax.random.uniform(sub, a, minval=-bound, maxval=bound),
                jnp.zeros(b, jnp.float32),
            )
        )
    alpha = float(rank if alpha is None else alpha)
    return with_adapters(model, adapters, alpha=alpha, where=where)


def _is_lora(node) -> bool:
    return isinstance(node, LoRA)


def lora_spec(model):
    """A filter spec for ``eqx.partition``: True on every adapter's ``a``
    and ``b``, False elsewhere (the frozen bases included)."""

    def spec(node):
        if _is_lora(node):
            frozen = jax.tree.map(lambda _: False, node.base)
            return LoRA(frozen, True, True, node.alpha)
        return jax.tree.map(lambda _: False, node)

    return jax.tree.map(spec, model, is_leaf=_is_lora)


def merge(model):
    """``model`` with every ``LoRA`` folded into its base: a trainable
    (float32 weights, quantized every call) layer of the base's precision,
    ``W + (alpha / rank) b a``; ``qnn.freeze`` stores it quantized again.
    Eager."""

    def fold(node: LoRA):
        base = node.base
        w = dequantize(base.quantized())
        delta = (node.alpha / node.rank) * jnp.einsum("nr,r...->n...", node.b, node.a)
        if isinstance(base, Linear):
            dense = w + delta.reshape(w.shape) if base.layout == "nk" else w + delta.T
            return Linear(
                dense,
                base.bias,
                layout=base.layout,
                activations=base.activations,
                precision=base.precision,
                group_size=base.group_size,
            )
        shape = (base.out_channels, base.in_channels, *base.kernel_size)
        dense = w.reshape(shape) + delta
        return Conv(
            dense,
            base.bias,
            stride=base.stride,
            padding=base.padding,
            dilation=base.dilation,
            groups=base.groups,
            activations=base.activations,
            precision=base.precision,
            group_size=base.group_size,
        )

    return jax.tree.map(
        lambda n: fold(n) if _is_lora(n) else n, model, is_leaf=_is_lora
    )
