"""What quantization costs in accuracy, layer by layer, and a mixed-precision
plan under an error budget (``qarray-serve evaluate`` / ``plan``).

A model here is a float32 ``Network`` (its layers ``Linear`` with float
weights) or any equinox model of ``eqx.nn.Linear`` / ``eqx.nn.Conv`` layers,
called on one example (``jax.vmap`` over the data's leading axis). Errors are
measured against the float32 model on the data: the outputs (relative L2 and
SQNR) and the gradient with respect to the input of ``sum(y * r)`` for a
fixed random ``r`` (what an optimiser through the model sees: relative L2
and cosine).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._ops import DEFAULT_GROUP_SIZE, dequantize
from ._conv import Conv
from ._linear import Linear
from ._network import Network

METRICS = ("output", "gradient")
# cheapest first: what plan tries before the next
LADDER = ("int4", "int8", "float32")


def _quantizable(node) -> bool:
    if isinstance(node, Linear):
        return node.trainable
    return isinstance(node, eqx.nn.Linear | eqx.nn.Conv)


def layers_of(model) -> list:
    """The model's quantizable layers, in tree order."""
    return [n for n in jax.tree.leaves(model, is_leaf=_quantizable) if _quantizable(n)]


def precisions_for(layer, group_size: int) -> tuple[str, ...]:
    """What a layer can be stored as: int4 needs (N, K) weights whose K the
    group size divides, and is for dense layers only."""
    if isinstance(layer, eqx.nn.Conv):
        return ("int8", "float32")
    weight = layer.weight
    nk = not isinstance(layer, Linear) or layer.layout == "nk"
    if nk and weight.shape[-1] % group_size == 0:
        return LADDER
    return ("int8", "float32")


def _as(layer, precision: str, group_size: int):
    """``layer`` computing with ``precision`` (quantized every call)."""
    group = group_size if precision == "int4" else None
    if isinstance(layer, Linear):
        return dataclasses.replace(layer, precision=precision, group_size=group)
    if precision == "float32":
        return layer
    if isinstance(layer, eqx.nn.Conv):
        return Conv.from_eqx(layer, trainable=True)
    return Linear.from_float(
        layer.weight, layer.bias, trainable=True, precision=precision, group_size=group
    )


def with_precisions(model, choice: dict[int, str], group_size: int):
    """``model`` with its i-th quantizable layer at ``choice[i]`` (float32
    where not given)."""
    found = iter(range(len(layers_of(model))))

    def swap(node):
        if not _quantizable(node):
            return node
        return _as(node, choice.get(next(found), "float32"), group_size)

    return jax.tree.map(swap, model, is_leaf=_quantizable)


def _forward(model) -> Callable:
    if isinstance(model, Network):
        return model
    return jax.vmap(model)


def _outputs_and_gradient(model, x, r):
    """y and the gradient of sum(y * r) with respect to x, one forward pass."""
    y, pullback = jax.vjp(_forward(model), x)
    (g,) = pullback(r)
    return y, g


def _errors(y, g, y_ref, g_ref) -> dict[str, float]:
    y, g, y_ref, g_ref = (np.asarray(a, np.float64) for a in (y, g, y_ref, g_ref))
    noise = np.sum((y - y_ref) ** 2)
    signal = np.sum(y_ref**2)
    g_norm = np.linalg.norm(g_ref)
    return {
        "output_rel_l2": float(math.sqrt(noise / signal)) if signal else 0.0,
        "output_sqnr_db": float(10 * math.log10(signal / noise)) if noise else math.inf,
        "gradient_rel_l2": float(np.linalg.norm(g - g_ref) / g_norm) if g_norm else 0.0,
        "gradient_cosine": float(
            np.sum(g * g_ref) / (np.linalg.norm(g) * g_norm) if g_norm else 1.0
        ),
    }


def _weight_sqnr(layer, precision: str, group_size: int) -> float:
    """10 log10(||w||^2 / ||w - W||^2) of the layer's weights at ``precision``."""
    if precision == "float32":
        return math.inf
    w = np.asarray(layer.weight, np.float64).reshape(layer.weight.shape[0], -1)
    quantized = _as(layer, precision, group_size).quantized()
    back = np.asarray(dequantize(quantized), np.float64).reshape(w.shape)
    noise = np.sum((w - back) ** 2)
    return float(10 * math.log10(np.sum(w**2) / noise)) if noise else math.inf


def layer_bytes(layer, precision: str, group_size: int) -> int:
    """The stored weights' bytes (payload and scales) at ``precision``."""
    out = layer.weight.shape[0]
    per_out = math.prod(layer.weight.shape[1:])
    if precision == "float32":
        return 4 * out * per_out
    if precision == "int4":
        return out * per_out // 2 + 4 * out * per_out // group_size
    return out * per_out + 4 * out


def _measurer(model, x, group_size: int, seed: int):
    """(the model's quantizable layers, ``measured(choice)``: the errors of
    the model with those precisions against float32 on ``x``)."""
    x = jnp.asarray(x, jnp.float32)
    y_ref = _forward(model)(x)
    r = np.random.default_rng(seed).standard_normal(y_ref.shape)
    r = jnp.asarray(r, jnp.float32)
    _, g_ref = _outputs_and_gradient(model, x, r)

    def measured(choice):
        quantized = with_precisions(model, choice, group_size)
        y, g = _outputs_and_gradient(quantized, x, r)
        return _errors(y, g, y_ref, g_ref)

    return layers_of(model), measured


def evaluate(model, x, *, precision="int8", group_size=DEFAULT_GROUP_SIZE, seed=0):
    """Errors of ``model`` (float32) quantized to ``precision`` on the data
    ``x``: per layer (its weights' SQNR in dB; the model's output and input
    gradient with only that layer quantized: its sensitivity) and for the
    whole model (every layer at ``precision``, where it can be)."""
    layers, measured = _measurer(model, x, group_size, seed)

    per_layer, whole = [], {}
    for i, layer in enumerate(layers):
        chosen = precision if precision in precisions_for(layer, group_size) else "int8"
        whole[i] = chosen
        per_layer.append(
            {
                "layer": i,
                "kind": type(layer).__name__,
                "shape": list(layer.weight.shape),
                "precision": chosen,
                "weight_sqnr_db": _weight_sqnr(layer, chosen, group_size),
                "bytes": layer_bytes(layer, chosen, group_size),
                "float32_bytes": layer_bytes(layer, "float32", group_size),
                **{f"alone_{k}": v for k, v in measured({i: chosen}).items()},
            }
        )
    return {
        "precision": precision,
        "group_size": group_size,
        "examples": int(np.shape(x)[0]),
        "layers": per_layer,
        "model": measured(whole),
    }


def _error_of(errors: dict, metric: str) -> float:
    return errors["output_rel_l2" if metric == "output" else "gradient_rel_l2"]


def plan(model, x, budget: float, *, metric="output", group_size=DEFAULT_GROUP_SIZE,
         seed=0):  # fmt: skip
    """The cheapest precision per layer (bytes of the stored weights) whose
    whole model keeps ``metric``'s relative L2 error within ``budget`` on
    ``x``: every layer starts at its cheapest precision; while the measured
    whole-model error is over the budget, the layer whose quantization alone
    costs the most (its sensitivity) moves one step up (int4 -> int8 ->
    float32), and the model is measured again. Returns the choice, its
    errors, bytes and the steps taken."""
    if metric not in METRICS:
        raise ValueError(f"plan: metric must be one of {METRICS}, got {metric!r}")
    if not budget >= 0:
        raise ValueError(f"plan: budget must be >= 0, got {budget!r}")
    layers, measured = _measurer(model, x, group_size, seed)

    options = [precisions_for(layer, group_size) for layer in layers]
    choice = {i: opts[0] for i, opts in enumerate(options)}
    sensitivity = {
        (i, p): _error_of(measured({i: p}), metric)
        for i, opts in enumerate(options)
        for p in opts
        if p != "float32"
    }
    steps = []
    errors = measured(choice)
    while _error_of(errors, metric) > budget:
        movable = [i for i, p in choice.items() if p != "float32"]
        if not movable:
            break
        worst = max(movable, key=lambda i: sensitivity[i, choice[i]])
        opts = options[worst]
        choice[worst] = opts[opts.index(choice[worst]) + 1]
        errors = measured(choice)
        steps.append({"layer": worst, "to": choice[worst], **errors})
    size = sum(layer_bytes(lay, choice[i], group_size) for i, lay in enumerate(layers))
    full = sum(layer_bytes(lay, "float32", group_size) for lay in layers)
    return {
        "budget": budget,
        "metric": metric,
        "group_size": group_size,
        "precisions": [choice[i] for i in range(len(layers))],
        "bytes": size,
        "float32_bytes": full,
        "model": errors,
        "steps": steps,
    }
