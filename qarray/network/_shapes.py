"""The network's shape rules: one function for declared and traced shapes.

Layer i maps width K_i to N_i (K_0 = x.shape[-1], K_{i+1} = N_i). Its weights
are ``(*B, K, N)`` (layout "kn") or ``(*B, N, K)`` ("nk"), ``w_q.scale`` is
``qvalue.shape[:-1]`` and the bias ``(*B', N)``. Leading axes ``B`` are batch
axes: they index x's leading axes from the left, ``y[b] = net(x[b],
params[b])``, and axes of size 1 broadcast. Errors name fields by the
Tesseract contract's paths (``layers.[2].w_q.scale``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from .._ops import DEFAULT_GROUP_SIZE, LAYOUTS, PRECISIONS, check_group_size
from ..nn import Linear


@dataclass(frozen=True)
class LayerShapes:
    """The shapes one layer gives (None for absent arrays)."""

    weights: tuple[int, ...]  # w, or w_q.qvalue
    scale: tuple[int, ...] | None  # w_q.scale (None for w)
    bias: tuple[int, ...] | None
    layout: str
    dense: bool  # w given (else w_q)
    precision: str = "int8"
    group_size: int = DEFAULT_GROUP_SIZE  # int4 only

    @property
    def name(self) -> str:
        """The weights' field name within the layer."""
        return "w" if self.dense else "w_q.qvalue"


@dataclass(frozen=True)
class NetworkShape:
    """What ``network_shape`` found: the batch axes every output carries, y's
    shape, and the widths K0, N0, N1, ..."""

    batch: tuple[int, ...]
    y: tuple[int, ...]
    widths: tuple[int, ...]

    @property
    def rows(self) -> int:
        """Rows every layer computes: all of y's axes but the last."""
        return math.prod(self.y[:-1])

    @property
    def flops(self) -> int:
        """Multiply-adds of every layer's product, times 2."""
        return sum(2 * self.rows * k * n for k, n in itertools.pairwise(self.widths))


def _broadcast_batch(batch, shape, what, sources) -> tuple[int, ...]:
    """``batch`` and ``shape`` broadcast (both aligned on the left, axes of size
    1 broadcast), or a ValueError naming ``what`` and the axes it met."""
    out = list(batch) + [1] * (len(shape) - len(batch))
    for axis, size in enumerate(shape):
        if size != 1 and out[axis] not in (1, size):
            raise ValueError(
                f"{what} has batch axes {shape}, which do not match {tuple(batch)} "
                f"(from {', '.join(sources)}): batch axes index x's leading axes, "
                "and must be equal or 1"
            )
        out[axis] = max(out[axis], size) if size != 0 else 0
    return tuple(out)


def network_shape(x: tuple[int, ...], layers: list[LayerShapes],
                  adapters=None) -> NetworkShape:  # fmt: skip
    """Check that a network's shapes chain (module doc), and give its output
    shapes; ``adapters``: the ``lora`` field's ``(a_shape, b_shape)`` or None
    per layer (``check_adapter_shapes``), whose leading axes are batch axes
    like the weights'. Raises ValueError naming the field and the shapes."""
    if len(x) < 1:
        raise ValueError("x must have shape (..., K) with at least one axis, got ()")
    width, source = x[-1], f"x {x}"
    batch: tuple[int, ...] = ()
    sources: list[str] = []
    widths = [width]
    for i, layer in enumerate(layers):
        name = f"layers.[{i}].{layer.name}"
        axes = "(..., K, N)" if layer.layout == "kn" else "(..., N, K)"
        shape = layer.weights
        if len(shape) < 2:
            raise ValueError(
                f"{name} must have shape {axes} (layout {layer.layout!r}), got {shape}"
            )
        k, n = shape[-2:] if layer.layout == "kn" else shape[:-3:-1]
        _check_precision(i, layer, name, shape)
        if layer.precision == "int4" and not layer.dense:
            k = 2 * shape[-1]  # two int4 values a byte
        if k != width:
            raise ValueError(
                f"{name} {shape} has K = {k} (layout {layer.layout!r}: {axes}), but "
                f"its input is {source} of width {width}"
            )
        if layer.precision == "int4" and k % layer.group_size:
            raise ValueError(
                f"{name} {shape} has K = {k}, which layers.[{i}].group_size = "
                f"{layer.group_size} does not divide (int4 groups run along K)"
            )
        if layer.precision == "int4" and layer.scale is not None:
            want = (*shape[:-1], k // layer.group_size)
            if layer.scale != want:
                raise ValueError(
                    f"layers.[{i}].w_q.scale must have shape {want} (one scale per "
                    f"group of {layer.group_size} of {name} {shape}, K = {k}), got "
                    f"{layer.scale}"
                )
        elif layer.scale is not None and layer.scale != shape[:-1]:
            raise ValueError(
                f"layers.[{i}].w_q.scale must have shape {shape[:-1]} (one scale per "
                f"row of {name} {shape}), got {layer.scale}"
            )
        if layer.bias is not None and (not layer.bias or layer.bias[-1] != n):
            raise ValueError(
                f"layers.[{i}].bias must have shape (..., N) with N = {n} to match "
                f"{name} {shape} (layout {layer.layout!r}), got {layer.bias}"
            )
        for what, array_batch in (
            (name, shape[:-2]),
            (f"layers.[{i}].bias", (layer.bias or (0,))[:-1]),
        ):
            if array_batch:
                batch = _broadcast_batch(batch, array_batch, what, sources)
                sources.append(f"{what} {array_batch}")
        width, source = n, f"the output of layers.[{i}]"
        widths.append(n)
    if adapters is not None:
        check_adapter_shapes(widths, adapters)
        for i, shapes in enumerate(adapters):
            for part, shape in zip("ab", shapes or (), strict=False):
                if len(shape) > 2:
                    what = f"lora.[{i}].{part}"
                    batch = _broadcast_batch(batch, tuple(shape[:-2]), what, sources)
                    sources.append(f"{what} {tuple(shape[:-2])}")
    lead = x[:-1]
    if len(batch) > len(lead):
        raise ValueError(
            f"the layers' batch axes {batch} (from {', '.join(sources)}) are more "
            f"than x {x} has leading axes: batch axes index x's leading axes"
        )
    if batch:
        batch = _broadcast_batch(batch, lead[: len(batch)], f"x {x}", sources)
    y = (*batch, *lead[len(batch) :], width)
    return NetworkShape(batch, y, tuple(widths))


def _check_precision(i: int, layer: LayerShapes, name: str, shape) -> None:
    if layer.precision not in PRECISIONS:
        raise ValueError(
            f"layers.[{i}].precision must be one of {PRECISIONS}, got "
            f"{layer.precision!r}"
        )
    if layer.precision == "float32" and not layer.dense:
        raise ValueError(
            f"layers.[{i}].w_q: precision 'float32' runs dense w as given (not "
            "quantized): give w, or precision 'int8' / 'int4' for w_q"
        )
    if layer.precision == "int4":
        if layer.layout != "nk":
            raise ValueError(
                f"layers.[{i}].layout must be 'nk' for precision 'int4' (weights "
                f"(N, K), groups along K), got {layer.layout!r} for {name} {shape}"
            )
        check_group_size(f"layers.[{i}].group_size", layer.group_size)


def linear_shapes(layer: Linear) -> LayerShapes:
    """A ``qarray.nn.Linear``'s array shapes, for ``network_shape``."""
    return LayerShapes(
        tuple((layer.weight if layer.trainable else layer.qvalue).shape),
        None if layer.scale is None else tuple(layer.scale.shape),
        None if layer.bias is None else tuple(layer.bias.shape),
        layer.layout,
        dense=layer.trainable,
        precision=layer.precision,
        group_size=layer.group_size or DEFAULT_GROUP_SIZE,
    )


def layer_shapes(layer: dict, shape_of=lambda a: tuple(a.shape)) -> LayerShapes | None:
    """The shapes of a layer given as the contract's dict (``w`` or ``w_q``
    ``{qvalue, scale}``, ``bias``, ``layout``); ``shape_of`` reads an array's
    shape (a raw JSON value's declared one, before decoding). None when the
    layer is malformed in a way its field validators name."""
    if not isinstance(layer, dict):
        return None
    w, w_q, bias = layer.get("w"), layer.get("w_q"), layer.get("bias")
    layout = layer.get("layout", "kn")
    if layout not in LAYOUTS or (w is None) == (w_q is None):
        return None
    if w is None and not isinstance(w_q, dict):
        return None
    weights = shape_of(w if w is not None else w_q.get("qvalue"))
    scale = None if w is not None else shape_of(w_q.get("scale"))
    bias_shape = None if bias is None else shape_of(bias)
    if weights is None or (w is None and scale is None):
        return None
    if bias is not None and bias_shape is None:
        return None
    precision = layer.get("precision", "int8")
    group_size = layer.get("group_size", DEFAULT_GROUP_SIZE)
    return LayerShapes(
        weights, scale, bias_shape, layout, w is not None, precision, group_size
    )


def check_adapter_shapes(widths, adapters) -> None:
    """The ``lora`` field's shapes against the network's ``widths`` (K0, N0,
    N1, ...: layer i maps ``widths[i]`` to ``widths[i + 1]``): one entry per
    layer, each None or ``(a_shape, b_shape)`` with ``a (..., rank, K_i)``,
    ``b (..., N_i, rank)`` (leading axes: batch axes, which ``network_shape``
    broadcasts), ``1 <= rank <= min(K_i, N_i)``; a ValueError naming
    ``lora.[i]`` otherwise."""
    layers = len(widths) - 1
    if len(adapters) != layers:
        raise ValueError(
            f"lora has {len(adapters)} entries for a network of {layers} layers "
            "(one adapter or null per layer)"
        )
    for i, shapes in enumerate(adapters):
        if shapes is None:
            continue
        (a, b), k, n = (tuple(s) for s in shapes), widths[i], widths[i + 1]
        rank = a[-2] if len(a) >= 2 else None
        if rank is None or a[-1] != k or not 1 <= rank <= min(k, n):
            raise ValueError(
                f"lora.[{i}].a must be (..., rank, {k}) for layers.[{i}] (K = {k}, "
                f"1 <= rank <= {min(k, n)}), got {a}"
            )
        if b[-2:] != (n, rank):
            raise ValueError(
                f"lora.[{i}].b must be (..., {n}, {rank}) for layers.[{i}] (N = {n}) "
                f"and lora.[{i}].a {a}, got {b}"
            )
