"""Soak test: a real `qarray-serve` under mixed traffic for minutes (`make soak`).

    .venv/bin/python scripts/soak.py [--seconds 180] [--clients 6] [--workers 1]
        [--networks all|small|mid] [--out docs/soak.json] [--plot docs/soak.png]

Starts `qarray-serve serve` on a free loopback port (`--workers` processes)
and warms it up (every network x endpoint x gradient variant once, so XLA
compiles before the clock starts). Then `--clients` processes, each with its
own keep-alive connection, send `apply`, `vector_jacobian_product` and
`jacobian_vector_product` requests for `--seconds`: eight networks from tiny
to mid-sized (up to 1024 x 1024 weights, both layouts, dense `w` and `w_q`,
int8 activations on three, batch axes on three), fresh random arrays on every
request, gradients with respect to every path or to x alone; some VJPs reuse
the client's previous `apply` inputs (the residual cache's path). A share of
the requests (`--bad-share`) is one of 14 malformed ones: each must get a 4xx
whose small body names the field; never a 5xx.

Every good answer is checked against the NumPy reference network
(support/network.py; the JVP reference is here), in float64:
- small networks elementwise at rtol = atol = 2e-4, as the tests do; draws are
  redrawn until no row is near a rounding tie or a relu kink (below);
- mid networks relative to the answer's scale: max |got - want| <=
  SCALE_TOL x max |want| over the rows not near a tie or a kink. Near a tie
  (an int8 activation within a few float32 roundings of k + 1/2) server and
  reference can round one value apart, and with int8 activations that step is
  quantized again by every later layer: the whole row moves. So such rows are
  left out of apply and JVP checks, and get a zero cotangent in VJPs (so
  every cotangent is checked whole). Dense weights are drawn away from ties.

The server runs with the residual cache on for every nonlinear network
(QARRAY_VJP_CACHE_MIN_FLOPS=0) and tight load-shedding bounds
(QARRAY_MAX_REQUEST_BYTES = QARRAY_MAX_INFLIGHT_BYTES = 4 MiB by default; 0
keeps the server's defaults), so the 503 path is exercised too: a shed request
is retried after its Retry-After seconds with exponential backoff, as the
README tells clients to.

Records each request's latency (p50 / p90 / p99 per endpoint), the server's
resident memory (all its processes) every 0.5 s, status counts and 503s;
writes a JSON file and a PNG. Exits 1, saying why, on a wrong answer, a 5xx
other than a load-shedding 503 (one with Retry-After naming
QARRAY_MAX_INFLIGHT_BYTES), a malformed request answered otherwise than by a
small 4xx naming its field, a lost connection, a server that does not answer
/health at the end, or memory that keeps growing (`memory_verdict`: the
timed phase less its first 25% (at most 30 s) is cut in halves, a line fitted
to each; growing means both rise faster than max(1.5 MiB/min, 15 MiB over the
judged window): a leak grows all along, an allocator's step lifts one half.
A default 3-minute run tells leaks from ~6 MiB/min, a 10-minute one from
~1.6 MiB/min).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import queue
import random
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from support import network as net  # noqa: E402
from support.server import (  # noqa: E402
    b64,
    decode,
    encode,
    serve,
    server_processes,
)

ENDPOINTS = ("apply", "vector_jacobian_product", "jacobian_vector_product")
SHORT = {"apply": "apply", "vector_jacobian_product": "vjp"}
SHORT["jacobian_vector_product"] = "jvp"
RTOL = ATOL = 2e-4  # small networks, elementwise (as tests/tesseract/test_http.py)
# mid networks: max |got - want| <= SCALE_TOL x max |want| (the worst seen in
# a 10-minute run: 1.2e-6)
SCALE_TOL = 1e-4
# Where server (float32) and reference (float64) could round apart, in
# quantization steps of the value's row: a dense w is exact float32 (only the
# division's last bit differs): its values this close to a tie are nudged
# away at draw time. An int8 activation carries float32 rounding from the
# layers before it: within TIE_ABS + TIE_REL x (its value in steps) of a tie
# (x itself: X_TIE_REL), its row is "near a tie". Measured on m-nk-int8 (40
# draws, 1280 rows): the 2 rows that disagree are both caught from
# TIE_REL = 1e-6 on; 4e-6 leaves out ~18% of its rows.
W_TIE_MARGIN = 1e-3
TIE_ABS, TIE_REL, X_TIE_REL = 2e-5, 4e-6, 1e-6
# a relu's pre-activation within this share of its row's largest |z| of 0: the
# derivative could be taken on either side
KINK = 1e-5
SAMPLE_EVERY = 0.5  # seconds between RSS samples
# memory rule (memory_verdict)
SETTLE_SHARE, SETTLE_MAX = 0.25, 30.0  # left out: this share, at most SETTLE_MAX s
SLOPE_MIN = 1.5  # MiB per minute: the least slope called growing
RISE_MIN = 15.0  # MiB: ... and at least this much over the judged window
MAX_ERROR_BODY = 4096  # bytes: a 4xx body stays small
RETRIES = 6
WARMUP_TIMEOUT = 900  # seconds: the warm-up compiles every program
TIMEOUT = 120


# --- the networks


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


# --- the JVP reference (straight-through, as network.vjp_one's transpose)


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


# --- requests


class WrongAnswer(Exception):
    pass


def compare(got, want, spec, what, skip_rows=None):
    """The error as a fraction of its tolerance (<= 1 passes); raises
    WrongAnswer otherwise. ``skip_rows`` (mid networks): rows of a y-shaped
    answer left out, being near a tie or a kink."""
    got = np.asarray(got)
    if got.shape != np.shape(want):
        raise WrongAnswer(f"{what}: shape {got.shape}, want {np.shape(want)}")
    if got.dtype != np.float32:
        raise WrongAnswer(f"{what}: dtype {got.dtype}, want float32")
    if not np.all(np.isfinite(got)):
        raise WrongAnswer(f"{what}: non-finite values in the answer")
    diff = np.abs(got.astype(np.float64) - want)
    if spec.size == "small":
        fraction = float(np.max(diff / (ATOL + RTOL * np.abs(want)), initial=0))
        rule = f"rtol = atol = {RTOL}"
    else:
        scale = max(float(np.max(np.abs(want), initial=0)), 1e-30)
        if skip_rows is not None:
            diff = diff[~skip_rows]
        fraction = float(np.max(diff, initial=0)) / (SCALE_TOL * scale)
        rule = f"max |got - want| <= {SCALE_TOL} x max |want| = {SCALE_TOL * scale:.3g}"
    if not fraction <= 1:
        raise WrongAnswer(
            f"{what}: max |got - want| = {float(np.max(diff)):.4g} "
            f"({fraction:.3g} x the tolerance: {rule})"
        )
    return fraction


def weight_errors(inputs):
    """Each layer's weight_error as apply returns it: over the batch axes."""
    shape = net.batch_shape(inputs)
    out = [np.zeros(shape) for _ in inputs["layers"]]
    for b in np.ndindex(*shape):
        _, layers = net.example(inputs, b)
        for i, layer in enumerate(layers):
            if "w" in layer:
                out[i][b] = net.weight_error(layer["w"])
    return out


@dataclass
class Drawn:
    """One draw of a network: its arrays, encoded, and its excused rows."""

    spec: Spec
    inputs: dict
    excused: np.ndarray  # bool, y.shape[:-1]
    encoded: dict

    @classmethod
    def of(cls, spec, rng):
        inputs, excused = spec.draw(rng)
        return cls(spec, inputs, excused, encode(inputs))


@dataclass
class Good:
    """A request with its reference check."""

    drawn: Drawn
    endpoint: str
    payload: dict
    check: object  # decoded answer -> worst error as a fraction of tolerance


def good_request(drawn, endpoint, rng, wrt="all", fault=False):
    """A request to ``endpoint`` on a drawn network, with respect to every
    differentiable path (wrt="all") or x alone (wrt="x"): two compiled
    programs per network and gradient endpoint, not one per subset."""
    spec, inputs, excused = drawn.spec, drawn.inputs, drawn.excused
    paths = net.diff_paths(inputs) if wrt == "all" else ["x"]
    if endpoint == "apply":
        # the per-layer outputs are checked too: asked for
        payload = {"inputs": {**drawn.encoded, "return_weight_error": True}}

        def check(out):
            want = net.forward(inputs)
            if fault:  # --inject-fault wrong-answer: the reference moves a bit
                want = want.copy()
                want.flat[0] += 1.0
            worst = compare(out["y"], want, spec, "y", excused)
            if len(out["layers"]) != len(inputs["layers"]):
                raise WrongAnswer(f"{len(out['layers'])} layers in the answer")
            for i, want_error in enumerate(weight_errors(inputs)):
                got = np.asarray(out["layers"][i]["weight_error"])
                if got.shape != want_error.shape or not np.allclose(
                    got, want_error, rtol=1e-3, atol=1e-6
                ):
                    raise WrongAnswer(
                        f"layers.[{i}].weight_error: {got}, want {want_error}"
                    )
            return worst

    elif endpoint == "vector_jacobian_product":
        g = net.normal(rng, excused.shape + net.forward(inputs).shape[-1:])
        g[excused] = 0  # rows near a tie or kink contribute to no cotangent
        payload = {
            "inputs": drawn.encoded,
            "vjp_inputs": paths,
            "vjp_outputs": ["y"],
            "cotangent_vector": {"y": b64(g)},
        }

        def check(out):
            want = net.vjp(inputs, g)
            if set(out) != set(paths):
                raise WrongAnswer(f"paths {sorted(out)}, want {sorted(paths)}")
            return max(compare(out[p], want[p], spec, p) for p in paths)

    else:
        tangents = {p: net.normal(rng, np.shape(net.at(inputs, p))) for p in paths}
        payload = {
            "inputs": drawn.encoded,
            "jvp_inputs": paths,
            "jvp_outputs": ["y"],
            "tangent_vector": {p: b64(t) for p, t in tangents.items()},
        }

        def check(out):
            want = jvp(inputs, tangents)
            return compare(out["y"], want, spec, "y (tangent)", excused)

    return Good(drawn, endpoint, payload, check)


def _loc(*path):
    """FastAPI's location of a field at ``path`` in a 422."""
    return ",".join(f'"{p}"' if isinstance(p, str) else str(p) for p in path)


def _declared(*shape):
    return {
        "object_type": "array",
        "shape": list(shape),
        "dtype": "float32",
        "data": {"buffer": "AAAAAA==", "encoding": "base64"},
    }


def bad_requests(rng):
    """(name, endpoint, payload, fragments the 4xx must contain), built on a
    fresh valid 3-layer network: x (3, 6) -> [0] w (6, 5) relu ->
    [1] w_q (5, 4) tanh -> [2] w (4, 2), layout "kn", biases everywhere."""
    inputs = SPECS[0].build(rng)
    base = encode(inputs)

    def changed(edit):
        payload = json.loads(json.dumps(base))
        edit(payload)
        return payload

    def layer(i, **fields):
        def edit(p):
            p["layers"][i].update(fields)

        return changed(edit)

    x_nan = inputs["x"].copy()
    x_nan[1, 2] = np.nan
    truncated = b64(inputs["x"])
    truncated["data"]["buffer"] = truncated["data"]["buffer"][:-6]
    g = b64(net.normal(rng, (3, 2)))
    vjp = {"vjp_outputs": ["y"], "cotangent_vector": {"y": g}}
    return [
        (
            "k-mismatch",
            "apply",
            {"inputs": layer(2, w=b64(net.normal(rng, (6, 2))))},
            ["layers.[2].w (6, 2) has K = 6", "output of layers.[1] of width 4"],
        ),
        (
            "scale-shape",
            "apply",
            {
                "inputs": layer(
                    1,
                    w_q={
                        **base["layers"][1]["w_q"],
                        "scale": b64(np.ones(4, np.float32)),
                    },
                )
            },
            ["layers.[1].w_q.scale must have shape (5,)", "got (4,)"],
        ),
        (
            "negative-scale",
            "apply",
            {
                "inputs": layer(
                    1,
                    w_q={
                        **base["layers"][1]["w_q"],
                        "scale": b64(-np.ones(5, np.float32)),
                    },
                )
            },
            ["layers.[1].w_q.scale must be >= 0"],
        ),
        (
            "bias-shape",
            "apply",
            {"inputs": layer(0, bias=b64(net.normal(rng, (3,))))},
            ["layers.[0].bias must have shape (..., N) with N = 5", "got (3,)"],
        ),
        (
            "bad-activation",
            "apply",
            {"inputs": layer(1, activation="leaky_relu")},
            [_loc("inputs", "layers", 1, "activation"), "'relu'"],
        ),
        (
            "both-weights",
            "apply",
            {"inputs": layer(0, w_q=base["layers"][1]["w_q"])},
            ["layers.[0] must give exactly one of w and w_q, got both"],
        ),
        (
            "unknown-field",
            "apply",
            {"inputs": layer(1, weights=1)},
            [_loc("inputs", "layers", 1, "weights"), "Extra inputs are not permitted"],
        ),
        (
            "nan-x",
            "apply",
            {"inputs": dict(base, x=b64(x_nan))},
            ["x must be finite, got nan at index (1, 2) of x (3, 6)"],
        ),
        (
            "truncated-base64",
            "apply",
            {"inputs": dict(base, x=truncated)},
            [_loc("inputs", "x"), "base64"],
        ),
        (
            "too-many-layers",
            "apply",
            {
                "inputs": {
                    "x": b64(np.ones((1, 2), np.float32)),
                    "layers": [{"w": b64(np.eye(2, dtype=np.float32))}] * 65,
                }
            },
            ["layers has 65 layers, over the limit of 64 (QARRAY_MAX_LAYERS)"],
        ),
        (
            "over-work",
            "apply",
            {
                "inputs": {
                    "x": _declared(30000, 1024),
                    "layers": [{"w": _declared(1024, 1024)} for _ in range(4)],
                }
            },
            [
                "layers.[3] brings the request's work to 153600000 elements",
                "QARRAY_MAX_WORK",
            ],
        ),
        (
            "vjp-path-not-given",
            "vector_jacobian_product",
            {"inputs": base, "vjp_inputs": ["layers.[1].w"], **vjp},
            ["vjp_inputs: 'layers.[1].w' names an array this request did not give"],
        ),
        (
            "cotangent-shape",
            "vector_jacobian_product",
            {
                "inputs": base,
                "vjp_inputs": ["x"],
                **vjp,
                "cotangent_vector": {"y": b64(np.ones((3, 3), np.float32))},
            },
            ["cotangent_vector['y'] must have the shape of y (3, 2), got (3, 3)"],
        ),
        (
            "tangent-shape",
            "jacobian_vector_product",
            {
                "inputs": base,
                "jvp_inputs": ["x"],
                "jvp_outputs": ["y"],
                "tangent_vector": {"x": b64(np.ones((3, 5), np.float32))},
            },
            ["Tangent vector 'x'", "incompatible with expected shape (3, 6)"],
        ),
    ]


# --- the server's memory


class RSSSampler:
    """The server's resident memory (its processes together) every SAMPLE_EVERY s."""

    def __init__(self, root, t0):
        self.root, self.t0 = root, t0
        self.samples = []  # (seconds since t0, MiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self):
        total = 0
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in [self.root, *self.root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += p.memory_info().rss
        return total / 2**20

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self.t0, self.rss()))
            self._stop.wait(SAMPLE_EVERY)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def memory_verdict(times, mib, start=0.0, end=None):
    """Whether the resident memory keeps growing over [start, end] (seconds).

    The first SETTLE_SHARE of the window (at most SETTLE_MAX seconds) is left
    out: concurrency raises the allocators' high-water marks there. The rest
    is cut in halves and a line fitted to each: growing means both rise faster
    than the limit, max(SLOPE_MIN MiB/min, RISE_MIN MiB over the judged
    window's length). A leak grows all along; a step (an allocator's
    high-water mark, a cache filling up) lifts one half's fit, not both, and
    the slow creep after warm-up stays under the limit. The limit is loose
    for short runs (a 3-minute run tells leaks from ~6 MiB/min, 10 minutes
    from ~1.6 MiB/min) because a short window cannot tell a leak from a step.
    """
    t = np.asarray(times, np.float64)
    m = np.asarray(mib, np.float64)
    end = t[-1] if end is None and len(t) else end
    judged_from = start + min(SETTLE_SHARE * ((end or 0) - start), SETTLE_MAX)
    keep = (t >= judged_from) & (t <= (end or 0))
    t, m = t[keep], m[keep]
    out = {
        "rule": (
            f"growing = linear fits to both halves of the judged window rise "
            f"faster than max({SLOPE_MIN} MiB/min, {RISE_MIN:.0f} MiB over the "
            f"window); judged over the timed phase less its first "
            f"{SETTLE_SHARE:.0%} (at most {SETTLE_MAX:.0f} s)"
        ),
        "judged_from_s": round(judged_from, 2),
        "judged_to_s": round(float(end or 0), 2),
        "judged_samples": len(t),
    }
    if len(t) < 8 or t[-1] <= t[0]:
        return {**out, "growing": False, "note": "too few samples to judge"}
    n = len(t)
    limit = max(SLOPE_MIN, RISE_MIN / ((t[-1] - t[0]) / 60))
    fits = []
    for part in (slice(0, n // 2), slice(n // 2, n)):
        slope, intercept = np.polyfit(t[part], m[part], 1)
        fits.append([float(slope), float(intercept), float(t[part][0])])
        fits[-1].append(float(t[part][-1]))
    slopes = [f[0] * 60 for f in fits]
    return {
        **out,
        "slopes_mib_per_min": [round(x, 3) for x in slopes],
        "limit_mib_per_min": round(limit, 3),
        "fits": fits,  # [slope MiB/s, intercept, from s, to s] per half
        "growth_mib": round(
            float(np.median(m[-(n // 4) :]) - np.median(m[: n // 4])), 2
        ),
        "growing": bool(min(slopes) > limit),
    }


# --- clients


@dataclass
class Record:
    t: float  # when the answer came, seconds since start
    kind: str  # an endpoint, or "refused" for a bad request
    network: str
    status: int
    ms: float
    phase: str  # "warmup" or "timed"


@dataclass
class Run:
    """One client's tally (client processes send it back whole at the end)."""

    url: str
    t0: float  # time.monotonic() when the server was started (system-wide)
    stop: object  # a multiprocessing Event: set on the first failure
    records: list = field(default_factory=list)  # Record fields, as tuples
    failures: list = field(default_factory=list)
    worst: dict = field(default_factory=dict)  # (network, endpoint) -> fraction
    shed: dict = field(default_factory=lambda: {"count": 0, "gave_up": 0})
    bad: dict = field(default_factory=dict)  # case -> {status: count}
    rows: dict = field(default_factory=dict)  # network -> [rows, excused rows]
    wrong: list = field(default_factory=list)  # (payload, answer) of wrong answers
    phase: str = "warmup"
    deadline: float = math.inf  # time.monotonic() at which the timed phase ends

    def fail(self, message):
        self.failures.append(message)
        print(f"FAILURE: {message}", file=sys.stderr, flush=True)
        self.stop.set()

    def tally(self):
        keys = ("records", "failures", "worst", "shed", "bad", "rows", "wrong")
        return {k: getattr(self, k) for k in keys}


def merge(tallies):
    """The clients' tallies as one."""
    total = {"records": [], "failures": [], "worst": {}, "bad": {}, "rows": {}}
    total.update(shed={"count": 0, "gave_up": 0}, wrong=[])
    for tally in tallies:
        total["records"] += [Record(*r) for r in tally["records"]]
        total["failures"] += tally["failures"]
        total["wrong"] += tally["wrong"]
        for key, value in tally["worst"].items():
            total["worst"][key] = max(total["worst"].get(key, 0.0), value)
        for key in ("count", "gave_up"):
            total["shed"][key] += tally["shed"][key]
        for name, counts in tally["bad"].items():
            merged = total["bad"].setdefault(name, {})
            for status, n in counts.items():
                merged[status] = merged.get(status, 0) + n
        for name, (n, k) in tally["rows"].items():
            rows = total["rows"].setdefault(name, [0, 0])
            rows[0] += n
            rows[1] += k
    return argparse.Namespace(**total)


def post(run, session, endpoint, payload, kind, network):
    """POST with retries on load-shedding 503s; the final response or None."""
    body = json.dumps(payload).encode()
    for attempt in range(RETRIES + 1):
        start = time.perf_counter()
        try:
            response = session.post(
                f"{run.url}/{endpoint}",
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=TIMEOUT,
            )
        except requests.RequestException as error:
            run.fail(f"{network} {endpoint}: no answer ({error!r})"[:500])
            return None
        ms = (time.perf_counter() - start) * 1e3
        status = response.status_code
        t = time.monotonic() - run.t0
        run.records.append((t, kind, network, status, ms, run.phase))
        if status != 503:
            return response
        retry_after = response.headers.get("Retry-After")
        if retry_after is None or "QARRAY_MAX_INFLIGHT_BYTES" not in response.text:
            run.fail(
                f"{network} {endpoint}: a 503 that is not load shedding "
                f"(Retry-After {retry_after!r}): {response.text[:300]}"
            )
            return None
        run.shed["count"] += 1
        # the README's advice: wait Retry-After seconds, backing off
        wait = min(float(retry_after) * 2**attempt, 8.0) * random.uniform(0.5, 1.0)
        time.sleep(wait)
    run.shed["gave_up"] += 1
    return None


def do_good(run, session, request):
    kind, name = request.endpoint, request.drawn.spec.name
    response = post(run, session, kind, request.payload, kind, name)
    if response is None:
        return
    if response.status_code != 200:
        run.fail(
            f"{name} {SHORT[kind]}: status {response.status_code} for a valid "
            f"request: {response.text[:500]}"
        )
        return
    try:
        fraction = request.check(decode(response.json()))
    except WrongAnswer as error:
        if not run.wrong:
            run.wrong.append((request.payload, response.text))
        run.fail(f"wrong answer: {name} {SHORT[kind]}: {error}")
        return
    excused = request.drawn.excused
    key = (name, kind)
    run.worst[key] = max(run.worst.get(key, 0.0), fraction)
    rows = run.rows.setdefault(name, [0, 0])
    rows[0] += excused.size
    rows[1] += int(excused.sum())


def do_bad(run, session, case):
    name, endpoint, payload, fragments = case
    response = post(run, session, endpoint, payload, "refused", name)
    if response is None:
        return
    status = response.status_code
    counts = run.bad.setdefault(name, {})
    counts[str(status)] = counts.get(str(status), 0) + 1
    text = response.text
    missing = [f for f in fragments if f not in text]
    if not 400 <= status < 500 or missing or len(response.content) > MAX_ERROR_BODY:
        run.fail(
            f"bad request {name!r} ({endpoint}): status {status}, "
            f"{len(response.content)} bytes, missing {missing}: {text[:500]}"
        )


def warm_up(run, session, specs, rng, fault=None):
    """Every network x endpoint x gradient variant once, VJPs both after an
    apply of the same inputs (the residual cache's path) and on fresh ones,
    and every malformed request: XLA compiles here, not in the timed phase."""
    for i, spec in enumerate(specs):
        applied, fresh = Drawn.of(spec, rng), Drawn.of(spec, rng)
        faulty = fault == "wrong-answer" and i == 0
        steps = [(applied, "apply", "all")]
        steps += [(applied, "vector_jacobian_product", w) for w in ("all", "x")]
        steps += [(fresh, e, w) for e in ENDPOINTS[1:] for w in ("all", "x")]
        for drawn, endpoint, wrt in steps:
            if run.stop.is_set():
                return
            do_good(run, session, good_request(drawn, endpoint, rng, wrt, faulty))
    for case in bad_requests(rng):
        if not run.stop.is_set():
            do_bad(run, session, case)


def client(index, url, t0, names, seed, bad_share, fault, sync, out):
    """One client process (its own interpreter: the clients' reference checks
    do not queue on one GIL, so latencies are the server's and the CPUs').
    Warms up on its own connection (with several workers, each keeps the
    connections it accepted: every worker that serves the timed phase
    compiles here), waits for the others, then sends mixed traffic until the
    deadline; puts its tally on ``out``."""
    stop, warmed, go, deadline = sync
    run = Run(url, t0, stop)
    specs = [s for s in SPECS if s.name in names]
    rng = np.random.default_rng([seed, index])
    chooser = random.Random(seed * 1000 + index)
    last = None  # the previous apply's draw
    shift = index % len(specs)  # clients compile different programs at once
    try:
        with requests.Session() as session:
            order = specs[shift:] + specs[:shift]
            warm_up(run, session, order, rng, fault if index == 0 else None)
            warmed.wait()
            go.wait()
            run.phase, run.deadline = "timed", deadline.value
            while time.monotonic() < run.deadline and not stop.is_set():
                if chooser.random() < bad_share:
                    do_bad(run, session, chooser.choice(bad_requests(rng)))
                    continue
                endpoint = chooser.choice(ENDPOINTS)
                wrt = chooser.choice(("all", "x"))
                if endpoint == "apply" or not (last and chooser.random() < 0.4):
                    drawn = Drawn.of(chooser.choice(specs), rng)
                else:
                    drawn = last  # the apply's inputs again: the cache's path
                do_good(run, session, good_request(drawn, endpoint, rng, wrt))
                if endpoint == "apply":
                    last = drawn
    except threading.BrokenBarrierError:
        pass  # another client crashed: it said why
    except Exception:
        run.fail(f"client {index} crashed:\n{traceback.format_exc()}")
        warmed.abort()
        go.abort()
    finally:
        out.put(run.tally())


def drive(url, t0, specs, args):
    """Start the client processes, open the timed phase once all have warmed
    up, collect their tallies: (merged tally, timed_from, timed_to), times in
    seconds since t0."""
    ctx = multiprocessing.get_context("spawn")
    n = args.clients
    stop, out = ctx.Event(), ctx.Queue()
    warmed, go = ctx.Barrier(n + 1), ctx.Barrier(n + 1)
    deadline = ctx.Value("d", math.inf)
    names = [s.name for s in specs]
    procs = [
        ctx.Process(
            target=client,
            args=(i, url, t0, names, args.seed, args.bad_share),
            kwargs={
                "fault": args.inject_fault,
                "sync": (stop, warmed, go, deadline),
                "out": out,
            },
        )
        for i in range(n)
    ]
    for proc in procs:
        proc.start()
    wait = WARMUP_TIMEOUT
    try:
        warmed.wait(wait)
        deadline.value = time.monotonic() + args.seconds
        timed_from = time.monotonic() - t0
        go.wait(wait)
    except threading.BrokenBarrierError:
        timed_from = time.monotonic() - t0
    tallies = []
    for _ in procs:
        try:
            tallies.append(out.get(timeout=args.seconds + wait))
        except queue.Empty:
            break
    timed_to = time.monotonic() - t0
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    total = merge(tallies)
    if len(tallies) < n:
        total.failures.append(f"{n - len(tallies)} client processes sent no tally")
    return total, timed_from, timed_to


# --- summary, JSON, plot


def percentiles(ms):
    ms = np.asarray(ms, np.float64)
    if not len(ms):
        return {"count": 0}
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "count": len(ms),
        "p50": round(float(p50), 2),
        "p90": round(float(p90), 2),
        "p99": round(float(p99), 2),
        "max": round(float(ms.max()), 2),
        "mean": round(float(ms.mean()), 2),
    }


def summarize(run, args, specs, rss, timed_from, timed_to, server_env, healthy):
    timed = [r for r in run.records if r.phase == "timed"]
    answered = [r for r in timed if r.status != 503]
    statuses = {}
    for r in run.records:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    latency = {
        kind: percentiles([r.ms for r in answered if r.kind == kind])
        for kind in (*ENDPOINTS, "refused")
    }
    by_network = {
        spec.name: {
            SHORT[kind]: percentiles(
                [r.ms for r in answered if r.kind == kind and r.network == spec.name]
            )
            for kind in ENDPOINTS
        }
        for spec in specs
    }
    times = [t for t, _ in rss.samples]
    mib = [m for _, m in rss.samples]
    memory = memory_verdict(times, mib, timed_from, timed_to)
    memory.update(
        {
            "interval_s": SAMPLE_EVERY,
            "samples": [[round(t, 2), round(m, 2)] for t, m in rss.samples],
            "start_mib": round(mib[0], 2) if mib else None,
            "after_warmup_mib": round(
                next((m for t, m in rss.samples if t >= timed_from), math.nan), 2
            ),
            "end_mib": round(mib[-1], 2) if mib else None,
            "peak_mib": round(max(mib), 2) if mib else None,
        }
    )
    failures = list(run.failures)
    if memory["growing"]:
        failures.append(
            "memory keeps growing: "
            f"{' and '.join(map(str, memory['slopes_mib_per_min']))} MiB/min over "
            "the two halves of the timed phase (after it settled), over the limit "
            f"of {memory['limit_mib_per_min']} MiB/min"
        )
    if not healthy:
        failures.append("the server did not answer /health after the run")
    five = {s: n for s, n in statuses.items() if s.startswith("5") and s != "503"}
    duration = timed_to - timed_from
    return {
        "command": " ".join(sys.argv),
        "config": {
            "seconds": args.seconds,
            "clients": args.clients,
            "workers": args.workers,
            "seed": args.seed,
            "cpus": os.cpu_count(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "bad_share": args.bad_share,
            "networks": {s.name: s.describe() for s in specs},
            "server_env": server_env,
            "tolerances": {
                "small": f"elementwise rtol = atol = {RTOL}; redrawn until no row "
                "is near a tie or a kink",
                "mid": f"max |got - want| <= {SCALE_TOL} x max |want|, rows near a "
                "tie or a kink left out (zero cotangent rows for VJPs)",
            },
        },
        "ok": not failures,
        "failures": failures,
        "warmup_s": round(timed_from, 2),
        "duration_s": round(duration, 2),
        "requests": {
            "timed": len(answered),
            "per_second": round(len(answered) / duration, 2) if duration > 0 else 0,
            "good": sum(r.kind != "refused" for r in answered),
            "bad": sum(r.kind == "refused" for r in answered),
            "all_phases_by_status": dict(sorted(statuses.items())),
            "5xx_not_shedding": sum(five.values()),
        },
        "latency_ms": latency,
        "latency_ms_by_size": {
            size: {
                SHORT[kind]: percentiles(
                    [
                        r.ms
                        for r in answered
                        if r.kind == kind and r.network.startswith(size[0] + "-")
                    ]
                )
                for kind in ENDPOINTS
            }
            for size in ("small", "mid")
        },
        "latency_ms_by_network": by_network,
        "shed_503": dict(run.shed),
        "bad_requests": dict(sorted(run.bad.items())),
        "worst_error_fraction_of_tolerance": {
            f"{n} {SHORT[k]}": round(v, 4) for (n, k), v in sorted(run.worst.items())
        },
        "excused_rows": {
            name: {"rows": n, "excused": k, "share": round(k / n, 4) if n else 0}
            for name, (n, k) in sorted(run.rows.items())
            if k or name.startswith("m-")
        },
        "memory": memory,
    }


def to_json(result):
    """Indented, with the RSS samples on one line."""
    samples = result["memory"]["samples"]
    result = {**result, "memory": {**result["memory"], "samples": "SAMPLES"}}
    text = json.dumps(result, indent=1)
    return text.replace('"SAMPLES"', json.dumps(samples), 1) + "\n"


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 1.4]}
    )
    kinds = [k for k, v in result["latency_ms"].items() if v["count"]]
    labels = {**SHORT, "refused": "refused (4xx)"}
    xs = np.arange(len(kinds))
    for offset, key, color in ((-0.2, "p50", "tab:blue"), (0.2, "p99", "tab:orange")):
        values = [result["latency_ms"][k][key] for k in kinds]
        bars = left.bar(xs + offset, values, 0.4, label=key, color=color)
        left.bar_label(bars, fmt="%.0f", fontsize=8)
    left.set_xticks(
        xs, [f"{labels[k]}\nn={result['latency_ms'][k]['count']}" for k in kinds]
    )
    if kinds:
        left.set_yscale("log")
    else:
        left.text(0.5, 0.5, "no timed requests", ha="center", transform=left.transAxes)
    left.set_ylabel("latency (ms)")
    left.set_title(
        f"latency per endpoint, {result['config']['clients']} clients, "
        f"{result['duration_s']:.0f} s"
    )
    left.legend()
    memory = result["memory"]
    samples = np.asarray(memory["samples"]) if memory["samples"] else np.zeros((0, 2))
    right.plot(samples[:, 0], samples[:, 1], lw=1, label="server RSS (all processes)")
    right.axvspan(0, result["warmup_s"], color="0.9", label="start-up + warm-up")
    right.axvline(
        memory["judged_from_s"], color="0.5", ls=":", lw=1, label="judged from here"
    )
    for i, (slope, intercept, a, b) in enumerate(memory.get("fits", [])):
        per_min = memory["slopes_mib_per_min"][i]
        right.plot(
            [a, b],
            [slope * a + intercept, slope * b + intercept],
            "r--" if i else "m--",
            label=f"fit, {('first', 'second')[i]} half: {per_min:+.2f} MiB/min",
        )
    right.set_xlabel("seconds since the server started")
    right.set_ylabel("MiB")
    verdict = "growing" if memory["growing"] else "flat"
    right.set_title(
        f"resident memory: {verdict}; 503s: {result['shed_503']['count']}; "
        f"{'OK' if result['ok'] else 'FAILED'}"
    )
    right.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result):
    requests_ = result["requests"]
    print(
        f"\nsoak: {result['duration_s']:.0f} s timed, "
        f"{result['config']['clients']} clients, {requests_['timed']} requests "
        f"({requests_['per_second']}/s)"
    )
    print("| endpoint | n | p50 ms | p90 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for kind, s in result["latency_ms"].items():
        if s["count"]:
            row = [kind, s["count"], s["p50"], s["p90"], s["p99"], s["max"]]
            print("| " + " | ".join(map(str, row)) + " |")
    for size, kinds in result["latency_ms_by_size"].items():
        for kind, s in kinds.items():
            if s["count"]:
                row = [f"{kind}, {size} networks", s["count"], s["p50"], s["p90"]]
                row += [s["p99"], s["max"]]
                print("| " + " | ".join(map(str, row)) + " |")
    m = result["memory"]
    print(
        f"statuses {result['requests']['all_phases_by_status']}; 503s "
        f"{result['shed_503']}; RSS {m['start_mib']} -> {m['after_warmup_mib']} "
        f"(after warm-up) -> {m['end_mib']} MiB, peak {m['peak_mib']}; slope "
        f"{m.get('slopes_mib_per_min')} MiB/min (limit {m.get('limit_mib_per_min')}), "
        f"last quarter - first {m.get('growth_mib')} MiB: "
        f"{'growing' if m['growing'] else 'not growing'}"
    )
    worst = result["worst_error_fraction_of_tolerance"]
    if worst:
        key = max(worst, key=worst.get)
        print(f"worst answer: {worst[key]:.3f} of its tolerance ({key})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="timed phase")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--workers", type=int, default=1, help="--num-workers")
    parser.add_argument("--networks", choices=("all", "small", "mid"), default="all")
    parser.add_argument("--bad-share", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-request-bytes", type=int, default=4 * 2**20)
    parser.add_argument("--max-inflight-bytes", type=int, default=4 * 2**20)
    parser.add_argument("--out", default=str(ROOT / "docs" / "soak.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "soak.png"))
    parser.add_argument(
        "--inject-fault",
        choices=("wrong-answer",),
        help="tests only: make the reference disagree with the first answer",
    )
    args = parser.parse_args(argv)
    specs = [s for s in SPECS if args.networks in ("all", s.size)]
    server_env = {"QARRAY_VJP_CACHE_MIN_FLOPS": "0"}
    for name, value in (
        ("QARRAY_MAX_REQUEST_BYTES", args.max_request_bytes),
        ("QARRAY_MAX_INFLIGHT_BYTES", args.max_inflight_bytes),
    ):
        if value:
            server_env[name] = str(value)

    with tempfile.TemporaryDirectory(prefix="qarray-soak-") as tmp:
        t0 = time.monotonic()
        with serve(Path(tmp), env=server_env, workers=args.workers) as url:
            with RSSSampler(server_processes(url)[0], t0) as rss:
                run, timed_from, timed_to = drive(url, t0, specs, args)
            try:
                healthy = requests.get(f"{url}/health", timeout=30).status_code == 200
            except requests.RequestException:
                healthy = False
            if run.failures or not healthy:
                logs = sorted(Path(tmp).glob("server-*.log"))
                if logs:
                    print(logs[0].read_text()[-3000:], file=sys.stderr)
    result = summarize(run, args, specs, rss, timed_from, timed_to, server_env, healthy)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(to_json(result))
    for i, (payload, answer) in enumerate(run.wrong[:3]):
        dump = Path(args.out).with_name(f"{Path(args.out).stem}-wrong-{i}.json")
        dump.write_text(json.dumps({"request": payload, "answer": answer}))
        print(f"the request and its wrong answer: {dump}", file=sys.stderr)
    plot(result, args.plot)
    report(result)
    print(f"wrote {args.out} and {args.plot}")
    if not result["ok"]:
        print("SOAK FAILED:", file=sys.stderr)
        for failure in result["failures"]:
            print(f"  - {failure}", file=sys.stderr)
        return 1
    print("soak passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
