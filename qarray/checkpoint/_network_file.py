"""The network's model file: a ``qarray.tesseract.Network`` in safetensors, laid
out like the Tesseract's ``layers`` field (the layout: ``qarray.checkpoint``'s
module doc). ``load_model`` checks all of it and names the tensor at fault.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._numerics import (
    quantize_groups_np,
    quantize_rows_np,
    relative_error4_np,
    relative_error_np,
)
from .._ops import DEFAULT_GROUP_SIZE, LAYOUTS, PRECISIONS, check_group_size
from ..network import ACTIVATIONS, Network
from ..nn import Linear
from ._errors import ModelFileError

_ACTIVATION_NAMES = tuple(ACTIVATIONS)

_TENSOR = re.compile(r"layers\.(\d+)\.(w|w_q\.qvalue|w_q\.scale|bias)")
_METADATA = re.compile(r"layers\.(\d+)\.(layout|activation|precision|group_size)")


@dataclass(frozen=True)
class ModelLayer:
    """One layer of a model file, as stored (NumPy arrays)."""

    layout: str
    activation: str
    w: np.ndarray | None  # dense float32, or None for w_q
    qvalue: np.ndarray | None  # int8 (int4: uint8, packed)
    scale: np.ndarray | None  # float32, qvalue.shape[:-1] (int4: (N, K / G))
    bias: np.ndarray | None
    precision: str = "int8"
    group_size: int = 128

    @property
    def weights(self) -> np.ndarray:
        return self.w if self.w is not None else self.qvalue

    @property
    def widths(self) -> tuple[int, int]:
        """(K, N): input and output width."""
        a, b = self.weights.shape
        if self.w is None and self.precision == "int4":
            b = 2 * b  # two values a byte
        return (a, b) if self.layout == "kn" else (b, a)


def load_model(path: str | Path) -> list[ModelLayer]:
    """The network in a model file, checked (ModelFileError names the tensor)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise ModelFileError(
            f"{path}: not a readable safetensors file ({error})"
        ) from None
    return _layers(path, tensors, metadata)


def _layers(path, tensors: dict, metadata: dict) -> list[ModelLayer]:
    found: dict[int, dict] = {}
    for name, array in tensors.items():
        match = _TENSOR.fullmatch(name)
        if not match:
            raise ModelFileError(
                f"{path}: unexpected tensor {name!r} (expected layers.{{i}}.w, "
                "layers.{i}.w_q.qvalue, layers.{i}.w_q.scale, layers.{i}.bias)"
            )
        found.setdefault(int(match.group(1)), {})[match.group(2)] = array
    for key in metadata:
        if key != "format" and not _METADATA.fullmatch(key):
            raise ModelFileError(
                f"{path}: unexpected metadata {key!r} (expected layers.{{i}}.layout, "
                "layers.{i}.activation, layers.{i}.precision, layers.{i}.group_size)"
            )
    if not found:
        raise ModelFileError(f"{path}: no layers (no layers.0.w or layers.0.w_q.*)")
    count = max(found) + 1
    layers, width = [], None
    for i in range(count):
        prefix = f"layers.{i}"
        parts = found.get(i)
        if parts is None:
            raise ModelFileError(
                f"{path}: {prefix}.w is missing (layers are 0..{count - 1})"
            )
        layer = _layer(path, prefix, parts, metadata)
        k, n = layer.widths
        if width is not None and k != width:
            raise ModelFileError(
                f"{path}: {prefix} has input width {k} ({_weights_name(prefix, layer)} "
                f"{layer.weights.shape}, layout {layer.layout!r}), but layers.{i - 1} "
                f"outputs width {width}"
            )
        width = n
        layers.append(layer)
    return layers


def _weights_name(prefix: str, layer: ModelLayer) -> str:
    return f"{prefix}.w" if layer.w is not None else f"{prefix}.w_q.qvalue"


def _layer(path, prefix: str, parts: dict, metadata: dict) -> ModelLayer:
    layout = metadata.get(f"{prefix}.layout", "kn")
    if layout not in LAYOUTS:
        raise ModelFileError(
            f"{path}: metadata {prefix}.layout must be one of {LAYOUTS}, got {layout!r}"
        )
    activation = metadata.get(f"{prefix}.activation", "none")
    if activation not in _ACTIVATION_NAMES:
        raise ModelFileError(
            f"{path}: metadata {prefix}.activation must be one of {_ACTIVATION_NAMES}, "
            f"got {activation!r}"
        )
    precision = metadata.get(f"{prefix}.precision", "int8")
    if precision not in PRECISIONS:
        raise ModelFileError(
            f"{path}: metadata {prefix}.precision must be one of {PRECISIONS}, got "
            f"{precision!r}"
        )
    group_text = metadata.get(f"{prefix}.group_size", str(DEFAULT_GROUP_SIZE))
    try:
        group_size = check_group_size(
            f"metadata {prefix}.group_size",
            int(group_text) if group_text.isdigit() else group_text,
        )
    except ValueError as error:
        raise ModelFileError(f"{path}: {error}") from None
    if precision == "int4" and layout != "nk":
        raise ModelFileError(
            f"{path}: {prefix} has precision 'int4', which needs layout 'nk' (got "
            f"{layout!r})"
        )
    w, qvalue, scale = parts.get("w"), parts.get("w_q.qvalue"), parts.get("w_q.scale")
    if precision == "float32" and w is None:
        raise ModelFileError(
            f"{path}: {prefix} has precision 'float32', which stores dense "
            f"{prefix}.w (not w_q)"
        )
    if (w is None) == (qvalue is None and scale is None):
        got = "both" if w is not None else "neither"
        raise ModelFileError(
            f"{path}: {prefix} needs exactly one of {prefix}.w and "
            f"{prefix}.w_q.qvalue + {prefix}.w_q.scale, got {got}"
        )
    if w is None and (qvalue is None or scale is None):
        missing = "qvalue" if qvalue is None else "scale"
        raise ModelFileError(f"{path}: {prefix}.w_q.{missing} is missing")
    bias = parts.get("bias")
    int4 = precision == "int4"
    for name, array, dtype, ndim in (
        ("w", w, np.float32, 2),
        ("w_q.qvalue", qvalue, np.uint8 if int4 else np.int8, 2),
        ("w_q.scale", scale, np.float32, 2 if int4 else 1),
        ("bias", bias, np.float32, 1),
    ):
        if array is None:
            continue
        if array.dtype != dtype or array.ndim != ndim:
            raise ModelFileError(
                f"{path}: {prefix}.{name} must be {np.dtype(dtype).name} of rank "
                f"{ndim}, got {array.dtype.name} {array.shape}"
            )
        if array.dtype == np.float32 and not np.isfinite(array).all():
            raise ModelFileError(f"{path}: {prefix}.{name} has NaN or Inf entries")
    if int4:
        k = w.shape[-1] if w is not None else 2 * qvalue.shape[-1]
        want = None if w is not None else (qvalue.shape[0], k // group_size)
        if k % group_size or (want is not None and scale.shape != want):
            raise ModelFileError(
                f"{path}: {prefix} (int4, group_size {group_size}) needs K = {k} "
                f"divisible by the group size and w_q.scale {want}, got "
                f"{None if scale is None else scale.shape}"
            )
        if scale is not None and (scale < 0).any():
            raise ModelFileError(f"{path}: {prefix}.w_q.scale must be >= 0")
    elif qvalue is not None:
        if scale.shape != qvalue.shape[:-1]:
            raise ModelFileError(
                f"{path}: {prefix}.w_q.scale must have shape {qvalue.shape[:-1]} (one "
                f"per row of {prefix}.w_q.qvalue {qvalue.shape}), got {scale.shape}"
            )
        if qvalue.size and qvalue.min() < -127:
            raise ModelFileError(f"{path}: {prefix}.w_q.qvalue must lie in [-127, 127]")
        if (scale < 0).any():
            raise ModelFileError(f"{path}: {prefix}.w_q.scale must be >= 0")
    layer = ModelLayer(
        layout, activation, w, qvalue, scale, bias, precision, group_size
    )
    n = layer.widths[1]
    if bias is not None and bias.shape != (n,):
        raise ModelFileError(
            f"{path}: {prefix}.bias must have shape ({n},) to match "
            f"{_weights_name(prefix, layer)} {layer.weights.shape} (layout "
            f"{layout!r}), got {bias.shape}"
        )
    return layer


def load_network(path: str | Path) -> Network:
    """The network in a model file, checked (ModelFileError names the tensor),
    as stored int8 layers: dense ``w`` tensors are quantized here (NumPy, by
    row chunks: ``qarray._numerics.quantize_rows_np``) and keep their
    quantization error as ``stored_error``. Arrays stay on the host (NumPy)
    until placed."""
    stored, layers = load_model(path), []
    for layer in stored:
        options = {"precision": layer.precision, "layout": layer.layout}
        if layer.precision == "int4":
            options["group_size"] = layer.group_size
        if layer.precision == "float32":  # kept as it is
            layers.append(Linear(layer.w, layer.bias, **options))
            continue
        if layer.w is not None:  # only the payload and the scales stay
            if layer.precision == "int4":
                qvalue, scale = quantize_groups_np(layer.w, layer.group_size)
                error = relative_error4_np(layer.w, qvalue, scale)
            else:
                qvalue, scale = quantize_rows_np(layer.w)
                error = relative_error_np(layer.w, qvalue, scale)
        else:
            qvalue, scale, error = layer.qvalue, layer.scale, None
        layers.append(
            Linear(
                bias=layer.bias,
                qvalue=qvalue,
                scale=scale,
                stored_error=error,
                **options,
            )
        )
    return Network(layers, [layer.activation for layer in stored])


def save_network(path: str | Path, network: Network) -> None:
    """Write ``network`` as a model file: stored layers as ``w_q``, trainable
    ones as dense ``w`` (quantized again when loaded)."""
    layers = []
    for layer, activation in zip(network.layers, network.activation, strict=True):
        out = {"layout": layer.layout, "activation": activation, "bias": layer.bias}
        out["precision"] = layer.precision
        if layer.group_size is not None:
            out["group_size"] = layer.group_size
        if layer.trainable:
            out["w"] = np.asarray(layer.weight)
        else:
            out["w_q"] = {"qvalue": np.asarray(layer.qvalue), "scale": layer.scale}
        layers.append(out)
    save_model(path, layers)


def save_model(path: str | Path, layers: list[dict]) -> None:
    """Write a model file from layers given like the Tesseract's ``layers``:
    dicts with ``w`` or ``w_q`` ({qvalue, scale}), optional ``bias``, ``layout``
    and ``activation`` (NumPy arrays)."""
    from safetensors.numpy import save_file

    tensors, metadata = {}, {}
    for i, layer in enumerate(layers):
        prefix = f"layers.{i}"
        if layer.get("w") is not None:
            tensors[f"{prefix}.w"] = np.ascontiguousarray(layer["w"], np.float32)
        else:
            qvalue = np.asarray(layer["w_q"]["qvalue"])
            dtype = np.uint8 if layer.get("precision") == "int4" else np.int8
            tensors[f"{prefix}.w_q.qvalue"] = np.ascontiguousarray(qvalue, dtype)
            tensors[f"{prefix}.w_q.scale"] = np.ascontiguousarray(
                layer["w_q"]["scale"], np.float32
            )
        if layer.get("bias") is not None:
            tensors[f"{prefix}.bias"] = np.ascontiguousarray(layer["bias"], np.float32)
        metadata[f"{prefix}.layout"] = layer.get("layout", "kn")
        metadata[f"{prefix}.activation"] = layer.get("activation", "none")
        if layer.get("precision", "int8") != "int8":
            metadata[f"{prefix}.precision"] = layer["precision"]
        if layer.get("group_size") is not None:
            metadata[f"{prefix}.group_size"] = str(layer["group_size"])
    save_file(tensors, str(path), metadata=metadata)
