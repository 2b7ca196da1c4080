"""qarray Tesseract: an int8-quantized network as differentiable endpoints.

A network is a list of layers, each ``h = act(h @ W_i + bias_i)`` with ``W_i``
quantized to int8: stored ``(K, N)`` with one scale per input row (layout
"kn", ``qarray.matmul_q``) or ``(N, K)`` with one scale per output channel
(layout "nk", PyTorch's ``nn.Linear.weight``, ``qarray.linear_q``). Served
through tesseract-core's JAX recipes. Gradients are exact for ``x``, biases
and ``w_q.scale`` and straight-through for dense ``w`` (quantization acts as
the identity for derivatives). Any array may carry leading batch axes that
index x's leading axes (vmap semantics, see ``network_shape``). This module is
thin on purpose: request validation here, everything numeric in ``qarray``.

Environment:
    QARRAY_MAX_ELEMENTS    largest array (declared shape, any field), largest
                           result and largest Jacobian accepted, in elements
                           (default 33554432)
    QARRAY_MAX_LAYERS      most layers in one request (default 64)
    QARRAY_MAX_WORK        most elements of activations one request may compute:
                           x and every layer's output over all rows and batch
                           axes (times y's size for a Jacobian, one backward
                           pass per output), checked on the declared shapes
                           before any array is decoded (default 134217728)
    QARRAY_MESH            unset: one device; "auto": every local device on a
                           "data" axis (rows of x split); "data=D,model=M"
                           (D * M = the local devices): rows over "data" and
                           every layer's output channels over "model"
    QARRAY_MODEL           a model file (safetensors, qarray.checkpoint's
                           layout) loaded at start-up and kept on the device
                           quantized: requests that omit `layers` run it
    QARRAY_VJP_CACHE_SIZE  entries in the VJP residual cache (default 8; 0 = off)
    QARRAY_VJP_CACHE_MIN_FLOPS
                           apply stores its pullback in the cache when the
                           network has a nonlinearity (its backward pass needs
                           the forward activations) and its products cost at
                           least this many flops (default 2**16: a hit paid
                           from 5e2 to 1e8 flops, 0.76-0.89x of recomputing;
                           below 2**16 it saves under ~0.2 ms; see _cache_pays)
    QARRAY_VJP_CACHE_MIN_INTENSITY
                           a linear network's apply stores its pullback only
                           when its products cost at least this many flops per
                           input element (default 2**20, i.e. never for the
                           sizes QARRAY_MAX_ELEMENTS admits); 0 caches every
                           apply, linear or not, whatever its size
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from fastapi import HTTPException
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from tesseract_core.runtime import (
    Array,
    Differentiable,
    Float32,
    Int8,
    jax_recipes,
    schema_generation,
)
from tesseract_core.runtime.array_encoding import ALLOWED_DTYPE_NAMES
from tesseract_core.runtime.experimental import set_jax_vjp_cache_size
from tesseract_core.runtime.tree_transforms import get_at_path

import qarray as qa
from qarray.checkpoint import (
    ModelFileError,
    load_model,
    quantize_rows,
    relative_error,
)


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw.strip() else default
    except ValueError:
        raise RuntimeError(f"{name} must be an integer, got {raw!r}.") from None
    if value < minimum:
        raise RuntimeError(f"{name} must be >= {minimum}, got {value}.")
    return value


MAX_ELEMENTS = _env_int("QARRAY_MAX_ELEMENTS", 2**25, minimum=1)
MAX_LAYERS = _env_int("QARRAY_MAX_LAYERS", 64, minimum=1)
MAX_WORK = _env_int("QARRAY_MAX_WORK", 2**27, minimum=1)
VJP_CACHE_SIZE = _env_int("QARRAY_VJP_CACHE_SIZE", 8, minimum=0)
VJP_CACHE_MIN_FLOPS = _env_int("QARRAY_VJP_CACHE_MIN_FLOPS", 2**16, minimum=0)
VJP_CACHE_MIN_INTENSITY = _env_int("QARRAY_VJP_CACHE_MIN_INTENSITY", 2**20, minimum=0)
set_jax_vjp_cache_size(VJP_CACHE_SIZE)
MODEL_PATH = os.environ.get("QARRAY_MODEL", "").strip() or None
MESH_SPEC = os.environ.get("QARRAY_MESH", "").strip() or None


def make_mesh(spec: str) -> jax.sharding.Mesh:
    """The device mesh QARRAY_MESH names: axes ("data", "model"), explicit."""
    devices = jax.local_devices()
    found = f"found {len(devices)} local {devices[0].platform} device(s)"
    match = re.fullmatch(r"data=(\d+),model=(\d+)", spec.replace(" ", ""))
    if spec == "auto":
        data, model = len(devices), 1
    elif match:
        data, model = int(match.group(1)), int(match.group(2))
    else:
        raise RuntimeError(
            f"QARRAY_MESH must be 'auto' or 'data=D,model=M', got {spec!r} ({found})"
        )
    if data < 1 or model < 1 or data * model != len(devices):
        raise RuntimeError(
            f"QARRAY_MESH={spec} needs data * model = {data * model} devices, "
            f"{found}: use data * model = {len(devices)}, or 'auto'"
        )
    return jax.make_mesh(
        (data, model),
        ("data", "model"),
        axis_types=(AxisType.Explicit, AxisType.Explicit),
        devices=devices,
    )


def _weight_specs(layout: str) -> tuple[P, P, P]:
    """Partition specs of (weights, scales, bias) on the mesh: output channels
    over "model" ((K, N): columns; (N, K): rows, with their scales)."""
    if layout == "kn":
        return P(None, "model"), P(None), P("model")
    return P("model", None), P("model"), P("model")


# every computation of this process runs on the mesh (explicit sharding: the
# shardings are part of the types, and qarray's typing rules propagate them)
MESH = make_mesh(MESH_SPEC) if MESH_SPEC else None
if MESH is not None:
    jax.set_mesh(MESH)


def _checked_input_path(path: str, info) -> str:
    """tesseract-core 1.15's check of a gradient path, made to name what is
    wrong. Its lookup raises TypeError (a 500) for a path through a field the
    request left null (``layers.[0].w_q.scale`` for a layer that gave w; any
    layer when the request omits layers), and takes a path to an absent array
    (``layers.[0].bias`` not given) for a scalar, so a tangent for it fails as
    "expected 0D". Both become a 422 naming the path, as the endpoints' own
    check (_lookup) words it. Installed before the runtime builds the gradient
    schemas."""
    try:
        path = _input_path_validator(path, info)
    except TypeError:
        pass  # _lookup below says what is missing
    inputs = info.data.get("inputs")
    if isinstance(inputs, InputSchema):
        try:
            _lookup(inputs, path)
        except HTTPException as error:
            raise ValueError(f"{info.field_name}: {error.detail}") from None
    return path


_input_path_validator = schema_generation.input_path_validator
if schema_generation.input_path_validator.__name__ != _checked_input_path.__name__:
    schema_generation.input_path_validator = _checked_input_path

LAYOUTS = ("kn", "nk")
Layout = Literal["kn", "nk"]
# applied after the bias; gelu is the exact (erf) form, PyTorch's nn.GELU default
ACTIVATIONS: dict[str, Callable] = {
    "none": lambda h: h,
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
}
Activation = Literal["none", "relu", "gelu", "tanh", "sigmoid", "silu"]


# --- size limits, checked on the declared shape before any array is decoded


def _declared_shape(value: Any) -> tuple[int, ...] | None:
    """The shape a raw field value declares, without decoding it (None when
    it declares none that can be read: the array validator names the problem)."""
    if isinstance(value, dict) and "shape" in value:
        shape = value["shape"]
        if isinstance(shape, list | tuple) and all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            return tuple(shape)
        return None
    if hasattr(value, "shape"):
        return tuple(value.shape)
    if not isinstance(value, list | tuple):
        return None
    shape = []
    while isinstance(value, list | tuple):  # nested JSON lists
        shape.append(len(value))
        value = value[0] if value else None
    return tuple(shape)


def _limit_size(value: Any) -> Any:
    shape = _declared_shape(value)
    if shape is not None and any(d < 0 for d in shape):
        raise ValueError(f"declared shape {shape} has a negative dimension")
    if shape is not None and math.prod(shape) > MAX_ELEMENTS:
        raise ValueError(
            f"declared shape {shape} has {math.prod(shape)} elements, over the "
            f"limit of {MAX_ELEMENTS} (QARRAY_MAX_ELEMENTS)"
        )
    return value


def _castable(declared: Any, dtype: str) -> bool:
    """Whether tesseract-core decodes an array of ``declared`` dtype into a
    ``dtype`` field (its rule: a same-kind cast, or integer to integer)."""
    if declared not in ALLOWED_DTYPE_NAMES:
        return False
    if np.can_cast(declared, dtype, casting="same_kind"):
        return True
    return np.issubdtype(declared, np.integer) and np.issubdtype(dtype, np.integer)


def _limited(dtype: str) -> BeforeValidator:
    """Size limits, and the dtype of an encoded array (``{object_type: "array",
    dtype, ...}``): tesseract-core answers a dtype it cannot cast with "Could
    not parse value as a numeric array (contains non-numeric data)"."""

    def check(value: Any) -> Any:
        _limit_size(value)
        if isinstance(value, dict) and value.get("object_type") == "array":
            declared = value.get("dtype")
            if not _castable(declared, dtype):
                raise ValueError(
                    f"the array (declared shape {_declared_shape(value)}) has dtype "
                    f"{declared!r}, which does not cast to {dtype} without loss: "
                    f"send {dtype}"
                )
        return value

    return BeforeValidator(check)


SizeLimited = _limited("float32")
SizeLimitedInt8 = _limited("int8")


def _concrete(value: Any) -> bool:
    return isinstance(value, np.ndarray)


def _first(mask: np.ndarray) -> tuple[int, ...]:
    """The index of the first true element of ``mask``."""
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _require_finite(name: str, value: Any) -> None:
    if _concrete(value) and not np.isfinite(value).all():
        index = _first(~np.isfinite(value))
        raise ValueError(
            f"{name} must be finite, got {value[index]} at index {index} of "
            f"{name} {value.shape}"
        )


# --- the network's shapes: one function for declared and decoded shapes


@dataclass(frozen=True)
class LayerShapes:
    """The shapes one layer gives (None for absent arrays), for network_shape."""

    weights: tuple[int, ...] | None  # w, or w_q.qvalue
    scale: tuple[int, ...] | None  # w_q.scale (None for w)
    bias: tuple[int, ...] | None
    layout: str
    dense: bool  # w given (else w_q)


@dataclass(frozen=True)
class NetworkShape:
    batch: tuple[int, ...]  # the batch axes every output carries
    y: tuple[int, ...]
    widths: tuple[int, ...]  # K0, N0, N1, ...


def _weights_name(i: int, layer: LayerShapes) -> str:
    return f"layers.[{i}].{'w' if layer.dense else 'w_q.qvalue'}"


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


def network_shape(x: tuple[int, ...], layers: list[LayerShapes]) -> NetworkShape:
    """Check that a network's shapes chain, and give its output shapes.

    Layer i maps width K_i to N_i (K_0 = x.shape[-1], K_{i+1} = N_i). Its
    weights are ``(*B, K, N)`` ("kn") or ``(*B, N, K)`` ("nk"), w_q.scale is
    ``qvalue.shape[:-1]`` and bias ``(*B', N)``. Leading axes ``B`` are batch
    axes: they index x's leading axes from the left, ``y[b] = net(x[b],
    params[b])``, and axes of size 1 broadcast. The network's batch axes are
    all of them broadcast together with x's, and every output carries them.
    Raises ValueError naming the field and the shapes.
    """
    if len(x) < 1:
        raise ValueError("x must have shape (..., K) with at least one axis, got ()")
    width, source = x[-1], f"x {x}"
    batch: tuple[int, ...] = ()
    sources: list[str] = []
    widths = [width]
    for i, layer in enumerate(layers):
        name = _weights_name(i, layer)
        axes = "(..., K, N)" if layer.layout == "kn" else "(..., N, K)"
        shape = layer.weights
        if len(shape) < 2:
            raise ValueError(
                f"{name} must have shape {axes} (layout {layer.layout!r}), got {shape}"
            )
        k, n = shape[-2:] if layer.layout == "kn" else shape[:-3:-1]
        if k != width:
            raise ValueError(
                f"{name} {shape} has K = {k} (layout {layer.layout!r}: {axes}), but "
                f"its input is {source} of width {width}"
            )
        if layer.scale is not None and layer.scale != shape[:-1]:
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


def _raw_layer_shapes(layer: Any) -> LayerShapes | None:
    """LayerShapes from a raw (undecoded) layer, or None if it is malformed in
    a way the field validators will name."""
    if not isinstance(layer, dict):
        return None
    layout = layer.get("layout", "kn")
    w, w_q = layer.get("w"), layer.get("w_q")
    if layout not in LAYOUTS or (w is None) == (w_q is None):
        return None
    if w is None and not isinstance(w_q, dict):
        return None
    weights = _declared_shape(w if w is not None else w_q.get("qvalue"))
    scale = None if w is not None else _declared_shape(w_q.get("scale"))
    bias = layer.get("bias")
    bias_shape = None if bias is None else _declared_shape(bias)
    if weights is None or (w is None and scale is None):
        return None
    if bias is not None and bias_shape is None:
        return None
    return LayerShapes(weights, scale, bias_shape, layout, dense=w is not None)


def _in_bounds(shape: tuple[int, ...] | None) -> bool:
    """A declared shape the per-array limits accept."""
    return (
        shape is not None
        and all(d >= 0 for d in shape)
        and math.prod(shape) <= MAX_ELEMENTS
    )


def _check_y_size(shape: NetworkShape) -> None:
    size = math.prod(shape.y)
    if size > MAX_ELEMENTS:
        raise ValueError(
            f"y would have shape {shape.y} ({size} elements), over the limit of "
            f"{MAX_ELEMENTS} (QARRAY_MAX_ELEMENTS)"
        )
    _check_work(shape)


def _check_work(shape: NetworkShape, passes: int = 1, what: str = "") -> None:
    """The request's work (elements of x and of every layer's output, over all
    rows and batch axes, ``passes`` times) within QARRAY_MAX_WORK, or a
    ValueError naming the layer that passes it and the figure."""
    rows = math.prod(shape.y[:-1])
    total = passes * rows * shape.widths[0]
    for i, width in enumerate(shape.widths[1:]):
        total += passes * rows * width
        if total > MAX_WORK:
            raise ValueError(
                f"layers.[{i}] brings the request's work to {total} elements "
                f"(activations of x and layers.[0..{i}] over {rows} rows{what}), "
                f"over the limit of {MAX_WORK} (QARRAY_MAX_WORK)"
            )


# --- schemas


class QuantizedWeights(BaseModel):
    """Weights already quantized per row: ``W = qvalue * scale[..., None]``."""

    qvalue: Annotated[Array[..., Int8], SizeLimitedInt8] = Field(
        description="int8 payload, (..., K, N) for layout 'kn' or (..., N, K) for "
        "'nk'; values in [-127, 127]."
    )
    scale: Annotated[Differentiable[Array[..., Float32]], SizeLimited] = Field(
        description="One float32 scale per row of qvalue, shape qvalue.shape[:-1]; "
        "finite and >= 0."
    )

    model_config = ConfigDict(extra="forbid")


class Layer(BaseModel):
    """One layer: ``h -> activation(h @ W + bias)`` with W quantized to int8."""

    w: Annotated[Differentiable[Array[..., Float32]], SizeLimited] | None = Field(
        default=None,
        description="Dense weights, (..., K, N) for layout 'kn' or (..., N, K) for "
        "'nk', quantized per row on every call; straight-through gradient. Give "
        "exactly one of w, w_q.",
    )
    w_q: QuantizedWeights | None = Field(
        default=None,
        description="Pre-quantized weights {qvalue, scale} (e.g. an earlier "
        "apply's w_q output). Give exactly one of w, w_q.",
    )
    layout: Layout = Field(
        default="kn",
        description="'kn': stored (K, N), one scale per input row (qarray.matmul_q). "
        "'nk': stored (N, K) like PyTorch's nn.Linear.weight, one scale per output "
        "channel (qarray.linear_q).",
    )
    bias: Annotated[Differentiable[Array[..., Float32]], SizeLimited] | None = Field(
        default=None, description="Optional bias, shape (..., N)."
    )
    activation: Activation = Field(
        default="none",
        description="Nonlinearity applied after the bias ('gelu' is the exact, erf "
        "form).",
    )

    model_config = ConfigDict(extra="forbid")

    def shapes(self) -> LayerShapes:
        weights = self.w if self.w is not None else self.w_q.qvalue
        return LayerShapes(
            tuple(weights.shape),
            None if self.w_q is None else tuple(self.w_q.scale.shape),
            None if self.bias is None else tuple(self.bias.shape),
            self.layout,
            dense=self.w is not None,
        )


class InputSchema(BaseModel):
    x: Annotated[Differentiable[Array[..., Float32]], SizeLimited] = Field(
        description="Input activations, float32 (..., K0): any leading axes."
    )
    # required unless a resident model is loaded (QARRAY_MODEL), which then runs
    layers: list[Layer] | None = Field(
        default=None if MODEL_PATH else ...,
        min_length=1,
        max_length=MAX_LAYERS,
        description=f"The network, 1 to {MAX_LAYERS} layers (QARRAY_MAX_LAYERS); "
        "layer i maps width K_i to N_i, K_{i+1} = N_i."
        + (
            f" Optional: without it the resident model ({MODEL_PATH}) runs."
            if MODEL_PATH
            else ""
        ),
    )
    quantize_activations: bool = Field(
        default=False,
        description="False: weight-only quantization (activations stay float32). "
        "True: each layer's input is quantized per row too, for an int8 x int8 "
        "product; gradients stay those of the dense product (straight-through).",
    )
    return_w_q: bool = Field(
        default=False,
        description="Return the quantized weights of the layers given as dense w "
        "(they cost wire bytes on every call).",
    )

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _bound_before_decoding(cls, data: Any) -> Any:
        """Bound the work from the declared shapes, before any array is decoded
        (arrays whose declared shape is itself out of bounds are left to their
        field's validator, which names them)."""
        if not isinstance(data, dict):
            return data
        layers = data.get("layers")
        x = _declared_shape(data.get("x"))
        if layers is None and RESIDENT is not None and _in_bounds(x):
            try:
                _check_y_size(network_shape(x, RESIDENT.shapes))
            except ValueError as error:
                raise ValueError(
                    f"x does not fit the resident model ({MODEL_PATH}): {error}"
                ) from None
        if not isinstance(layers, list):
            return data
        if len(layers) > MAX_LAYERS:
            raise ValueError(
                f"layers has {len(layers)} layers, over the limit of {MAX_LAYERS} "
                "(QARRAY_MAX_LAYERS)"
            )
        shapes = [_raw_layer_shapes(layer) for layer in layers]
        arrays = [x] + [
            a for s in shapes if s is not None for a in (s.weights, s.scale, s.bias)
        ]
        if (
            layers
            and None not in shapes
            and all(a is None or _in_bounds(a) for a in arrays[1:])
            and _in_bounds(x)
        ):
            _check_y_size(network_shape(x, shapes))
        return data

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.layers is None:
            if RESIDENT is None:
                raise ValueError(
                    "layers is required: no resident model is loaded (QARRAY_MODEL)"
                )
            _require_finite("x", self.x)
            try:
                _check_y_size(self.network_shape())
            except ValueError as error:
                raise ValueError(
                    f"x does not fit the resident model ({MODEL_PATH}): {error}"
                ) from None
            return self
        for i, layer in enumerate(self.layers):
            if (layer.w is None) == (layer.w_q is None):
                got = "both" if layer.w is not None else "neither"
                raise ValueError(
                    f"layers.[{i}] must give exactly one of w and w_q, got {got}"
                )
        _check_y_size(network_shape(tuple(self.x.shape), self.shapes()))
        _require_finite("x", self.x)
        for i, layer in enumerate(self.layers):
            name = f"layers.[{i}]"
            _require_finite(f"{name}.w", layer.w)
            _require_finite(f"{name}.bias", layer.bias)
            if layer.w_q is not None:
                qvalue, scale = layer.w_q.qvalue, layer.w_q.scale
                if _concrete(qvalue) and qvalue.size and qvalue.min() < -127:
                    raise ValueError(
                        f"{name}.w_q.qvalue must lie in [-127, 127] (symmetric "
                        f"int8), got -128 at index {_first(qvalue < -127)} of "
                        f"{name}.w_q.qvalue {qvalue.shape}"
                    )
                _require_finite(f"{name}.w_q.scale", scale)
                if _concrete(scale) and (scale < 0).any():
                    index = _first(scale < 0)
                    raise ValueError(
                        f"{name}.w_q.scale must be >= 0, got {scale[index]} at "
                        f"index {index} of {name}.w_q.scale {scale.shape}"
                    )
        return self

    def shapes(self) -> list[LayerShapes]:
        if self.layers is None:
            return RESIDENT.shapes
        return [layer.shapes() for layer in self.layers]

    def activations(self) -> tuple[str, ...]:
        if self.layers is None:
            return tuple(activation for _, activation in RESIDENT.config)
        return tuple(layer.activation for layer in self.layers)

    def network_shape(self) -> NetworkShape:
        return network_shape(tuple(self.x.shape), self.shapes())


class QuantizedWeightsOut(BaseModel):
    qvalue: Array[..., Int8] = Field(
        description="int8 payload, shaped like the layer's w (batch axes included)."
    )
    scale: Array[..., Float32] = Field(description="One scale per row of qvalue.")


class LayerOut(BaseModel):
    weight_error: Array[..., Float32] = Field(
        description="Relative quantization error ||w - W|| / ||w|| of the layer's "
        "dense weights (0 for w_q layers or zero w; a resident model's dense layers "
        "report their quantization at load); one per batch element: shape "
        "the network's batch axes (a scalar without them)."
    )
    w_q: QuantizedWeightsOut | None = Field(
        description="The quantized weights of a w layer when return_w_q is set "
        "(reuse them as w_q), else null."
    )


class OutputSchema(BaseModel):
    y: Differentiable[Array[..., Float32]] = Field(
        description="The network's output, float32 (*batch, ..., N_last)."
    )
    layers: list[LayerOut] = Field(description="Per layer diagnostics, in order.")


# --- the resident model (QARRAY_MODEL)


@dataclass(frozen=True)
class _Resident:
    """A model file's network on the device, quantized once at load."""

    config: tuple[tuple[str, str], ...]  # (layout, activation) per layer
    arrays: list[dict]  # per layer {"w": None, "w_q": {qvalue, scale}, "bias"}
    shapes: list[LayerShapes]
    weight_errors: tuple[float, ...]  # of dense w quantized at load (0 for w_q)


def _load_resident(path: str, mesh=None) -> _Resident:
    """Load, check and quantize a model file; fail start-up naming the tensor.
    With a mesh, each layer's output channels are placed over "model"."""
    try:
        layers = load_model(path)
    except ModelFileError as error:
        raise RuntimeError(f"QARRAY_MODEL: {error}") from None
    config, arrays, shapes, errors = [], [], [], []
    for layer in layers:
        if layer.w is not None:  # only the int8 payload and the scales stay
            qvalue, scale = quantize_rows(layer.w)
            error = relative_error(layer.w, qvalue, scale)
        else:
            qvalue, scale, error = layer.qvalue, layer.scale, 0.0
        qvalue, scale = jnp.asarray(qvalue), jnp.asarray(scale)
        errors.append(error)
        bias = None if layer.bias is None else jnp.asarray(layer.bias)
        if mesh is not None:  # placed once: each device keeps its channels only
            specs = _weight_specs(layer.layout)
            qvalue, scale, bias = (
                None if a is None else jax.device_put(a, NamedSharding(mesh, spec))
                for a, spec in zip((qvalue, scale, bias), specs, strict=True)
            )
        config.append((layer.layout, layer.activation))
        arrays.append(
            {"w": None, "w_q": {"qvalue": qvalue, "scale": scale}, "bias": bias}
        )
        shapes.append(
            LayerShapes(
                tuple(qvalue.shape),
                tuple(scale.shape),
                None if bias is None else tuple(bias.shape),
                layer.layout,
                dense=False,
            )
        )
    _release_freed_memory()
    payload = sum(a["w_q"]["qvalue"].nbytes + a["w_q"]["scale"].nbytes for a in arrays)
    errors_text = ", ".join(f"{e:.2e}" for e in errors)
    print(  # for whoever reads the server's log
        f"QARRAY_MODEL: {path}: {len(arrays)} layers, {payload / 2**20:.1f} MiB of "
        f"int8 payload and scales resident, weight errors [{errors_text}]",
        file=sys.stderr,
        flush=True,
    )
    return _Resident(tuple(config), arrays, shapes, tuple(errors))


def _release_freed_memory() -> None:
    """Hand the pages freed after loading (the file's float32 tensors) back to
    the OS: glibc's allocator keeps them in the process otherwise, and the
    resident model would look 2-3x its int8 size."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


RESIDENT = _load_resident(MODEL_PATH, MESH) if MODEL_PATH else None


# --- the computation


@dataclass(frozen=True)
class _Config:
    """What the compiled network depends on besides array shapes (jit-static)."""

    layers: tuple[tuple[str, str], ...]  # (layout, activation) per layer
    quantize_activations: bool
    return_w_q: bool
    resident: bool = False  # the resident model's layers (constants, not inputs)
    # a resident model's per-layer quantization errors at load (reported as
    # its layers' weight_error)
    weight_errors: tuple[float, ...] = ()


def apply_jit(inputs: dict) -> dict:
    """inputs (as InputSchema.model_dump()) -> outputs (as OutputSchema), compiled.

    What tesseract-core's jax_recipes differentiate. A plain function over one
    jax.jit (the structure static) rather than eqx.filter_jit: filter_jit's
    per-call partitioning measured ~50 us, a third of a small apply's latency.
    """
    config, arrays = _split(inputs)
    return _compute(arrays, config)


def _split(inputs: dict) -> tuple[_Config, dict]:
    layers = inputs["layers"]
    if layers is None:  # the resident model
        config = _Config(
            RESIDENT.config,
            bool(inputs["quantize_activations"]),
            bool(inputs["return_w_q"]),
            resident=True,
            weight_errors=RESIDENT.weight_errors,
        )
        return config, {"x": inputs["x"], "layers": RESIDENT.arrays}
    config = _Config(
        tuple((layer["layout"], layer["activation"]) for layer in layers),
        bool(inputs["quantize_activations"]),
        bool(inputs["return_w_q"]),
    )
    arrays = {
        "x": inputs["x"],
        "layers": [
            {"w": layer["w"], "w_q": layer["w_q"], "bias": layer["bias"]}
            for layer in layers
        ],
    }
    return config, arrays


@functools.partial(jax.jit, static_argnames="config")
def _compute(arrays: dict, config: _Config) -> dict:
    arrays = jax.tree.map(jnp.asarray, arrays)
    x, layers = arrays["x"], arrays["layers"]
    shape = network_shape(
        tuple(x.shape),
        [_traced_shapes(p, c) for p, c in zip(layers, config.layers, strict=True)],
    )
    rank = len(shape.batch)
    # give every array exactly `rank` leading batch axes: batch axes index x's
    # leading axes from the left, so shorter ones are padded on their right
    layers = [
        {
            "w": _pad_batch(p["w"], rank, 2),
            "w_q": None
            if p["w_q"] is None
            else {
                "qvalue": _pad_batch(p["w_q"]["qvalue"], rank, 2),
                "scale": _pad_batch(p["w_q"]["scale"], rank, 1),
            },
            "bias": _pad_batch(p["bias"], rank, 1),
        }
        for p in layers
    ]
    if MESH is not None and rank == 0:
        y, per_layer = _network_on_mesh(x, layers, config)
    else:  # batch axes (or no mesh): one device's layout, mapped over examples
        y, per_layer = _map_batch(
            functools.partial(_network, config=config), shape.batch, (x, layers)
        )
    return {"y": y, "layers": per_layer}


def _network_on_mesh(x, layers, config: _Config):
    """The network with x's rows over "data" (padded to a multiple of its size:
    rows are independent, so the padding never reaches a real row) and every
    layer's output channels over "model"."""
    lead, k = x.shape[:-1], x.shape[-1]
    m = math.prod(lead)
    rows = jnp.pad(x.reshape(m, k), ((0, -m % MESH.shape["data"]), (0, 0)))
    y, per_layer = _network((rows, layers), config, sharded=True)
    y = reshard(y, P(None, None))[:m]
    return y.reshape(*lead, y.shape[-1]), per_layer


def _traced_shapes(params: dict, layer_config: tuple[str, str]) -> LayerShapes:
    weights = params["w"] if params["w"] is not None else params["w_q"]["qvalue"]
    return LayerShapes(
        tuple(weights.shape),
        None if params["w_q"] is None else tuple(params["w_q"]["scale"].shape),
        None if params["bias"] is None else tuple(params["bias"].shape),
        layer_config[0],
        dense=params["w"] is not None,
    )


def _pad_batch(a, rank: int, core: int):
    """``a`` with size-1 axes after its batch axes, up to ``rank`` of them."""
    if a is None:
        return None
    lead = a.ndim - core
    return a.reshape(*a.shape[:lead], *(1,) * (rank - lead), *a.shape[lead:])


def _map_batch(fn, batch: tuple[int, ...], args):
    """``fn`` mapped over the leading ``len(batch)`` axes of every array in
    ``args`` (each of size ``batch[i]`` or 1: size 1 broadcasts without a
    copy); every output gets those axes, at full size."""
    if not batch:
        return fn(args)
    size, rest = batch[0], batch[1:]
    inner = functools.partial(_map_batch, fn, rest)
    axes = jax.tree.map(lambda a: 0 if a.shape[0] == size and size != 1 else None, args)
    args = jax.tree.map(lambda a, ax: a if ax == 0 else a[0], args, axes)
    if size == 1:
        return jax.tree.map(lambda out: out[None], inner(args))
    return jax.vmap(inner, in_axes=(axes,), axis_size=size)(args)


def _network(args, config: _Config, sharded: bool = False):
    """One example: x (..., K0) through unbatched layers -> (y, per-layer outputs).

    ``sharded``: x is (M, K0) on the mesh; each layer's input rows go over
    "data" with the contraction axis whole (a sharded contraction axis is a
    TypeError in qarray's typing rules), its weights' output channels over
    "model".
    """
    h, layers = args
    precision = "int8" if config.quantize_activations else "float32"
    outputs = []
    for i, (params, (layout, activation)) in enumerate(
        zip(layers, config.layers, strict=True)
    ):
        if sharded:
            h = reshard(h, P("data", None))
            params = _placed(params, layout)
        w_q_out, weight_error = None, jnp.float32(0.0)
        if config.weight_errors:  # a resident model's: quantized once, at load
            weight_error = jnp.float32(config.weight_errors[i])
        if params["w"] is not None:
            w = params["w"]
            qw = qa.quantize(w)
            if config.return_w_q:
                qvalue, scale = qa.unpack(qw)
                w_q_out = {"qvalue": qvalue, "scale": scale}
            w_norm = jnp.linalg.norm(w)
            error = jnp.linalg.norm(w - qa.dequantize(qw)) / jnp.where(
                w_norm > 0, w_norm, 1
            )
            # a diagnostic output: it carries no derivative
            weight_error = jax.lax.stop_gradient(error)
        else:
            qw = qa.pack(params["w_q"]["qvalue"], params["w_q"]["scale"])
        product = qa.matmul_q if layout == "kn" else qa.linear_q
        h = product(h, qw, precision)
        if params["bias"] is not None:
            h = h + params["bias"]
        h = ACTIVATIONS[activation](h)
        outputs.append({"weight_error": weight_error, "w_q": w_q_out})
    return h, outputs


def _placed(params: dict, layout: str) -> dict:
    """A layer's arrays resharded to their places on the mesh (a no-op for the
    resident model's, placed at load)."""
    weights, scales, bias = _weight_specs(layout)
    w_q = params["w_q"]
    return {
        "w": None if params["w"] is None else reshard(params["w"], weights),
        "w_q": None
        if w_q is None
        else {
            "qvalue": reshard(w_q["qvalue"], weights),
            "scale": reshard(w_q["scale"], scales),
        },
        "bias": None if params["bias"] is None else reshard(params["bias"], bias),
    }


def _as_dict(inputs: InputSchema) -> dict:
    """inputs.model_dump(), without its cost (~50 us on small requests)."""
    out = dict(inputs)
    if inputs.layers is None:
        return out
    out["layers"] = []
    for layer in inputs.layers:
        fields = dict(layer)
        if layer.w_q is not None:
            fields["w_q"] = dict(layer.w_q)
        out["layers"].append(fields)
    return out


def apply(inputs: InputSchema) -> OutputSchema:
    """The network's output y and per-layer diagnostics."""
    if jax_recipes._jax_vjp_cache is None or not _cache_pays(inputs):
        # NumPy straight into the compiled call: converting each input to a jax
        # array first (as_jax_arrays) costs more than a whole small product
        return apply_jit(_as_dict(inputs))
    return _apply_and_cache_pullback(inputs)


# --- the VJP residual cache
#
# tesseract-core's jax_apply fills its LRU with an eager jax.vjp of apply_jit,
# which pays Python dispatch per call and made apply + vjp slower than
# recomputing (benchmarks/bench_cache.py measures both). Here one compiled call
# runs the forward pass and returns its pullback (jax.vjp inside jit: the
# pullback is a pytree of residuals), stored in the same LRU (its size and
# on/off switch: QARRAY_VJP_CACHE_SIZE, set_jax_vjp_cache_size) under a key of
# the request's host arrays (_HostKey). tesseract-core's key (as_jax_arrays,
# a device fingerprint, a device compare) cost ~6 ms on apply and ~9 ms on
# vjp at (256, 1024, 1024) x 3 layers, as much as the forward pass a hit
# saves. vector_jacobian_product looks its key up, runs the pullback for the
# requested paths only, and on a miss recomputes through jax_recipes._vjp_jit
# exactly as jax_recipes.jax_vjp does (which still serves entries stored under
# tesseract-core's key, e.g. by its own jax_apply).


def _cache_pays(inputs: InputSchema) -> bool:
    """Whether apply should store its pullback (QARRAY_VJP_CACHE_MIN_FLOPS,
    QARRAY_VJP_CACHE_MIN_INTENSITY).

    A hit saves the forward pass a miss recomputes, and costs the key (a
    sampled hash of the request's arrays; a bitwise compare on a hit), the
    pullback's residuals and a second compiled call. A nonlinearity's backward
    pass needs the forward activations, so a miss recomputes the whole forward
    pass: with the host key and lo-typed residuals (see _HostKey,
    _forward_with_pullback) caching measured 0.76-0.89x of recomputing for 3
    relu layers from 5e2 to 1e8 flops (0.8x at 1.6e9; benchmarks/bench_cache.py),
    where tesseract-core's device key had made it pay only above ~1e9. A linear
    network's VJP never needs y, and XLA drops the products from a recomputed
    forward pass: a hit saves only the quantization, so it caches only above the
    intensity threshold.
    """
    if VJP_CACHE_MIN_INTENSITY == 0:
        return True
    shape = inputs.network_shape()
    m = math.prod(shape.y[:-1])
    flops = sum(2 * m * k * n for k, n in itertools.pairwise(shape.widths))
    if any(activation != "none" for activation in inputs.activations()):
        return flops >= VJP_CACHE_MIN_FLOPS
    elements = inputs.x.size + sum(
        math.prod(s.weights) + math.prod(s.bias or ()) for s in inputs.shapes()
    )
    return flops >= VJP_CACHE_MIN_INTENSITY * max(elements, 1)


# The pullback (jax.vjp inside jit) is a pytree whose residuals include QArray
# values: a hi type makes every call of a jitted function that takes or gives
# one take JAX's Python dispatch path (~1 ms a call here, more than a small
# network's whole backward pass). So the QArrays leave the compiled call as
# their (qvalue, scale) parts, and the pullback's structure (its treedef and
# which leaves were QArrays) is recorded while tracing, keyed like the trace.
_PULLBACK_STRUCTURE: dict = {}


def _pullback_key(arrays: dict, config: _Config):
    leaves, treedef = jax.tree.flatten(arrays)
    return config, treedef, tuple((np.shape(a), np.result_type(a)) for a in leaves)


# plain jax.jit, not eqx.filter_jit: filter_jit would take the parts' tree
# apart again on every call
@functools.partial(jax.jit, static_argnames="config")
def _forward_with_pullback(arrays: dict, config: _Config):
    # a resident model's weights are constants: only x is differentiated
    layers_spec = False if config.resident else eqx.is_inexact_array
    diff, nondiff = eqx.partition(
        arrays, {"x": eqx.is_inexact_array, "layers": layers_spec}
    )

    def forward(diff):
        out = _compute(eqx.combine(diff, nondiff), config=config)
        return {"y": out["y"]}, out

    _, pullback, out = jax.vjp(forward, diff, has_aux=True)
    leaves, treedef = jax.tree.flatten(pullback)
    hi = tuple(isinstance(jax.typeof(leaf), qa.QArrayTy) for leaf in leaves)
    _PULLBACK_STRUCTURE[_pullback_key(arrays, config)] = (treedef, hi)
    parts = [qa.unpack(leaf) if q else leaf for leaf, q in zip(leaves, hi, strict=True)]
    return out, parts


@functools.partial(jax.jit, static_argnames=("structure", "paths"))
def _run_pullback(parts, cotangent, structure, paths: tuple[str, ...]):
    treedef, hi = structure
    leaves = [qa.pack(*part) if q else part for part, q in zip(parts, hi, strict=True)]
    (cotangents,) = jax.tree.unflatten(treedef, leaves)(cotangent)
    # only the requested cotangents leave the call: XLA drops the products of
    # the others (x's, in a training step that differentiates the weights)
    return {path: get_at_path(cotangents, path) for path in paths}


class _HostKey:
    """An LRU key naming one request's arrays (host copies, as decoded) and
    the compiled network's configuration.

    Hashes a strided sample of every array (4096 elements each: a cheap hash,
    ~20 us), and compares the whole arrays, bitwise (-0.0 != 0.0, as
    tesseract-core's key), only when the hashes agree: a lookup reads the
    arrays once, on a hit.
    """

    SAMPLE = 4096

    def __init__(self, config: _Config, arrays: dict):
        # a resident model's weights are the server's own: x names the request
        tree = {"x": arrays["x"]} if config.resident else arrays
        leaves, treedef = jax.tree.flatten(tree)
        self.arrays = tuple(np.asarray(a) for a in leaves)
        self.meta = (
            config,
            str(treedef),
            tuple((a.dtype.str, a.shape) for a in self.arrays),
        )
        samples = []
        for a in self.arrays:
            flat = a.reshape(-1)
            samples.append(flat[:: max(1, flat.size // self.SAMPLE)].tobytes())
        self._hash = hash((self.meta, tuple(samples)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _HostKey)
            and self._hash == other._hash
            and self.meta == other.meta
            and all(
                np.array_equal(_bits(a), _bits(b))
                for a, b in zip(self.arrays, other.arrays, strict=True)
            )
        )


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _apply_and_cache_pullback(inputs: InputSchema) -> dict:
    # NumPy straight into the compiled call, as in apply's uncached path
    config, arrays = _split(_as_dict(inputs))
    out, parts = _forward_with_pullback(arrays, config)
    structure = _PULLBACK_STRUCTURE[_pullback_key(arrays, config)]
    jax_recipes._jax_vjp_cache.put(_HostKey(config, arrays), (parts, structure))
    return out


def _cached_vjp(inputs: InputSchema, paths: set[str], cotangents: dict):
    """The cotangents at ``paths`` from the pullback apply cached for these
    inputs, or None (cache off, nothing cached for them)."""
    cache = jax_recipes._jax_vjp_cache
    if cache is None or not _cache_pays(inputs):  # apply stored nothing
        return None
    config, arrays = _split(_as_dict(inputs))
    cached = cache.get(_HostKey(config, arrays))
    if cached is None:
        return None
    parts, structure = cached
    y = cotangents.get("y")
    if y is None:  # no cotangent given for y: zero
        y = np.zeros(inputs.network_shape().y, np.float32)
    return _run_pullback(parts, {"y": y}, structure, tuple(sorted(paths)))


def _only_host_keys(cache) -> bool:
    """Whether every entry of tesseract-core's LRU is one of apply's (then
    jax_vjp's own lookup, which costs its key, cannot hit)."""
    entries = getattr(cache, "_cache", None)
    return isinstance(entries, dict) and all(
        isinstance(key, _HostKey) for key in list(entries)
    )


def abstract_eval(abstract_inputs):
    """Output shapes and dtypes from input shapes and dtypes, without computing."""
    return jax_recipes.jax_abstract_eval(apply_jit, abstract_inputs)


# --- gradient endpoints: request checks the runtime's schemas cannot express,
# then one call into the recipes


def _bad_request(message: str) -> HTTPException:
    return HTTPException(status_code=422, detail=message)


_PATH_PART = re.compile(r"\[(\d+)\]")


def _lookup(inputs: InputSchema, path: str) -> Any:
    """The value at a differentiable path (``layers.[1].w_q.scale``), or a 422
    naming the path when the request did not give it."""
    if inputs.layers is None and path.startswith("layers."):
        raise _bad_request(
            f"{path!r} names a layer of the resident model ({MODEL_PATH}), whose "
            "weights are not inputs: this request gave no layers (differentiate "
            "with respect to x)"
        )
    value: Any = inputs
    for part in path.split("."):
        index = _PATH_PART.fullmatch(part)
        if index is not None:
            i = int(index.group(1))
            if not isinstance(value, list) or i >= len(value):
                raise _bad_request(
                    f"{path!r} names layer {i}, but the request has "
                    f"{len(inputs.layers)} layers"
                )
            value = value[i]
        else:
            parent, value = value, getattr(value, part, None)
            if value is None and isinstance(parent, Layer) and part in ("w", "w_q"):
                other = "w_q" if part == "w" else "w"
                raise _bad_request(
                    f"{path!r} names an array this request did not give "
                    f"(layers.[{i}] gave {other})"
                )
        if value is None:
            raise _bad_request(f"{path!r} names an array this request did not give")
    return value


def _require_given(inputs: InputSchema, paths: set[str], field: str) -> None:
    for path in sorted(paths):
        try:
            _lookup(inputs, path)
        except HTTPException as error:
            raise _bad_request(f"{field}: {error.detail}") from None


def _input_shape(inputs: InputSchema, path: str) -> tuple[int, ...]:
    return tuple(_lookup(inputs, path).shape)


def jacobian(inputs: InputSchema, jac_inputs: set[str], jac_outputs: set[str]):
    """d y / d (jac_inputs), each of shape y.shape + input.shape."""
    _require_given(inputs, jac_inputs, "jac_inputs")
    shape = inputs.network_shape()
    y_shape = shape.y
    try:  # jacrev runs one backward pass per element of y
        _check_work(shape, math.prod(y_shape), f", once per element of y {y_shape}")
    except ValueError as error:
        raise _bad_request(
            f"{error}: use vector_jacobian_product or jacobian_vector_product"
        ) from None
    for path in jac_inputs:
        size = math.prod(y_shape) * math.prod(_input_shape(inputs, path))
        if size > MAX_ELEMENTS:
            raise _bad_request(
                f"the Jacobian of y {y_shape} with respect to {path} "
                f"{_input_shape(inputs, path)} has {size} elements, over the limit "
                f"of {MAX_ELEMENTS} (QARRAY_MAX_ELEMENTS): use "
                "vector_jacobian_product or jacobian_vector_product"
            )
    return jax_recipes.jax_jacobian(apply_jit, inputs, jac_inputs, jac_outputs)


def jacobian_vector_product(
    inputs: InputSchema,
    jvp_inputs: set[str],
    jvp_outputs: set[str],
    tangent_vector: dict[str, Any],
):
    """Tangent of y for tangents of jvp_inputs (each shaped like its input)."""
    _require_given(inputs, jvp_inputs, "jvp_inputs")
    tangents = _checked_vectors(
        "tangent_vector", tangent_vector, lambda p: (p, _input_shape(inputs, p))
    )
    return jax_recipes.jax_jvp(apply_jit, inputs, jvp_inputs, jvp_outputs, tangents)


def vector_jacobian_product(
    inputs: InputSchema,
    vjp_inputs: set[str],
    vjp_outputs: set[str],
    cotangent_vector: dict[str, Any],
):
    """Cotangents of vjp_inputs for a cotangent of y (shaped like y)."""
    _require_given(inputs, vjp_inputs, "vjp_inputs")
    y_shape = inputs.network_shape().y
    cotangents = _checked_vectors(
        "cotangent_vector", cotangent_vector, lambda p: ("y", y_shape)
    )
    cached = _cached_vjp(inputs, vjp_inputs, cotangents)
    if cached is not None:
        return cached
    if jax_recipes._jax_vjp_cache is None or _only_host_keys(
        jax_recipes._jax_vjp_cache
    ):
        # jax_vjp's miss path without its lookup: recompute, compiled per
        # (shapes, paths); NumPy goes in as is (eqx.filter_jit traces it)
        return jax_recipes._vjp_jit(
            apply_jit,
            inputs.model_dump(),
            tuple(vjp_inputs),
            tuple(vjp_outputs),
            cotangents,
        )
    return jax_recipes.jax_vjp(apply_jit, inputs, vjp_inputs, vjp_outputs, cotangents)


def _checked_vectors(field: str, vectors: dict[str, Any], like) -> dict[str, Any]:
    """Tangents / cotangents, checked: ``like(path)`` names the array each must
    match and its shape; they must be finite. Returned as float32."""
    for path, v in vectors.items():
        name, shape = like(path)
        if tuple(np.shape(v)) != shape:
            raise _bad_request(
                f"{field}[{path!r}] must have the shape of {name} {shape}, got "
                f"{tuple(np.shape(v))}"
            )
        if not np.isfinite(v).all():
            raise _bad_request(f"{field}[{path!r}] must be finite")
    return {path: np.asarray(v, np.float32) for path, v in vectors.items()}
