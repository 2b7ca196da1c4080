"""PyTorch state dicts to model files, and ``qarray-serve convert``: the
network's file (``--layers``) or any model's, keyed by its pytree paths
(``--tree``, ``qarray._tree_checkpoint.convert_tree``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from ._network_file import (
    _ACTIVATION_NAMES,
    _layers,
    quantize_groups,
    quantize_rows,
    relative_error,
    relative_error4,
    save_model,
)
from ._tree_checkpoint import ModelFileError, convert_tree
from .nn import PRECISIONS


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
        if activation not in _ACTIVATION_NAMES:
            raise ModelFileError(
                f"layer {name!r}: activation must be one of {_ACTIVATION_NAMES}, "
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
            qvalue, scale = quantize_groups(weight, group_size)
            errors.append(relative_error4(weight, qvalue, scale))
            layer["w_q"] = {"qvalue": qvalue, "scale": scale}
            layer["group_size"] = group_size
        else:
            qvalue, scale = quantize_rows(weight)
            errors.append(relative_error(weight, qvalue, scale))
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


def _pairs(text: str | None, sep: str) -> list[tuple[str, str]]:
    pairs = []
    for item in (text or "").split(","):
        if item.strip():
            left, _, right = item.strip().partition(sep)
            pairs.append((left, right))
    return pairs


def parse_layers(text: str) -> list[tuple[str, ...]]:
    """``fc1:relu,fc2:none:float32`` -> ``[("fc1", "relu"), ("fc2", "none",
    "float32")]`` (activation "none" where not given)."""
    layers = []
    for item in text.split(","):
        name, *rest = item.strip().split(":")
        activation = rest[0] if rest and rest[0] else "none"
        layers.append((name, activation, *rest[1:2]))
    return layers


def main(argv: list[str] | None = None) -> int:
    """``qarray-serve convert SRC DST --layers fc1:relu,fc2:none`` (a network)
    or ``... --tree [--fold conv1+bn1] [--rename old=new]`` (any model)."""
    parser = argparse.ArgumentParser(
        prog="qarray-serve convert",
        description="Convert a PyTorch-style state dict (safetensors) to a qarray "
        "model file: with --layers, the Tesseract contract's network (nn.Linear "
        "weights (out, in) -> int8 layout 'nk', one scale per output channel, for "
        "QARRAY_MODEL); with --tree, any model's file keyed by its pytree paths "
        "(Linear and Conv weights int8, one scale per output channel).",
    )
    parser.add_argument("src", help="state dict, .safetensors")
    parser.add_argument("dst", help="model file to write, .safetensors")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--layers",
        help="comma-separated NAME:ACTIVATION[:PRECISION] in order, e.g. "
        f"fc1:relu,fc2:none:float32 (activations: {', '.join(_ACTIVATION_NAMES)}; "
        f"precisions: {', '.join(PRECISIONS)})",
    )
    parser.add_argument(
        "--precision",
        default="int8",
        choices=PRECISIONS,
        help="with --layers: every layer's precision unless its entry names one; "
        "with --tree: int8 or float32 (a float file for evaluate and plan)",
    )
    parser.add_argument(
        "--group-size", type=int, default=128, help="int4: values per scale along K"
    )
    mode.add_argument(
        "--tree", action="store_true", help="keep the state dict's names (paths)"
    )
    parser.add_argument(
        "--fold",
        help="with --tree: LAYER+BATCHNORM pairs, e.g. conv1+bn1,conv2+bn2: each "
        "BatchNorm (inference statistics) folded into the layer before it",
    )
    parser.add_argument(
        "--rename",
        help="with --tree: OLD=NEW name prefixes, e.g. features=features.layers",
    )
    parser.add_argument(
        "--transposed",
        help="with --tree: the nn.ConvTranspose* layers (groups 1), e.g. up1,up2: "
        "their weights (in, out, *k) laid out as eqx.nn.ConvTranspose's",
    )
    parser.add_argument("--bn-eps", type=float, default=1e-5, help="BatchNorm eps")
    args = parser.parse_args(argv)
    if args.tree:
        try:
            errors = convert_tree(
                args.src,
                args.dst,
                fold=_pairs(args.fold, "+"),
                rename=_pairs(args.rename, "="),
                transposed=[n for n in (args.transposed or "").split(",") if n],
                eps=args.bn_eps,
                precision=args.precision,
            )
        except ModelFileError as error:
            parser.exit(2, f"qarray-serve convert: {error}\n")
        for name, error in errors.items():
            print(f"{name}: int8, weight error {error:.3e}")
        print(f"wrote {args.dst}")
        return 0
    if args.fold or args.rename or args.transposed:
        parser.error("--fold, --rename and --transposed need --tree")
    if args.group_size < 2 or args.group_size % 2:
        parser.error("--group-size must be a positive even int")
    layers = parse_layers(args.layers)
    try:
        errors = convert_state_dict(
            args.src, args.dst, layers, args.precision, args.group_size
        )
    except ModelFileError as error:
        parser.exit(2, f"qarray-serve convert: {error}\n")
    for i, (item, error) in enumerate(zip(layers, errors, strict=True)):
        name, activation = item[:2]
        precision = item[2] if len(item) > 2 else args.precision
        what = activation if precision == "int8" else f"{activation}, {precision}"
        print(f"layers.{i} <- {name} ({what}): weight error {error:.3e}")
    print(f"wrote {args.dst}")
    return 0
