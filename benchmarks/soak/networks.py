"""The networks the soak run serves (``SPECS``) and how their draws stay
away from rounding ties and relu kinks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from support import network as net

from .settings import KINK, TIE_ABS, TIE_REL, W_TIE_MARGIN, X_TIE_REL


@dataclass(frozen=True)
class Spec:
    """A network's shapes; every request draws fresh arrays for them."""

    name: str
    size: str  # "small": elementwise check, tie-free draws; "mid": scale-relative
    x: tuple
    layers: tuple  # (k, n, layout, kind, activation, batch axes) per layer
    int8: bool = False  # quantize_activations

    def build(self, rng):
        layers = []
        for k, n, layout, kind, act, batch in self.layers:
            layer = net.make_layer(rng, k, n, layout, kind, True, act, batch)
            # scaled like a trained network (weights ~ 1/sqrt(K)): activations
            # stay O(1) instead of saturating every tanh and sigmoid
            if kind == "w":
                layer["w"] = nudge_ties(layer["w"] / np.float32(math.sqrt(k)))
            else:
                layer["w_q"]["scale"] /= np.float32(math.sqrt(k))
            layers.append(layer)
        x = net.normal(rng, self.x)
        return {"x": x, "layers": layers, "quantize_activations": self.int8}

    def draw(self, rng):
        """Fresh arrays: (inputs, rows near a tie or a kink). A small network
        is redrawn until it has none (it is checked elementwise)."""
        while True:
            inputs = self.build(rng)
            excused = excused_rows(inputs)
            if self.size != "small" or not excused.any():
                return inputs, excused

    def describe(self):
        return {
            "size": self.size,
            "x": list(self.x),
            "layers": [
                {
                    "k": k,
                    "n": n,
                    "layout": layout,
                    "kind": kind,
                    "activation": act,
                    "batch": list(batch),
                }
                for k, n, layout, kind, act, batch in self.layers
            ],
            "int8_activations": self.int8,
        }


SPECS = [
    Spec(
        "s-kn",
        "small",
        (3, 6),
        (
            (6, 5, "kn", "w", "relu", ()),
            (5, 4, "kn", "w_q", "tanh", ()),
            (4, 2, "kn", "w", "none", ()),
        ),
    ),
    Spec(
        "s-nk-int8",
        "small",
        (4, 16),
        (
            (16, 24, "nk", "w_q", "gelu", ()),
            (24, 12, "nk", "w", "sigmoid", ()),
            (12, 4, "nk", "w_q", "silu", ()),
        ),
        int8=True,
    ),
    Spec(
        "s-batch",
        "small",
        (2, 3, 4),
        ((4, 5, "nk", "w", "gelu", (2,)), (5, 3, "kn", "w_q", "none", (1,))),
    ),
    Spec(
        "s-batch2-int8",
        "small",
        (3, 2, 5, 8),
        ((8, 16, "kn", "w", "relu", (3, 1)), (16, 6, "nk", "w_q", "silu", (1, 2))),
        int8=True,
    ),
    Spec(
        "m-kn",
        "mid",
        (64, 256),
        (
            (256, 512, "kn", "w", "relu", ()),
            (512, 256, "kn", "w_q", "gelu", ()),
            (256, 16, "kn", "w", "none", ()),
        ),
    ),
    Spec(
        "m-nk-int8",
        "mid",
        (32, 512),
        (
            (512, 512, "nk", "w", "silu", ()),
            (512, 128, "nk", "w_q", "tanh", ()),
            (128, 10, "nk", "w", "none", ()),
        ),
        int8=True,
    ),
    Spec(
        "m-batch",
        "mid",
        (4, 16, 128),
        ((128, 256, "kn", "w", "relu", (4,)), (256, 64, "nk", "w_q", "none", (1,))),
    ),
    Spec(
        "m-wide",
        "mid",
        (16, 1024),
        ((1024, 1024, "kn", "w_q", "relu", ()), (1024, 32, "nk", "w", "tanh", ())),
    ),
]


def _steps(v):
    """|v| in quantization steps of its row (per-row absmax int8), float64."""
    v = np.asarray(v, np.float32).astype(np.float64)
    step = np.max(np.abs(v), axis=-1, keepdims=True) / 127
    return np.abs(v) / np.where(step > 0, step, 1)


def _tie_gap(ratio):
    """Distance (in steps) from a rounding tie (k + 1/2)."""
    return np.abs(ratio - np.floor(ratio) - 0.5)


def nudge_ties(w):
    """``w`` with every value within W_TIE_MARGIN steps of a rounding tie
    moved to 0.01 steps from it (same side): server and reference then round
    every weight alike. The largest |value| of a row (127 steps) is untouched,
    so the row's scale is too."""
    w = np.asarray(w, np.float32)
    ratio = _steps(w)
    near = _tie_gap(ratio) < W_TIE_MARGIN
    if not near.any():
        return w
    step = np.max(np.abs(w.astype(np.float64)), axis=-1, keepdims=True) / 127
    frac = ratio - np.floor(ratio)
    moved = np.floor(ratio) + np.where(frac < 0.5, 0.49, 0.51)
    return np.where(near, np.sign(w) * moved * step, w).astype(np.float32)


def excused_rows(inputs):
    """Rows of y (y.shape[:-1]) where server and reference could disagree
    beyond rounding: an int8 activation near a rounding tie (one step apart,
    carried through every later layer's quantization), or a relu at its kink
    (derivatives taken on either side), by the float64 reference's forward."""
    quantize_activations = inputs.get("quantize_activations", False)
    shape = net.batch_shape(inputs)
    masks = []
    for b in np.ndindex(*shape):
        x, layers = net.example(inputs, b)
        _, trace = net.forward_one(x, layers, quantize_activations)
        mask = np.zeros(np.shape(x)[:-1], bool)
        for i, (layer, (h, z)) in enumerate(zip(layers, trace, strict=True)):
            if quantize_activations:
                _, scale = net.quantized(layer)
                # "kn" folds the weights' per-row scales into h before quantizing
                v = h * scale if layer.get("layout", "kn") == "kn" else h
                ratio = _steps(v)
                margin = TIE_ABS + (X_TIE_REL if i == 0 else TIE_REL) * ratio
                mask |= np.any(_tie_gap(ratio) < margin, axis=-1)
            if layer.get("activation", "none") == "relu":
                row_max = np.max(np.abs(z), axis=-1, keepdims=True)
                mask |= np.any(np.abs(z) <= KINK * row_max, axis=-1)
        masks.append(mask)
    stacked = np.stack(masks)
    return stacked.reshape(*shape, *masks[0].shape) if shape else masks[0]
