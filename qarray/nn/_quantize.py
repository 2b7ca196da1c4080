"""``quantize(model)`` and ``freeze(model)``: quantized copies of any equinox
model, in the manner of torchao's ``quantize_`` and qwix's ``quantize_model``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax

from ._calibrate import Calibration, calibrated
from ._config import QuantConfig
from ._kinds import FLOAT_LAYERS, QUANTIZED_LAYERS, quantizable, quantized
from ._weights import frozen_together


def _replace(model, kind, convert: Callable):
    """``model`` with every node of type ``kind`` (a type or a tuple of them)
    replaced by ``convert(node)``."""
    return jax.tree.map(
        lambda node: convert(node) if isinstance(node, kind) else node,
        model,
        is_leaf=lambda node: isinstance(node, kind),
    )


def quantize(
    model,
    config: QuantConfig | None = None,
    *,
    where: Callable[[eqx.Module], bool] | None = None,
    trainable: bool = False,
    data=None,
    **options,
):
    """A copy of ``model`` quantized as ``config`` (a ``QuantConfig``; its
    fields may be given as keywords instead, or to change some of it:
    ``quantize(model, precision="int4")``), with every ``eqx.nn.Linear``,
    ``eqx.nn.Conv`` (``Conv1d``, ``Conv2d``, ``Conv3d``),
    ``eqx.nn.ConvTranspose`` (1-3d)
    and ``eqx.nn.Embedding`` that ``where(layer)`` accepts (default: all)
    replaced by a ``qarray.nn.Linear`` (weights ``(out, in)``: layout "nk",
    one scale per output channel), ``qarray.nn.Conv``,
    ``qarray.nn.ConvTranspose`` or ``qarray.nn.Embedding`` (one scale per row
    of the table); every other node (normalisation, convolutions with
    non-zero padding modes, ...) is kept as it is. Embeddings take
    ``precision`` and ``trainable``; their lookups have no activations to
    quantize. ``eqx.nn.GRUCell`` and ``eqx.nn.LSTMCell`` keep their class,
    their input and hidden matrices replaced by bias-free quantized layers
    (the cells' biases stay as they are). A float ``qarray.nn.SpectralConv``
    stores its complex weights quantized (rows of ``2 * in`` real and
    imaginary parts per output channel and mode; int4 where ``group_size``
    divides ``2 * in``, else int8).

    ``trainable=False``: weights quantized now and stored int8 (serving);
    ``True``: kept float and quantized on every call with a straight-through
    gradient (quantization-aware training; ``freeze`` exports it).
    ``activations``: "float32" (weight-only) or "int8" (each quantized layer's
    input quantized per row too). ``precision``: "int8" (default), "int4"
    (each output channel's weights packed in groups of
    ``group_size``, default 128, along the input axis: a layer whose input
    width, ``in_features`` or ``C / groups * prod(kernel_size)``, the group
    size does not divide is quantized int8; weight-only, or W4A8 for Linear
    layers with ``activations="int8"``: int4 convolutions are weight-only) or
    "float32" (nothing replaced). ``matmul_precision``: every quantized
    layer's products' ``precision`` (JAX's meaning; ``QuantConfig``).

    A bfloat16 (or float16) model (``eqx.nn.Linear(..., dtype=jnp.bfloat16)``,
    or a float32 one cast leaf by leaf) quantizes from its own weights'
    values (scales float32); its biases, a cell's biases and a trainable
    layer's weights keep the model's dtype, each layer answers in its
    input's dtype and an embedding in its table's: the model runs in
    bfloat16 end to end, with int8 weights.

    ``where`` sees the model's own layer objects, so keeping the first and last
    layers float is ``where=lambda l: l not in (mlp.layers[0], mlp.layers[-1])``
    (compared by identity). Layers with a ``"scalar"`` input or output stay
    float: one input or output feature leaves nothing to gain.

    ``method``: "rtn" (round-to-nearest, the default) or "gptq": each
    ``eqx.nn.Linear`` and ``eqx.nn.Conv`` quantized by GPTQ on ``data``, the
    model's calibration inputs ``(n, *example)`` (the model takes one
    example; ``jax.vmap`` runs it on them), layer by layer through the
    already-quantized layers before it (``qarray.nn._calibrate``); stored
    weights only (``trainable=False``); other layers round-to-nearest.
    "awq": a scale per input channel of each ``eqx.nn.Linear`` / ``Conv``
    (groups 1) searched on ``data`` for the least output error (activation-
    aware: ``mean|x|^alpha`` over AWQ's grid of alpha), the weights
    multiplied by it before round-to-nearest and the input divided by it (the
    layer's ``channel_scale``: a multiply before the product, as an equinox
    model has no graph to fold it into the layer before); then each row's
    (int4: each group's) range clipped to the ratio of its max |w|, 1 down to
    0.525, that moves the row's outputs on ``data`` the least (AWQ's
    clipping search).

    W8A8 (``activations="int8"``), calibrated on ``data``:
    ``smoothquant=alpha`` in [0, 1] migrates the input's outlier channels
    into the weights (``channel_scale = max|x|^alpha / max|W|^(1-alpha)``);
    ``static=True`` (or "tensor") rounds each layer's input to one int8 scale
    calibrated on ``data`` (its ``activation_scale``: the absmax of the
    calibration inputs / 127) instead of a scale measured per row and call;
    ``static="channel"``: a range per input channel (as a channel scale
    folded into the weights and one activation scale). ``smoothquant`` and
    ``static`` combine with ``method`` ("gptq" quantizes the smoothed
    weights), except that a channel scale is chosen once (AWQ, SmoothQuant
    or ``static="channel"``).
    """
    config = as_config(config, options)
    precision, activations = config.precision, config.activations
    group_size = config.group_size
    calibration = _calibration(config, data, trainable)
    # round-to-nearest stored weights: each layer converted trainable, then
    # all of them stored by one compiled program (``_frozen``), where frozen
    # one by one each layer shape would compile its own
    store_together = calibration is None and not trainable
    converted = []

    def convert(layer):
        if where is not None and not where(layer):
            return layer
        if not quantizable(layer):  # a SpectralConv or cell quantized already
            return layer
        new = quantized(
            layer,
            precision,
            group_size,
            trainable=trainable or store_together,
            activations=activations,
            matmul_precision=config.matmul_precision,
        )
        converted.append(new)
        return new

    if calibration is not None:
        model = calibrated(model, data, convert, calibration)
    model = _replace(model, FLOAT_LAYERS, convert)
    if not store_together:
        return model
    fresh = {id(layer) for layer in _layers(converted)}  # not the model's own
    return _frozen(model, lambda layer: id(layer) in fresh)


def as_config(config: QuantConfig | None, options: dict) -> QuantConfig:
    """``config`` with the keyword ``options`` (QuantConfig's fields) applied:
    the keywords are shorthand for it (an unknown one is a TypeError)."""
    try:
        if config is None:
            return QuantConfig(**options)
        return config.replace(**options) if options else config
    except TypeError as error:
        if "unexpected keyword" not in str(error):
            raise
        known = ", ".join(f.name for f in dataclasses.fields(QuantConfig))
        raise TypeError(
            f"quantize: unknown option {error}; QuantConfig's are {known}"
        ) from None


def _calibration(config: QuantConfig, data, trainable: bool):
    """The calibration ``config`` asks for (a ``Calibration``), or None for
    round-to-nearest with dynamic activations (no data needed)."""
    if not config.calibrated:
        return None
    asked = [f"method={config.method!r}"] * (config.method != "rtn")
    asked += [f"smoothquant={config.smoothquant!r}"] * (config.smoothquant is not None)
    asked += [f"static={config.static!r}"] * bool(config.static)
    if data is None:
        raise ValueError(
            f"quantize: {', '.join(asked)} needs data=X, calibration inputs."
        )
    if trainable:
        raise ValueError(
            f"quantize: {', '.join(asked)} chooses stored weights: trainable=False."
        )
    return Calibration(
        method=config.method,
        smoothquant=config.smoothquant,
        static=config.static_mode or False,
        clip=config.clip,
    )


def freeze(model):
    """A copy of ``model`` with every trainable ``qarray.nn.Linear``,
    ``qarray.nn.Conv`` and ``qarray.nn.Embedding`` stored as the int8 (or
    int4) weights and scales it quantizes to
    (the export after quantization-aware training: the same outputs, a
    quarter of the bytes). Eager: call it outside ``jit``."""

    return _frozen(model, lambda _: True)


def _layers(tree) -> list:
    """The quantized layers in ``tree``, in its leaves' order."""

    def is_layer(node) -> bool:
        return isinstance(node, QUANTIZED_LAYERS)

    return [n for n in jax.tree.leaves(tree, is_leaf=is_layer) if is_layer(n)]


def _frozen(model, chosen: Callable) -> eqx.Module:
    """``model`` with its quantized layers that ``chosen(layer)`` accepts
    frozen, all of them by one compiled program (``frozen_together``)."""
    layers = {id(layer): layer for layer in _layers(model) if chosen(layer)}
    frozen = dict(zip(layers, frozen_together(list(layers.values())), strict=True))
    return _replace(model, QUANTIZED_LAYERS, lambda layer: frozen.get(id(layer), layer))
