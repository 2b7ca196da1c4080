"""Calibrated quantization (suite ``calibration``): GPTQ and AWQ against
round-to-nearest (RTN) at the same precision, group size and bytes, on the
examples' models, what calibrating costs in time, and W8A8 with SmoothQuant
and static activation scales against dynamic RTN on a model with outlier
input channels.

    .venv/bin/python -m benchmarks.bench_calibration

- the CNN surrogate (examples/cnn_surrogate, the committed weights): test
  error against the solver on 200 held-out fields, relative L2 to float32,
  GPTQ's calibration time on 128 training fields; int8 and all-int4 (G = 32);
- the digits MLP (64 -> 64 -> 10, trained here in float32 with optax, as
  examples/qat_pipeline.py's network): test accuracy, all-int4 (G = 16),
  calibrated on the 1,347 training images;
- a 4 x (4096, 4096) MLP on 128 samples: GPTQ's and AWQ's time, and the
  output error on held-out samples of the same distribution;
- W8A8 of three Linear layers whose inputs have outlier channels (as
  tests/qarray/test_calibration.py's model): output error against float32 on
  held-out inputs, each option / dynamic RTN's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import qarray.nn as qnn

ROOT = Path(__file__).resolve().parent.parent


def _timed_quantize(model, data, method="gptq", **options):
    start = time.perf_counter()
    quantized = qnn.quantize(model, method=method, data=data, **options)
    return quantized, time.perf_counter() - start


def cnn_rows():
    sys.path.insert(0, str(ROOT / "examples" / "cnn_surrogate"))
    from heat_surrogate import Surrogate, dataset, predict, relative_l2

    from qarray.checkpoint import load_tree

    model = load_tree(
        ROOT / "examples" / "cnn_surrogate" / "surrogate.safetensors",
        Surrogate(jax.random.key(0)),
    )
    # the pipeline's test set: the first 200 fields of seed 0
    test_k, test_u = dataset(np.random.default_rng(0), 200)
    calibration, _ = dataset(np.random.default_rng(1), 128)
    reference = predict(model, test_k)
    shape = (128, 32, 32)
    rows = []
    for precision, group, target in (("int8", None, None), ("int4", 32, 0.047)):
        options = {"precision": precision, "group_size": group}
        rtn = qnn.quantize(model, **options)
        gptq, seconds = _timed_quantize(model, calibration[:, None], **options)
        awq, awq_seconds = _timed_quantize(
            model, calibration[:, None], "awq", **options
        )
        errors = {
            name: (relative_l2(y, test_u), relative_l2(y, reference))
            for name, y in (
                ("rtn", predict(rtn, test_k)),
                ("gptq", predict(gptq, test_k)),
                ("awq", predict(awq, test_k)),
            )
        }
        what = f"CNN surrogate, all {precision}" + (f" (G={group})" if group else "")
        rows += [
            {
                "row": f"{what}: test error vs the solver, GPTQ",
                "shape": shape,
                "baseline": f"RTN {errors['rtn'][0]:.4f}, float32 "
                f"{relative_l2(reference, test_u):.4f}",
                "ratio": errors["gptq"][0],
                "target": target,
                "unit": "relative L2",
                "lower_is_better": True,
            },
            {
                "row": f"{what}: output error vs float32, GPTQ / RTN",
                "shape": shape,
                "baseline": f"RTN {errors['rtn'][1]:.4f}, GPTQ {errors['gptq'][1]:.4f}",
                "ratio": errors["gptq"][1] / errors["rtn"][1],
                "target": 0.5 if target else None,
                "unit": "x RTN's (lower is better)",
                "lower_is_better": True,
            },
            {
                "row": f"{what}: GPTQ calibration time",
                "shape": shape,
                "baseline": "128 calibration fields",
                "ratio": seconds,
                "target": 60.0,
                "unit": "s",
                "lower_is_better": True,
            },
            {
                "row": f"{what}: test error vs the solver, AWQ",
                "shape": shape,
                "baseline": f"RTN {errors['rtn'][0]:.4f}, GPTQ {errors['gptq'][0]:.4f}",
                "ratio": errors["awq"][0],
                "target": None,
                "unit": "relative L2",
                "lower_is_better": True,
            },
            {
                "row": f"{what}: output error vs float32, AWQ / RTN",
                "shape": shape,
                "baseline": f"RTN {errors['rtn'][1]:.4f}, AWQ {errors['awq'][1]:.4f}",
                "ratio": errors["awq"][1] / errors["rtn"][1],
                "target": None,
                "unit": "x RTN's (lower is better)",
                "lower_is_better": True,
            },
            {
                "row": f"{what}: AWQ calibration time",
                "shape": shape,
                "baseline": "128 calibration fields",
                "ratio": awq_seconds,
                "target": None,
                "unit": "s",
                "lower_is_better": True,
            },
        ]
    return rows


def _digits_mlp(x, y, steps=1500, seed=0):
    """64 -> 64 -> 10, relu, Adam on the cross-entropy, float32."""
    model = eqx.nn.MLP(
        64, 10, 64, depth=1, activation=jax.nn.relu, key=jax.random.key(seed)
    )
    optimizer = optax.adam(3e-3)
    state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state, xb, yb):
        def loss(m):
            logits = jax.vmap(m)(xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        grads = eqx.filter_grad(loss)(model)
        updates, state = optimizer.update(grads, state)
        return eqx.apply_updates(model, updates), state

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        pick = rng.integers(0, len(x), 128)
        model, state = step(model, state, x[pick], y[pick])
    return model


def digits_rows():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=0, stratify=digits.target
    )
    model = _digits_mlp(jnp.asarray(x_train), jnp.asarray(y_train))

    def accuracy(m):
        return float(np.mean(np.argmax(jax.vmap(m)(x_test), -1) == y_test))

    options = {"precision": "int4", "group_size": 16}
    float_acc = accuracy(model)
    rtn_acc = accuracy(qnn.quantize(model, **options))
    rows = []
    for method, target in (("gptq", 0.2), ("awq", None)):
        calibrated, _ = _timed_quantize(model, jnp.asarray(x_train), method, **options)
        rows.append(
            {
                "row": "digits MLP, all int4 (G=16): accuracy drop from float32, "
                f"{method.upper()}",
                "shape": (len(x_test), 64, 10),
                "baseline": f"float32 {100 * float_acc:.2f}%, RTN {100 * rtn_acc:.2f}%",
                "ratio": 100 * (float_acc - accuracy(calibrated)),
                "target": target,
                "unit": "points",
                "lower_is_better": True,
            }
        )
    return rows


def mlp_rows(width=4096, depth=4, samples=128):
    keys = jax.random.split(jax.random.key(0), depth + 1)
    mlp = eqx.nn.Sequential(
        [
            layer
            for k in keys[:depth]
            for layer in (
                eqx.nn.Linear(width, width, key=k),
                eqx.nn.Lambda(jax.nn.gelu),
            )
        ]
    )
    # inputs of a few hundred directions (as activations are), plus noise
    basis = jax.random.normal(keys[-1], (256, width)) / 16

    def draw(k, n):
        noise = jax.random.normal(jax.random.fold_in(k, 1), (n, width))
        return jax.random.normal(k, (n, 256)) @ basis + 0.01 * noise

    calibration, held_out = (
        draw(jax.random.key(1), samples),
        draw(jax.random.key(2), 64),
    )
    reference = jax.vmap(mlp)(held_out)

    def error(m):
        y = jax.vmap(m)(held_out)
        return float(jnp.linalg.norm(y - reference) / jnp.linalg.norm(reference))

    gptq, seconds = _timed_quantize(mlp, calibration)
    int4 = {"precision": "int4", "group_size": 128}
    awq, awq_seconds = _timed_quantize(mlp, calibration, "awq", **int4)
    shape = (samples, width, width)
    return [
        {
            "row": f"AWQ calibration time, {depth} x ({width}, {width}) MLP, int4",
            "shape": shape,
            "baseline": f"{samples} calibration samples",
            "ratio": awq_seconds,
            "target": None,
            "unit": "s",
            "lower_is_better": True,
        },
        {
            "row": f"{depth} x ({width}, {width}) MLP int4 (G=128): held-out "
            "output error, AWQ",
            "shape": shape,
            "baseline": f"RTN {error(qnn.quantize(mlp, **int4)):.5f}",
            "ratio": error(awq),
            "target": None,
            "unit": "relative L2",
            "lower_is_better": True,
        },
        {
            "row": f"GPTQ calibration time, {depth} x ({width}, {width}) MLP, int8",
            "shape": shape,
            "baseline": f"{samples} calibration samples",
            "ratio": seconds,
            "target": 60.0,
            "unit": "s",
            "lower_is_better": True,
        },
        {
            "row": f"{depth} x ({width}, {width}) MLP int8: held-out output "
            "error, GPTQ",
            "shape": shape,
            "baseline": f"RTN {error(qnn.quantize(mlp)):.5f}",
            "ratio": error(gptq),
            "target": None,
            "unit": "relative L2",
            "lower_is_better": True,
        },
    ]


def w8a8_rows(samples=128):
    # the tests' model: three Linear layers whose every input has outlier
    # channels (a gain of 50 on three hidden channels)
    from support.models import Outliers

    model = Outliers(jax.random.key(0))
    rng = np.random.default_rng(0)

    def draw():
        x = rng.standard_normal((samples, 64)).astype(np.float32)
        x[:, [3, 17]] *= 50.0
        return jnp.asarray(x)

    calibration, held_out = draw(), draw()
    reference = jax.vmap(model)(held_out)

    def error(m):
        y = jax.vmap(m)(held_out)
        return float(jnp.linalg.norm(y - reference) / jnp.linalg.norm(reference))

    dynamic = error(qnn.quantize(model, activations="int8"))
    rows = []
    for what, options, target in (
        ("SmoothQuant (alpha 0.5)", {"smoothquant": 0.5}, 0.5),
        ("static per-tensor scales", {"static": True}, None),
        ("static per-channel scales", {"static": "channel"}, None),
        ("SmoothQuant + static", {"smoothquant": 0.5, "static": True}, None),
        ("GPTQ + SmoothQuant", {"smoothquant": 0.5, "method": "gptq"}, None),
    ):
        quantized = qnn.quantize(model, activations="int8", data=calibration, **options)
        rows.append(
            {
                "row": f"W8A8 with outlier channels: output error, {what} / "
                "dynamic RTN",
                "shape": (samples, 64, 128),
                "baseline": f"dynamic RTN {dynamic:.4f}, this {error(quantized):.4f}",
                "ratio": error(quantized) / dynamic,
                "target": target,
                "unit": "x dynamic RTN's (lower is better)",
                "lower_is_better": True,
            }
        )
    return rows


def run():
    return [*cnn_rows(), *digits_rows(), *mlp_rows(), *w8a8_rows()]


if __name__ == "__main__":
    for row in run():
        print(
            f"{row['row']:<72} {row['ratio']:9.4f} {row['unit']}  ({row['baseline']})"
        )
