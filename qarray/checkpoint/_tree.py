"""Model files of any equinox model: safetensors keyed by the model's pytree
paths (``conv1.weight``, ``blocks.0.qvalue``), and a converter from PyTorch
state dicts that folds BatchNorm and quantizes Linear and Conv weights.

A float file holds the float model's leaves (``conv1.weight``, ``conv1.bias``);
a quantized file holds ``qarray.nn.quantize(model)``'s (``conv1.qvalue`` int8
``(out, in/groups * prod(kernel))``, ``conv1.scale`` ``(out,)``, ``conv1.bias``
``(out,)``). ``load_quantized`` takes either, given the model's skeleton (its
class built with any key: the file supplies every array).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from .._numerics import quantize_rows_np, relative_error_np
from .._qarray import kind_of_parts
from ..nn import FLOAT_LAYERS, Conv, Embedding, Linear, SpectralConv
from ..nn import quantize as quantize_model
from ._errors import ModelFileError

FORMAT = "qarray-tree"


def _key_name(key) -> str:
    for attr in ("name", "idx", "key"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_paths(model) -> dict[str, np.ndarray]:
    """``{path: leaf}`` for every array leaf of ``model`` (``a.b.0.c``)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))
    return {".".join(_key_name(k) for k in path): leaf for path, leaf in flat}


def save_tree(path: str | Path, model, metadata: dict[str, str] | None = None) -> None:
    """Write ``model``'s array leaves (float or quantized) keyed by path;
    ``metadata``: strings recorded beside them (``qarray-serve plan`` writes
    how the weights were quantized, ``method``)."""
    from safetensors.numpy import save_file

    tensors = {k: np.ascontiguousarray(v) for k, v in leaf_paths(model).items()}
    save_file(tensors, str(path), metadata={**(metadata or {}), "format": FORMAT})


def _read(path: str | Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    if not Path(path).is_file():
        raise ModelFileError(f"model file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise ModelFileError(
            f"{path}: not a readable safetensors file ({error})"
        ) from None


def _fill(path, tensors: Mapping[str, np.ndarray], like):
    """``like`` with each array leaf replaced by the tensor of its path."""
    wanted = leaf_paths(like)
    missing = sorted(set(wanted) - set(tensors))
    unexpected = sorted(set(tensors) - set(wanted))
    if missing or unexpected:
        raise ModelFileError(
            f"{path}: the file's tensors do not match the model's leaves "
            f"(missing: {', '.join(missing[:5]) or 'none'}; unexpected: "
            f"{', '.join(unexpected[:5]) or 'none'})"
        )
    leaves = []
    for name, leaf in wanted.items():
        got = tensors[name]
        if np.dtype(got.dtype) != np.dtype(leaf.dtype):
            raise ModelFileError(
                f"{path}: {name} must be {np.dtype(leaf.dtype).name}, got "
                f"{got.dtype.name}"
            )
        squeeze = lambda s: tuple(d for d in s if d != 1)  # noqa: E731
        if tuple(got.shape) != tuple(leaf.shape):
            if squeeze(got.shape) != squeeze(leaf.shape):
                raise ModelFileError(
                    f"{path}: {name} must have shape {tuple(leaf.shape)}, got "
                    f"{tuple(got.shape)}"
                )
            got = got.reshape(leaf.shape)  # e.g. a conv bias (out,) -> (out, 1, 1)
        if got.dtype.kind == "f" and not np.isfinite(got).all():
            raise ModelFileError(f"{path}: {name} has NaN or Inf entries")
        leaves.append(got)
    arrays, rest = eqx.partition(like, eqx.is_array)
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(arrays), leaves), rest)


def load_tree(path: str | Path, like):
    """``like`` (a model of the file's structure) with the file's arrays."""
    return _fill(path, _read(path), like)


def _stored_precision(path, tensors, name: str) -> dict | None:
    """How the file stores layer ``name``: None (float: ``name.weight``),
    else ``quantize``'s precision and group size, read from the parts'
    dtypes and shapes (int8 ``qvalue (out, K)`` with ``scale (out,)``; int4
    uint8 ``qvalue (out, K / 2)`` with ``scale (out, K / G)``)."""
    qvalue, scale = tensors.get(f"{name}.qvalue"), tensors.get(f"{name}.scale")
    if qvalue is None:
        return None
    if qvalue.dtype != np.uint8:
        return {"precision": "int8"}
    if scale is None or scale.ndim != 2 or (2 * qvalue.shape[-1]) % scale.shape[-1]:
        got = "none" if scale is None else f"{scale.dtype.name}{scale.shape}"
        raise ModelFileError(
            f"{path}: {name}.qvalue is int4 (uint8{qvalue.shape}) and needs "
            f"{name}.scale (out, K / group_size) with K = {2 * qvalue.shape[-1]}, "
            f"got {got}"
        )
    return {"precision": "int4", "group_size": kind_of_parts(qvalue, scale)[1]}


# the layers qarray.nn.quantize replaces (a quantized file stores each one's
# parts; a recurrent cell's under its input matrix's name, _stored_name)
def _is_layer(node) -> bool:
    return isinstance(node, FLOAT_LAYERS)


def _stored_name(node, name: str) -> str:
    if isinstance(node, eqx.nn.GRUCell | eqx.nn.LSTMCell):
        return f"{name}.weight_ih"
    return name


def load_quantized(path: str | Path, like, config=None, **quantize_options):
    """The quantized model of a file: ``like`` is the float model's skeleton.

    A float file (keys: ``like``'s leaves) is quantized at load with
    ``qarray.nn.quantize(model, config, **quantize_options)`` (a
    ``QuantConfig`` and / or its fields as keywords). A quantized file is
    taken as stored, layer by layer: a layer with ``{path}.qvalue`` is the
    ``qarray.nn`` layer of that precision (int8, or int4 packed: uint8
    ``qvalue``, its group size from ``scale``'s shape), one with
    ``{path}.weight`` stays float (a mixed-precision plan); of the options
    only ``activations`` applies. Arrays stay NumPy.
    """
    tensors = _read(path)
    # a stored layer's tensors end in .qvalue: without any, a float file (and
    # a mismatch is reported against the float model's leaves)
    if not any(name.endswith(".qvalue") for name in tensors):
        model = _fill(path, tensors, like)
        return quantize_model(model, config, **quantize_options)
    default = "float32" if config is None else config.activations
    activations = quantize_options.get("activations", default)

    def as_stored(key_path, node):
        if not _is_layer(node):
            return node
        name = ".".join(_key_name(k) for k in key_path)
        stored = _stored_precision(path, tensors, _stored_name(node, name))
        if stored is None:
            return node
        layer = quantize_model(node, activations=activations, **stored)
        layer = _with_stored_input_scales(path, tensors, name, layer)
        # the skeleton's recorded weight error is its random weights': unknown
        return _unknown_error(layer)

    skeleton = jax.tree_util.tree_map_with_path(as_stored, like, is_leaf=_is_layer)
    return _fill(path, tensors, skeleton)


def _with_stored_input_scales(path, tensors, name: str, layer):
    """``layer`` with room for the calibrated input scales the file holds
    for it (``{name}.channel_scale`` ``(C,)``, ``{name}.activation_scale``
    ``()``: AWQ / SmoothQuant / static activations; ``_fill`` reads them)."""
    found = {
        part: tensors[f"{name}.{part}"]
        for part in ("channel_scale", "activation_scale")
        if f"{name}.{part}" in tensors
    }
    if not found or not isinstance(layer, Linear | Conv):
        return layer
    # (save_tree writes a scalar as (1,): safetensors' arrays have a shape)
    shapes = {"channel_scale": lambda a: a.shape, "activation_scale": lambda a: ()}
    room = {part: np.zeros(shapes[part](a), np.float32) for part, a in found.items()}
    try:
        return layer.with_input_scales(**room)
    except TypeError as error:
        raise ModelFileError(f"{path}: {name}: {error}") from None


def _unknown_error(layer):
    """``layer`` (a quantized layer, or a cell of them) with no recorded
    weight error."""
    kinds = (Linear, Conv, Embedding, SpectralConv)
    return jax.tree.map(
        lambda n: (
            dataclasses.replace(n, stored_error=None) if isinstance(n, kinds) else n
        ),
        layer,
        is_leaf=lambda n: isinstance(n, kinds),
    )


def fold_batchnorm(weight, bias, bn: Mapping[str, np.ndarray], eps: float = 1e-5):
    """A conv or linear layer followed by an inference-mode BatchNorm as one
    layer: ``(weight', bias')`` with the normalisation folded in per output
    channel (``bn``: PyTorch's weight, bias, running_mean, running_var)."""
    gamma = np.asarray(bn.get("weight", 1.0), np.float64)
    beta = np.asarray(bn.get("bias", 0.0), np.float64)
    factor = gamma / np.sqrt(np.asarray(bn["running_var"], np.float64) + eps)
    factor = np.broadcast_to(factor, (weight.shape[0],))
    folded_w = weight.astype(np.float64) * factor.reshape(-1, *(1,) * (weight.ndim - 1))
    b = np.zeros(weight.shape[0]) if bias is None else bias.astype(np.float64)
    folded_b = (b - np.asarray(bn["running_mean"], np.float64)) * factor + beta
    return folded_w.astype(np.float32), folded_b.astype(np.float32)


def convert_tree(
    src: str | Path,
    dst: str | Path,
    *,
    fold: Sequence[tuple[str, str]] = (),
    rename: Sequence[tuple[str, str]] = (),
    transposed: Sequence[str] = (),
    eps: float = 1e-5,
    quantizer: Callable | None = None,
    precision: str = "int8",
) -> dict[str, float]:
    """A PyTorch state dict (safetensors) -> a quantized tree model file
    (``precision="float32"``: the float file, BatchNorm folded and names
    mapped, for ``qarray-serve evaluate`` / ``plan``).

    ``fold``: ``(layer, batchnorm)`` name pairs, the BatchNorm folded into the
    layer before it (its tensors then dropped); every ``{name}.weight`` of
    rank >= 2 (``nn.Linear (out, in)``, ``nn.Conv* (out, in/groups, *k)``)
    becomes ``{name}.qvalue`` / ``{name}.scale`` (one scale per output
    channel) and its bias ``(out,)``; other tensors are kept as float32.
    ``rename``: ``(old_prefix, new_prefix)`` pairs mapping PyTorch's names to
    the equinox model's paths. ``transposed``: the ``nn.ConvTranspose*``
    layers (groups 1), whose weights ``(in, out, *k)`` become equinox's
    ``(out, in, *k)`` with the kernel flipped (``eqx.nn.ConvTranspose``
    computes the forward convolution of the spread-out input). Returns each
    quantized layer's relative weight error.
    """
    if precision not in ("int8", "float32"):
        raise ModelFileError(
            f"convert --tree writes int8 or float32 weights, got {precision!r} "
            "(int4 layers: qarray-serve plan)"
        )
    quantizer = quantizer or quantize_rows_np
    tensors = _read(src)
    for layer, bn in fold:
        stats = {
            key[len(bn) + 1 :]: tensors.pop(key)
            for key in [k for k in tensors if k.startswith(f"{bn}.")]
        }
        if "running_var" not in stats or f"{layer}.weight" not in tensors:
            raise ModelFileError(
                f"{src}: cannot fold {bn!r} into {layer!r}: need {layer}.weight and "
                f"{bn}.running_mean / running_var"
            )
        w, b = fold_batchnorm(
            tensors[f"{layer}.weight"], tensors.get(f"{layer}.bias"), stats, eps
        )
        tensors[f"{layer}.weight"], tensors[f"{layer}.bias"] = w, b
    for name in transposed:
        w = tensors.get(f"{name}.weight")
        if w is None or w.ndim < 3:
            got = "none" if w is None else f"{w.dtype.name}{w.shape}"
            raise ModelFileError(
                f"{src}: transposed layer {name!r} needs {name}.weight (in, out, *k), "
                f"got {got}"
            )
        spatial = tuple(range(2, w.ndim))
        tensors[f"{name}.weight"] = np.ascontiguousarray(
            np.flip(w.swapaxes(0, 1), spatial)
        )
    out, errors = {}, {}
    for key, value in tensors.items():
        if key.endswith("num_batches_tracked"):
            continue
        name, _, leaf = key.rpartition(".")
        if leaf == "weight" and value.ndim >= 2 and precision != "float32":
            w = value.astype(np.float32).reshape(value.shape[0], -1)
            qvalue, scale = quantizer(w)
            errors[name] = relative_error_np(w, qvalue, scale)
            out[f"{name}.qvalue"], out[f"{name}.scale"] = qvalue, scale
        elif value.dtype.kind == "f":
            out[key] = value.astype(np.float32)
        else:
            out[key] = value
    renamed = {}
    for key, value in out.items():
        for old, new in rename:
            if key == old or key.startswith(f"{old}."):
                key = new + key[len(old) :]
                break
        renamed[key] = np.ascontiguousarray(value)
    from safetensors.numpy import save_file

    save_file(renamed, str(dst), metadata={"format": FORMAT})
    return errors
