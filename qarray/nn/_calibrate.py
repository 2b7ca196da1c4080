"""Calibrated quantization of any equinox model: ``qnn.quantize(model,
method="gptq" | "awq", data=X, smoothquant=..., static=...)``.

Layer by layer, in the model's tree order, each ``eqx.nn.Linear`` and
``eqx.nn.Conv`` that ``qnn.quantize`` would replace gets the inputs that reach
it on the calibration data, through the layers before it as already
quantized: the model runs on ``data`` (``jax.vmap`` over its leading axis,
as ``qnn.evaluate`` does) with that layer wrapped in a recorder (a host
callback of its input, the whole batch at once). From them (``_choose``): a
scale per input channel (AWQ's search, SmoothQuant's migration or static per-channel
ranges, ``_scales``), the weights times it rounded by GPTQ (its ``H = X^T X``,
a convolution's over its im2col patches, one per group: ``_gptq.gptq``) or
to nearest (AWQ's clipped first: ``_scales.awq_clip``, a range per row or
int4 group), and a static activation scale; the layer is stored with them.
Every other layer is quantized as ``qnn.quantize`` does it (round-to-nearest).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax import lax

from .._numerics import QMAX, pack_nibbles
from .._ops import PRECISION_BITS
from ._conv import Conv
from ._gptq import gptq
from ._linear import Linear
from ._scales import (
    awq_clip,
    awq_scale,
    channel_statistics,
    columns,
    smoothquant_scale,
    static_channel_scale,
    weight_channel_absmax,
)
from ._weights import dequantized, without_stored_errors

METHODS = ("rtn", "gptq", "awq")
_TARGETS = (eqx.nn.Linear, eqx.nn.Conv)


# the recordings under way, by token: a recorder's callback is the same
# module-level function whatever the call (``_record``), its token a traced
# leaf, so one compiled forward serves every ``calibrated`` of a model
_SINKS: dict[int, list] = {}
_TOKENS = itertools.count()


def _record(index: int, ndim: int, token, x):
    """Appends ``x``'s examples, ``(rows, *x's shape in the layer)``, to
    ``_SINKS[token]`` under ``index``; gives ``x`` back. Under ``vmap`` the
    leading axes of ``x`` (and of ``token``, unbatched) are the batch's."""
    x = np.asarray(x)
    rows = x.reshape(-1, *x.shape[x.ndim - ndim :])
    _SINKS[int(np.asarray(token).reshape(-1)[0])].append((index, rows))
    return x


class _Recorder(eqx.Module):
    """``layer`` as it is, its every input appended to ``_SINKS[token]`` as
    ``(index, rows)`` (``_record``)."""

    layer: Any
    token: jax.Array
    index: int = eqx.field(static=True)

    def __call__(self, x, *, key=None):
        # one host call for the whole batch (vmap_method): jax.debug.callback
        # under vmap calls back once per example, a device-host round trip
        # each (thousands over a calibration: most of a TPU's time in it); x
        # comes back unchanged and the layer computes on it, so the call is
        # part of the result and stays in the program
        record = functools.partial(_record, self.index, x.ndim)
        like = jax.ShapeDtypeStruct(x.shape, x.dtype)
        x = jax.pure_callback(record, like, self.token, x, vmap_method="expand_dims")
        return self.layer(x)


@eqx.filter_jit
def _forward(model, data):
    """``model`` on each example of ``data`` (its leading axis)."""
    return jax.vmap(model)(data)


def device_array(x) -> jax.Array:
    """``x`` as a JAX array (dtype canonical: float64 to float32 without
    x64), by a transfer: ``jnp.asarray`` of a NumPy array compiles a copy
    program of its own for every new shape."""
    return x if isinstance(x, jax.Array) else jax.device_put(np.asarray(x))


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


def _features(layer, inputs: np.ndarray) -> list[np.ndarray]:
    """The inputs as the layer's weight rows see them, per group of rows
    (one for a Linear): ``(n, K)``, a convolution's im2col patches with
    their features ``(C / groups, *kernel)``, C outermost."""
    if isinstance(layer, eqx.nn.Linear):
        return [inputs.reshape(-1, inputs.shape[-1])]
    nsp = layer.num_spatial_dims
    x = inputs.reshape(-1, *inputs.shape[-nsp - 1 :])  # (examples, C, *spatial)
    patches = _patches(
        x,
        kernel=tuple(layer.kernel_size),
        stride=tuple(layer.stride),
        padding=tuple(map(tuple, layer.padding)),
        dilation=tuple(layer.dilation),
    )
    features = np.asarray(patches).reshape(patches.shape[0], patches.shape[1], -1)
    per_group = features.shape[1] // layer.groups
    return [
        np.moveaxis(features[:, g * per_group : (g + 1) * per_group], 1, -1).reshape(
            -1, per_group
        )
        for g in range(layer.groups)
    ]


@functools.partial(jax.jit, static_argnames=("kernel", "stride", "padding", "dilation"))
def _patches(x, *, kernel, stride, padding, dilation):
    """The im2col patches ``(n, C * prod(kernel), *out_spatial)`` of ``x (n,
    C, *spatial)``, C outermost: one program per layer and input shape."""
    space = "DHW"[3 - len(kernel) :]
    return lax.conv_general_dilated_patches(
        x,
        kernel,
        stride,
        padding,
        rhs_dilation=dilation,
        dimension_numbers=("NC" + space, "OI" + space, "NC" + space),
    )


def _gptq_parts(w, features, s_cols, stored, damp, act_order):
    """``stored`` with the values and scales GPTQ gives ``w * s`` for the
    inputs ``features / s`` (per group of rows)."""
    bits = PRECISION_BITS[stored.precision]
    rows = np.array_split(np.arange(w.shape[0]), len(features))
    values, scales = [], []
    for index, f in zip(rows, features, strict=True):
        f = f.astype(np.float64)
        # (X / s)^T (X / s): the scale divides H's rows and columns
        h = (f.T @ f) / np.outer(s_cols, s_cols)
        options = {"damp": damp, "act_order": act_order}
        v, s = gptq(w[index] * s_cols, h, bits=bits,
                    group_size=stored.group_size, **options)  # fmt: skip
        values.append(v)
        scales.append(s)
    values, scale = np.concatenate(values), np.concatenate(scales)
    qvalue = values if bits == 8 else pack_nibbles(values)  # NumPy's, no compile
    parts = (jax.device_put(qvalue), jax.device_put(scale))
    return eqx.tree_at(lambda n: (n.qvalue, n.scale), stored, parts)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """How ``calibrated`` chooses a layer: ``method`` ("gptq", "awq" or
    "rtn": the rounding), ``smoothquant`` (alpha, or None), ``static``
    (False, "tensor" or "channel": the activation ranges) and ``clip`` (how a
    static range is chosen: "mse" or "absmax", ``static_scale``), GPTQ's
    ``damp`` and ``act_order``, and whether AWQ clips its scaled weights
    (``awq_clip``, ``_scales.awq_clip``; False: the channel scale alone)."""

    method: str = "gptq"
    smoothquant: float | None = None
    static: bool | str = False
    clip: str = "mse"
    damp: float = 0.01
    act_order: bool = False
    awq_clip: bool = True

    def channel_scale(self, layer, stored, w, features, inputs):
        """The layer's per-input-channel scale ``(C,)``, or None: none
        asked for, or a grouped convolution (its channels meet separate
        rows of weights)."""
        wanted = self.method == "awq" or self.smoothquant is not None
        if getattr(layer, "groups", 1) != 1 or not (wanted or self.static == "channel"):
            return None
        x_absmax, x_mean = channel_statistics(inputs, _channel_axis(layer))
        if self.static == "channel":
            return static_channel_scale(x_absmax)
        if self.smoothquant is not None:
            w_absmax = weight_channel_absmax(w, len(x_absmax))
            return smoothquant_scale(x_absmax, w_absmax, self.smoothquant)
        bits = PRECISION_BITS[stored.precision]
        best, _ = awq_scale(
            w, features[0], x_mean, bits=bits, group_size=stored.group_size
        )
        return best


def _channel_axis(layer) -> int:
    """The axis of an input's channels (a Linear's features)."""
    return -1 if isinstance(layer, eqx.nn.Linear) else -layer.num_spatial_dims - 1


def _choose(layer, stored, inputs, calibration: Calibration):
    """(``layer`` calibrated: ``stored``, its round-to-nearest ``qarray.nn``
    layer, with the weights, channel scale and activation scale chosen on
    ``inputs``; the float weights it computes with, in the layer's shape, for
    the layers after it to calibrate through)."""
    w = np.asarray(layer.weight, np.float64).reshape(layer.weight.shape[0], -1)
    features = _features(layer, inputs)
    s = calibration.channel_scale(layer, stored, w, features, inputs)
    s_cols = np.ones(w.shape[1]) if s is None else columns(s, w.shape[1] // len(s))
    if calibration.method == "gptq":
        chosen = _gptq_parts(
            w, features, s_cols, stored, calibration.damp, calibration.act_order
        )
    elif s is None:
        chosen = stored
    else:  # round-to-nearest of the scaled weights
        scaled = device_array((w * s_cols).astype(np.float32))
        if calibration.method == "awq" and calibration.awq_clip:
            # their clipped values: the stored scales are their max |w|
            group_size = stored.group_size if stored.precision == "int4" else None
            scaled, _ = awq_clip(w * s_cols, features[0], s_cols, group_size=group_size)
        scaled = scaled.reshape(layer.weight.shape)
        # (no recorded error: a static field, the freezing compiled once per
        # layer shape rather than once per layer)
        trainable = dataclasses.replace(
            stored, weight=scaled, qvalue=None, scale=None, stored_error=None
        )
        chosen = trainable.frozen()
    back = np.asarray(dequantized(chosen), np.float64).reshape(w.shape)
    back = back / s_cols
    error = float(np.linalg.norm(w - back) / max(np.linalg.norm(w), 1e-30))
    chosen = dataclasses.replace(chosen, stored_error=error)
    activation_scale = None
    if calibration.static:  # from x / s over the calibration inputs
        shape = [1] * inputs.ndim
        shape[_channel_axis(layer)] = -1
        divisor = 1.0 if s is None else s.reshape(shape)
        seen = np.abs(np.asarray(inputs, np.float64) / divisor)
        # an input channel's rounding error reaches the output through its
        # columns of the (scaled) weights: their squared norm weighs it
        weighted = (w * s_cols) ** 2
        per_channel = weighted.reshape(w.shape[0], seen.shape[_channel_axis(layer)], -1)
        importance = per_channel.sum(axis=(0, 2))
        seen = np.moveaxis(seen, _channel_axis(layer), -1)
        activation_scale = static_scale(seen, calibration.clip, importance)
    if s is not None or activation_scale is not None:
        chosen = chosen.with_input_scales(
            None if s is None else device_array(np.asarray(s, np.float32)),
            None if activation_scale is None else device_array(activation_scale),
        )
    dense = device_array(back.reshape(layer.weight.shape).astype(np.float32))
    return chosen, dense


# clipping ratios of the absmax that "mse" tries, geometric from 1/100 (a
# rare spike that far above the bulk of the values is clipped to it) to 1
# (absmax itself), and the most values it measures them on (a strided sample
# past that); what the choice buys: benchmarks/bench_calibration.py
CLIP_RATIOS = np.geomspace(0.01, 1.0, 121)
CLIP_SAMPLE = 2**20


def static_scale(
    magnitudes: np.ndarray, clip: str = "mse", importance: np.ndarray | None = None
) -> np.float32:
    """A static int8 activation scale for activations of these magnitudes
    ``(..., C)``: "absmax": ``max / 127`` (no value clipped; the rarest
    outlier sets the step of every value); "mse": ``r * max / 127`` for the
    ratio r in ``CLIP_RATIOS`` with the least squared quantization error on
    them (values past the range clip to it: what TensorRT's and torch.ao's
    MSE calibrators minimise), each channel's error weighed by
    ``importance`` ``(C,)`` (default: equally)."""
    top = max(float(np.max(magnitudes, initial=0.0)), 1e-30)
    if clip == "absmax" or magnitudes.size == 0:
        return np.float32(top / QMAX)
    rows = magnitudes.reshape(-1, magnitudes.shape[-1])
    rows = rows[:: max(1, rows.size // CLIP_SAMPLE)].astype(np.float64)
    weight = np.ones(rows.shape[-1]) if importance is None else importance
    errors = []
    for ratio in CLIP_RATIOS:
        step = ratio * top / QMAX
        q = np.minimum(np.round(rows / step), QMAX) * step
        errors.append(float(np.sum((rows - q) ** 2 * weight)))
    return np.float32(CLIP_RATIOS[int(np.argmin(errors))] * top / QMAX)


def calibrated(model, data, quantize_layer: Callable, calibration=None):
    """``model`` with each ``eqx.nn.Linear`` / ``eqx.nn.Conv`` that
    ``quantize_layer`` (``qnn.quantize``'s conversion of one layer) stores
    int8 or int4 chosen on ``data`` as ``calibration`` says (GPTQ by default),
    in tree order, each on the inputs the layers before it hand it (module
    doc); the others as they are (``qnn.quantize`` converts them after).

    The layers before run as float layers holding the weights they compute
    with (dequantized, a channel scale divided out): the weight-only
    products of the stored layers, in a model of unchanging structure, so
    one compiled forward serves every layer (with ``activations="int8"`` the
    calibration inputs are the weight-only model's)."""
    calibration = Calibration() if calibration is None else calibration
    data = device_array(data)
    token = next(_TOKENS) % 2**31  # an int32 leaf
    seen = _SINKS[token] = []
    mark = jax.device_put(np.int32(token))
    # (the layers quantized already keep no recorded error: a static field,
    # one compiled forward for every calibration of the model)
    recording = without_stored_errors(model)
    recording = _map_targets(recording, lambda i, n: _Recorder(n, mark, i))
    layers = [n for n in jax.tree.leaves(model, is_leaf=_is_target) if _is_target(n)]
    chosen = {}
    try:
        for i, layer in enumerate(layers):
            stored = quantize_layer(layer)
            if not isinstance(stored, Linear | Conv) or stored.precision == "float32":
                continue  # ``where`` declined it, or it stays float
            seen.clear()
            jax.block_until_ready(_forward(recording, data))
            jax.effects_barrier()
            inputs = np.concatenate([rows for index, rows in seen if index == i])
            chosen[i], dense = _choose(layer, stored, inputs, calibration)
            # (the recorders' layers are the targets here: tree order as before)
            recording = _map_targets(
                recording,
                lambda j, n, i=i, dense=dense: (
                    eqx.tree_at(lambda m: m.weight, n, dense) if j == i else n
                ),
            )
    finally:
        del _SINKS[token]
    return _map_targets(model, lambda i, n: chosen.get(i, n))
