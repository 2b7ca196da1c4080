"""PyTorch state dicts to the network's model file (``convert_state_dict``;
any model's, keyed by its pytree paths: ``_tree.convert_tree``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .._numerics import (
    quantize_groups_np,
    quantize_rows_np,
    relative_error4_np,
    relative_error_np,
)
from .._ops import PRECISIONS
from ..network import ACTIVATIONS
from ._errors import ModelFileError
from ._network_file import _layers, save_model


def convert_state_dict(
    src: str | Path,
    dst: str | Path,
    layers: list[tuple[str, ...]],
    precision: str = "int8",
    group_size: int = 128,
) -> list[float]:
    """A PyTorch-style state dict (safetensors) -> a qarray model file.

    ``layers``: ``(name, activation)`` or ``(name, activation, precision)``
    in order; ``{name}.weight`` is ``(out, in)`` (``nn.Linear``),
    ``{name}.bias`` optional. Weights are quantized per output channel ("nk"
    layout): int8, or int4 in groups of ``group_size`` along the input axis,
    or kept float32 (``precision``, per layer or for all). Returns each
    layer's relative weight error. Raises ModelFileError naming the tensor.
    """
    from safetensors import SafetensorError, safe_open

    if not layers:
        raise ModelFileError("give at least one layer (name:activation)")
    try:
        with safe_open(str(src), framework="numpy") as f:
            available = set(f.keys())
            wanted = {}
            for name, *_ in layers:
                for key in (f"{name}.weight", f"{name}.bias"):
                    if key in available:
                        wanted[key] = f.get_tensor(key)
    except (SafetensorError, OSError, ValueError) as error:
        raise ModelFileError(
            f"{src}: not a readable safetensors file ({error})"
        ) from None
    out, errors = [], []
    for name, activation, *chosen in layers:
        layer_precision = chosen[0] if chosen else precision
        if layer_precision not in PRECISIONS:
            raise ModelFileError(
                f"layer {name!r}: precision must be one of {PRECISIONS}, got "
                f"{layer_precision!r}"
            )
        if activation not in tuple(ACTIVATIONS):
            raise ModelFileError(
                f"layer {name!r}: activation must be one of {tuple(ACTIVATIONS)}, "
                f"got {activation!r}"
            )
        weight = wanted.get(f"{name}.weight")
        if weight is None:
            near = sorted(k for k in available if k.endswith(".weight"))
            raise ModelFileError(
                f"{src}: no tensor {name}.weight (weights found: {', '.join(near)})"
            )
        if weight.ndim != 2 or weight.dtype.kind != "f":
            raise ModelFileError(
                f"{src}: {name}.weight must be a float (out, in) matrix, got "
                f"{weight.dtype.name} {weight.shape}"
            )
        layer = {"layout": "nk", "activation": activation, "precision": layer_precision}
        if layer_precision == "float32":
            layer["w"] = weight.astype(np.float32)
            errors.append(0.0)
        elif layer_precision == "int4":
            if weight.shape[1] % group_size:
                raise ModelFileError(
                    f"{src}: {name}.weight {weight.shape} has {weight.shape[1]} "
                    f"inputs, which --group-size {group_size} does not divide"
                )
            qvalue, scale = quantize_groups_np(weight, group_size)
            errors.append(relative_error4_np(weight, qvalue, scale))
            layer["w_q"] = {"qvalue": qvalue, "scale": scale}
            layer["group_size"] = group_size
        else:
            qvalue, scale = quantize_rows_np(weight)
            errors.append(relative_error_np(weight, qvalue, scale))
            layer["w_q"] = {"qvalue": qvalue, "scale": scale}
        bias = wanted.get(f"{name}.bias")
        if bias is not None:
            layer["bias"] = bias.astype(np.float32)
        out.append(layer)
    # checked like any model file before it is written: shapes chain, biases fit
    tensors, metadata = {}, {}
    for i, layer in enumerate(out):
        if "w" in layer:
            tensors[f"layers.{i}.w"] = layer["w"]
        else:
            tensors[f"layers.{i}.w_q.qvalue"] = layer["w_q"]["qvalue"]
            tensors[f"layers.{i}.w_q.scale"] = layer["w_q"]["scale"]
        if "bias" in layer:
            tensors[f"layers.{i}.bias"] = layer["bias"]
        metadata[f"layers.{i}.layout"] = "nk"
        metadata[f"layers.{i}.precision"] = layer["precision"]
        metadata[f"layers.{i}.group_size"] = str(layer.get("group_size", 128))
    try:
        _layers(src, tensors, metadata)
    except ModelFileError as error:
        names = ", ".join(f"layers.{i} = {item[0]}" for i, item in enumerate(layers))
        raise ModelFileError(f"{error} ({names})") from None
    save_model(dst, out)
    return errors
