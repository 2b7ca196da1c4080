"""LoRA adapters on quantized layers (QLoRA): ``qnn.lora(model, rank,
key=k)`` trains a low-rank correction next to frozen int8 / int4 weights, and
``qnn.merge(model)`` folds it back into float weights for re-quantization.

A ``Linear`` with stored weights ``W (N, K)`` becomes ``LoRA(base, a, b)``:
``y = base(x) + (alpha / rank) * (x a^T) b^T`` with ``a (rank, K)`` small
random and ``b (N, rank)`` zero (so the adapted model starts as the base).
The other kinds, all in the same "nk" sense (``merge`` adds ``(alpha /
rank) b a`` to the weights the base multiplies by):

- ``Conv`` and ``ConvTranspose`` (groups 1): a ``rank``-channel convolution
  (transposed convolution) with the layer's kernel, stride, padding,
  output padding and dilation (``a (rank, C, *kernel)``), then a 1 x 1 one
  (``b (N, rank)``).
- ``Embedding`` (table ``(V, dim)``), as peft's: ``index -> b a[:, index]``,
  ``a (rank, V)`` (its input is one-hot: ``a`` starts uniform in +-1),
  ``b (dim, rank)``.
- ``eqx.nn.GRUCell`` / ``LSTMCell``: their ``weight_ih`` and ``weight_hh``
  are bias-free ``Linear`` layers once quantized, each adapted as one
  (``LoRA @ x``, as the cell applies them): two adapters per cell.
- ``SpectralConv`` (complex weights ``(C, N, *modes)``): ``a (rank, C,
  *modes)`` complex, a ``rank``-channel Fourier layer with the base's modes,
  then ``b (N, rank)`` complex, shared by every mode, on the kept modes
  (no transform between them): ``dW[:, :, m] = (b a[:, :, m])^T``; real and
  imaginary parts on a trailing axis of 2, as ``SpectralConv.weight`` (real
  leaves for the optimiser and the wire). It is the convolution's adapter
  with the modes for the kernel: ``2 rank (C prod(modes) + N)`` parameters
  against the layer's ``2 C N prod(modes)`` (about ``rank / N``), where a
  per-mode ``b (N, rank, *modes)`` (a rank-``rank`` update of each mode's
  matrix) costs ``2 rank (C + N) prod(modes)`` (twice as many for C = N)
  and a mode-independent ``a (rank, C)`` (``4 rank (C + N)``) can only add
  the same channel mixing to every mode. examples/neural_operator/qlora.py
  fine-tunes that example's FNO this way (its 1 x 1 convolutions adapted
  too); on it, a per-mode ``b`` bought no accuracy for its twice the
  parameters, and sharing ``a`` across the modes as well lost some
  (docs/nn.md's QLoRA section compares them).

The base's arrays are frozen: only ``a`` and ``b`` are adapter leaves
(``lora_spec`` marks them for ``eqx.partition``), so gradients, optimiser
state and the wire carry only those; the base's products read its quantized
payload, and no float copy of its weights exists (``merge`` makes one, once,
at the end).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from .._primitives import dequantize
from ._conv import Conv, ConvTranspose
from ._embedding import Embedding
from ._linear import Linear
from ._spectral import SpectralConv


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

    def __call__(self, x, precision=None):
        """In the promoted dtype of ``x``, ``a`` and ``b``, the products at
        ``precision`` (JAX's meaning)."""
        low = jnp.matmul(x, jnp.swapaxes(self.a, -1, -2), precision=precision)
        up = jnp.matmul(low, jnp.swapaxes(self.b, -1, -2), precision=precision)
        return (self.alpha / self.rank) * up


class LoRA(eqx.Module):
    """A frozen quantized layer (``base``: a stored ``qarray.nn.Linear``,
    ``Conv``, ``ConvTranspose``, ``Embedding`` or ``SpectralConv``) and its
    trainable low-rank adapter ``a``, ``b`` (module doc); called as the base
    is (``lora @ x`` too, as a recurrent cell applies its matrices).

    It answers in the base's output dtype (x's; an embedding's table's):
    the adapter's term is computed in the promoted dtype of x and the
    adapter (float32 adapters on a bfloat16 model: float32), added to the
    base's output and rounded once; its products run at the base's
    ``matmul_precision``. ``a`` and ``b`` get their gradients in their own
    dtype."""

    base: Any
    a: jax.Array
    b: jax.Array
    alpha: float = eqx.field(static=True)

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def _frozen(self):
        return jax.tree.map(lax.stop_gradient, self.base)

    def __call__(self, x, *, key=None):
        del key
        frozen = self._frozen()
        if isinstance(frozen, SpectralConv):  # one FFT pair for base and adapter
            base = frozen.mixing()

            def mix(kept):
                return base(kept) + self.scaling * self._spectral_update(kept)

            return frozen.through_modes(x, mix)
        y = frozen(x)
        return (y + self.scaling * self.update(x)).astype(y.dtype)

    def __matmul__(self, x):
        """``(W + (alpha / rank) b a) @ x`` for ``x (K,)`` or ``(K, B)``: a
        ``Linear`` inside an ``eqx.nn.GRUCell`` / ``LSTMCell``."""
        x = jnp.asarray(x)
        y = self._frozen() @ x
        low = jnp.matmul(self.a, x, precision=self._precision)
        update = jnp.matmul(self.b, low, precision=self._precision)
        return (y + self.scaling * update).astype(y.dtype)

    @property
    def _precision(self):
        return self.base.matmul_precision

    def _spectral_update(self, kept):
        """The adapter on a ``SpectralConv``'s kept modes ``(..., C, *modes)``
        (complex): ``sum_r b[o, r] sum_i a[r, i, m] kept[i, m]``."""
        a, b = _complex(self.a), _complex(self.b)  # (rank, C, *modes), (N, rank)
        letters = "xyz"[: a.ndim - 2]
        low = jnp.einsum(
            f"...i{letters},ri{letters}->...r{letters}",
            kept,
            a,
            precision=self._precision,
        )
        return jnp.einsum(
            f"or,...r{letters}->...o{letters}", b, low, precision=self._precision
        )

    def update(self, x):
        """The adapter's term before its ``alpha / rank`` (module doc): ``(x
        a^T) b^T``; a convolution's: the ``rank`` channels of the
        kernel-shaped ``a`` with the layer's geometry, then ``b`` pointwise;
        an embedding's ``b a[:, x]``; a spectral convolution's: its kept
        modes through ``a`` then ``b``, back to space."""
        x = jnp.asarray(x)
        base, precision = self.base, self._precision
        if isinstance(base, Linear):
            return Adapter(self.a, self.b, float(self.rank))(x, precision)
        if isinstance(base, Embedding):
            rows = jnp.take(self.a, x, axis=1)
            return jnp.einsum("nr,r...->...n", self.b, rows, precision=precision)
        if isinstance(base, SpectralConv):
            return base.through_modes(x, self._spectral_update)
        nsp = len(base.kernel_size)
        space = "DHW"[3 - nsp :]
        numbers = ("NC" + space, "OI" + space, "NC" + space)
        batched = x.ndim == nsp + 2
        params = base._conv_parameters()
        # lax's convolution takes one dtype: x's and a's promoted
        dtype = jnp.result_type(x, self.a)
        low = lax.conv_general_dilated(
            (x if batched else x[None]).astype(dtype),
            self.a.astype(dtype),
            params["window_strides"],
            params["padding"],
            lhs_dilation=params.get("lhs_dilation"),
            rhs_dilation=params["rhs_dilation"],
            dimension_numbers=numbers,
            precision=precision,
        )
        out = jnp.einsum("nr,br...->bn...", self.b, low, precision=precision)
        return out if batched else out[0]


def _complex(parts):
    """Real and imaginary parts on a trailing axis of 2 -> complex64 (a
    bfloat16 adapter's widened: there is no bfloat16 complex)."""
    parts = parts.astype(jnp.float32)
    return lax.complex(parts[..., 0], parts[..., 1])


def _shapes(layer, rank: int) -> tuple[tuple, tuple]:
    """(a.shape, b.shape) of a stored quantized layer's adapter."""
    if isinstance(layer, Conv):
        if layer.groups != 1:
            raise TypeError(
                "lora adapts convolutions (and transposed ones) of groups 1, got "
                f"{type(layer).__name__} with groups={layer.groups}."
            )
        a = (rank, layer.in_channels, *layer.kernel_size)
        return a, (layer.out_channels, rank)
    if isinstance(layer, SpectralConv):  # complex: real and imaginary parts
        return (rank, layer.in_channels, *layer.modes, 2), (
            layer.out_channels,
            rank,
            2,
        )
    shape = jax.typeof(layer.quantized()).shape
    if isinstance(layer, Embedding):  # (num_embeddings, dim): one-hot K
        return (rank, shape[0]), (shape[1], rank)
    n, k = shape if layer.layout == "nk" else shape[::-1]  # (N, K) "nk", (K, N)
    return (rank, k), (n, rank)


def _bound(layer, a_shape) -> float:
    """The half-width of ``a``'s uniform initialisation: ``1 / sqrt(fan_in)``
    (an embedding's input is one-hot: 1); a spectral convolution's, its own
    weights' scale ``1 / (in * out)`` (FNO's initialisation: the adapter's
    first steps move its weights by a similar fraction as a dense layer's)."""
    if isinstance(layer, Embedding):
        return 1.0
    if isinstance(layer, SpectralConv):
        return 1.0 / (layer.in_channels * layer.out_channels)
    return 1.0 / math.sqrt(math.prod(a_shape[1:]))


def _adaptable(node) -> bool:
    """What ``lora`` adapts: a stored quantized ``Linear`` (a recurrent
    cell's matrices included), ``Conv``, ``ConvTranspose``, ``Embedding``
    or ``SpectralConv``."""
    if isinstance(node, Embedding | SpectralConv):
        return not node.trainable and node.precision != "float32"
    return isinstance(node, Linear | Conv) and not node.trainable


def _adapted(model, where):
    return [
        node
        for node in jax.tree.leaves(model, is_leaf=_adaptable)
        if _adaptable(node) and (where is None or where(node))
    ]


def adapter_shapes(model, rank: int, where=None) -> list[tuple[tuple, tuple]]:
    """``(a.shape, b.shape)`` of each adapter ``lora(model, rank)`` makes,
    in tree order: a ``Linear``'s ``a (rank, K)``, ``b (N, rank)`` (a
    recurrent cell: one each for ``weight_ih`` then ``weight_hh``); a
    ``Conv`` / ``ConvTranspose``'s ``a (rank, C, *kernel)``, ``b (N,
    rank)``; an ``Embedding``'s ``a (rank, num_embeddings)``, ``b (dim,
    rank)``; a ``SpectralConv``'s ``a (rank, C, *modes, 2)``, ``b (N, rank,
    2)`` (real and imaginary parts)."""
    return [_shapes(node, rank) for node in _adapted(model, where)]


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


def lora(
    model,
    rank: int,
    *,
    alpha: float | None = None,
    where=None,
    key,
    dtype=jnp.float32,
):
    """``model`` with every stored quantized layer (``Linear``, a recurrent
    cell's matrices, ``Conv``, ``ConvTranspose``, ``Embedding``,
    ``SpectralConv``) that ``where(layer)`` accepts wrapped in a ``LoRA`` of
    ``rank`` (``alpha`` defaults to ``rank``: a scale of 1); ``a`` uniform
    in ``+-1 / sqrt(fan_in)`` (``_bound``), ``b`` zero, both of ``dtype``
    (float32 by default, whatever the model's: the adapters are what
    trains; ``jnp.bfloat16`` for bfloat16 adapters)."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora requires a positive int rank, got {rank!r}.")
    adapters = []
    for i, node in enumerate(_adapted(model, where)):
        a, b = _shapes(node, rank)
        bound = _bound(node, a)
        sub = jax.random.fold_in(key, i)
        adapters.append(
            (
                jax.random.uniform(sub, a, dtype, minval=-bound, maxval=bound),
                jnp.zeros(b, dtype),
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


def delta(node: LoRA):
    """``(alpha / rank) b a``, the adapter's weights in the base's own
    layout: ``(N, K)``, ``(N, C, *kernel)``, an embedding's table ``(V,
    dim)``, a spectral convolution's complex ``(C, N, *modes)``."""
    if isinstance(node.base, SpectralConv):
        a, b = _complex(node.a), _complex(node.b)
        return node.scaling * jnp.einsum("or,ri...->io...", b, a)
    product = node.scaling * jnp.einsum("nr,r...->n...", node.b, node.a)
    return product.T if isinstance(node.base, Embedding) else product


def merge(model):
    """``model`` with every ``LoRA`` folded into its base: a trainable
    (float32 weights, quantized every call; an embedding's table in its
    lookups' dtype) layer of the base's kind, precision and
    ``matmul_precision``, ``W + (alpha / rank) b a`` (``delta``);
    ``qnn.freeze`` stores it quantized again. Eager."""

    def fold(node: LoRA):
        base = node.base
        change = delta(node)
        if isinstance(base, SpectralConv):
            weight = base.spectral_weight() + change
            parts = jnp.stack([jnp.real(weight), jnp.imag(weight)], axis=-1)
            return dataclasses.replace(
                base, weight=parts, qvalue=None, scale=None, stored_error=None
            )
        w = dequantize(base.quantized())
        common = {
            "precision": base.precision,
            "group_size": base.group_size,
            "matmul_precision": base.matmul_precision,
        }
        if isinstance(base, Embedding):
            return Embedding((w + change).astype(base.dtype), **common)
        if isinstance(base, Linear):
            dense = w + change.reshape(w.shape) if base.layout == "nk" else w + change.T
            return Linear(
                dense,
                base.bias,
                layout=base.layout,
                activations=base.activations,
                **common,
            )
        shape = (base.out_channels, base.in_channels, *base.kernel_size)
        extra = (
            {"output_padding": base.output_padding}
            if isinstance(base, ConvTranspose)
            else {}
        )
        return type(base)(
            w.reshape(shape) + change,
            base.bias,
            stride=base.stride,
            padding=base.padding,
            dilation=base.dilation,
            groups=base.groups,
            activations=base.activations,
            **common,
            **extra,
        )

    return jax.tree.map(
        lambda n: fold(n) if _is_lora(n) else n, model, is_leaf=_is_lora
    )
