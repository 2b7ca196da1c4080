"""The JVP reference (straight-through, as ``support.network.vjp_one``'s transpose)."""

from __future__ import annotations

import numpy as np

from support import network as net


def _dense_kn_tangent(layer, tangent):
    """The tangent of a layer's dequantized (K, N) weights."""
    if "w" in layer:
        dw = np.asarray(tangent["w"], np.float64)
    else:
        q = layer["w_q"]["qvalue"].astype(np.float64)
        dw = q * np.asarray(tangent["w_q"]["scale"], np.float64)[..., None]
    return dw if layer.get("layout", "kn") == "kn" else dw.T


def jvp_one(x, layers, tx, tlayers, quantize_activations=False):
    _, trace = net.forward_one(x, layers, quantize_activations)
    th = np.asarray(tx, np.float64)
    for layer, tangent, (h, z) in zip(layers, tlayers, trace, strict=True):
        tz = th @ net.dense_kn(layer) + h @ _dense_kn_tangent(layer, tangent)
        if "bias" in layer:
            tz = tz + tangent["bias"]
        th = net.act_grad(layer.get("activation", "none"), z) * tz
    return th


def tangent_inputs(inputs, tangents):
    """A request shaped like ``inputs`` holding the tangents (zeros where none
    is given), so network.example indexes both alike."""
    t = {"x": tangents.get("x", np.zeros_like(inputs["x"])), "layers": []}
    for i, layer in enumerate(inputs["layers"]):
        one = {k: v for k, v in layer.items() if k in ("layout", "activation")}
        if "w" in layer:
            one["w"] = tangents.get(f"layers.[{i}].w", np.zeros_like(layer["w"]))
        else:
            scale = layer["w_q"]["scale"]
            one["w_q"] = {
                "qvalue": layer["w_q"]["qvalue"],
                "scale": tangents.get(f"layers.[{i}].w_q.scale", np.zeros_like(scale)),
            }
        if "bias" in layer:
            one["bias"] = tangents.get(
                f"layers.[{i}].bias", np.zeros_like(layer["bias"])
            )
        t["layers"].append(one)
    return t


def jvp(inputs, tangents):
    """The tangent of y for tangents {path: array}, over every example."""
    shape = net.batch_shape(inputs)
    qa = inputs.get("quantize_activations", False)
    t = tangent_inputs(inputs, tangents)
    ys = [
        jvp_one(*net.example(inputs, b), *net.example(t, b), qa)
        for b in np.ndindex(*shape)
    ]
    return np.stack(ys).reshape(*shape, *ys[0].shape) if shape else ys[0]
