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
- a Linear (512, 512) on correlated inputs of skewed channels (64
  directions, channel scales 0.2 to 3, as tests/qarray/test_calibration.py's),
  int4 (G = 32): held-out output error of AWQ with its clipping search, of
  AWQ's channel scale alone (before the clipping) and of GPTQ, each / RTN's;
- W8A8 of three Linear layers whose inputs have outlier channels (as
  tests/qarray/test_calibration.py's model): output error against float32 on
  held-out inputs, each option / dynamic RTN's.

    .venv/bin/python -m benchmarks.bench_calibration --table

prints instead a table of the methods (RTN, GPTQ, AWQ's scale alone, AWQ)
on the models above at int4: the model's bytes, held-out output error
against float32 and calibration time (about 4 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import qarray.nn as qnn
from qarray.nn._calibrate import Calibration, calibrated
from qarray.nn._kinds import quantized

ROOT = Path(__file__).resolve().parent.parent


def _timed_quantize(model, data, method="gptq", **options):
    start = time.perf_counter()
    if method == "awq-scale":  # AWQ before its clipping search
        chosen = Calibration(method="awq", awq_clip=False)
        precision, group = options["precision"], options["group_size"]
        model = calibrated(
            model, data, lambda n: quantized(n, precision, group), chosen
        )
        method, data = "rtn", None  # the layers left: round-to-nearest
    result = qnn.quantize(model, method=method, data=data, **options)
    return result, time.perf_counter() - start


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


def _skewed(width=512, directions=64, samples=256):
    """A Linear (width, width) and (calibration, held-out) inputs: a few
    dozen directions with channel scales 0.2 to 3 (test_calibration's)."""
    rng = np.random.default_rng(0)
    mixing = rng.standard_normal((directions, width))
    mixing = (mixing + 0.2 * np.eye(directions, width)) * np.linspace(0.2, 3, width)

    def draw():
        z = rng.standard_normal((samples, directions))
        return jnp.asarray((z @ mixing).astype(np.float32))

    return eqx.nn.Linear(width, width, key=jax.random.key(4)), draw(), draw()


def skewed_rows():
    layer, calibration, held_out = _skewed()
    reference = jax.vmap(layer)(held_out)

    def error(m):
        y = jax.vmap(m)(held_out)
        return float(jnp.linalg.norm(y - reference) / jnp.linalg.norm(reference))

    int4 = {"precision": "int4", "group_size": 32}
    rtn = error(qnn.quantize(layer, **int4))
    errors = {
        method: error(_timed_quantize(layer, calibration, method, **int4)[0])
        for method in ("awq", "awq-scale", "gptq")
    }
    shape = (calibration.shape[0], *layer.weight.shape)
    what = "Linear (512, 512), correlated channel-skewed inputs, int4 (G=32)"
    return [
        {
            "row": f"{what}: held-out output error, AWQ / RTN",
            "shape": shape,
            "baseline": f"RTN {rtn:.4f}, AWQ {errors['awq']:.4f}, AWQ's scale "
            f"alone {errors['awq-scale'] / rtn:.2f}x",
            "ratio": errors["awq"] / rtn,
            "target": 0.85,
            "unit": "x RTN's (lower is better)",
            "lower_is_better": True,
        },
        {
            "row": f"{what}: held-out output error, GPTQ / RTN",
            "shape": shape,
            "baseline": f"RTN {rtn:.4f}, GPTQ {errors['gptq']:.4f}",
            "ratio": errors["gptq"] / rtn,
            "target": None,
            "unit": "x RTN's (lower is better)",
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
    return [
        *cnn_rows(), *digits_rows(), *mlp_rows(), *skewed_rows(), *w8a8_rows()
    ]  # fmt: skip


METHODS = {
    "RTN": "rtn",
    "GPTQ": "gptq",
    "AWQ, scale alone": "awq-scale",
    "AWQ (scale + clipping)": "awq",
}


def _nbytes(model) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def _cases():
    """(name, float model, calibration inputs, held-out inputs, options)."""
    sys.path.insert(0, str(ROOT / "examples" / "cnn_surrogate"))
    from heat_surrogate import Surrogate, dataset
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from qarray.checkpoint import load_tree

    layer, calibration, held_out = _skewed()
    yield "Linear (512, 512), skewed inputs", layer, calibration, held_out, 32
    digits = load_digits()
    x = (digits.data / 16).astype(np.float32)
    x_train, x_test, y_train, _ = train_test_split(
        x, digits.target, test_size=0.25, random_state=0, stratify=digits.target
    )
    mlp = _digits_mlp(jnp.asarray(x_train), jnp.asarray(y_train))
    yield "digits MLP", mlp, jnp.asarray(x_train), jnp.asarray(x_test), 16
    cnn = load_tree(
        ROOT / "examples" / "cnn_surrogate" / "surrogate.safetensors",
        Surrogate(jax.random.key(0)),
    )
    fields, _ = dataset(np.random.default_rng(1), 128)
    test, _ = dataset(np.random.default_rng(0), 200)
    yield "CNN surrogate", cnn, jnp.asarray(fields[:, None]), test[:, None], 32
    keys = jax.random.split(jax.random.key(0), 5)
    wide = eqx.nn.Sequential(
        [layer for k in keys[:4]
         for layer in (eqx.nn.Linear(4096, 4096, key=k), eqx.nn.Lambda(jax.nn.gelu))]
    )  # fmt: skip
    basis = jax.random.normal(keys[-1], (256, 4096)) / 16

    def draw(k, n):
        noise = jax.random.normal(jax.random.fold_in(k, 1), (n, 4096))
        return jax.random.normal(k, (n, 256)) @ basis + 0.01 * noise

    yield (
        "4 x (4096, 4096) MLP",
        wide,
        draw(jax.random.key(1), 128),
        draw(jax.random.key(2), 64),
        128,
    )


def table() -> str:
    """Markdown: per model and method at int4, the bytes, the held-out
    output error against float32 and the calibration time."""
    lines = [
        "| model (int4, G) | method | bytes | held-out output rel L2 vs float32 "
        "| calibration (s) |",
        "|---|---|---|---|---|",
    ]
    for name, model, calibration, held_out, group in _cases():
        run_on = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
        reference = np.asarray(run_on(model, held_out), np.float64)
        for label, method in METHODS.items():
            options = {"precision": "int4", "group_size": group}
            if method == "rtn":
                q, seconds = qnn.quantize(model, **options), None
            else:
                q, seconds = _timed_quantize(model, calibration, method, **options)
            y = np.asarray(run_on(q, held_out), np.float64)
            error = np.linalg.norm(y - reference) / np.linalg.norm(reference)
            took = "-" if seconds is None else f"{seconds:.1f}"
            lines.append(
                f"| {name} (G={group}) | {label} | {_nbytes(q):,} | {error:.4f} "
                f"| {took} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--table",
        action="store_true",
        help="the methods x models table (bytes, error, calibration time) instead",
    )
    parser.add_argument(
        "--only", choices=("cnn", "digits", "mlp", "skewed", "w8a8"), default=None,
        help="one group of rows",
    )  # fmt: skip
    args = parser.parse_args()
    if args.table:
        print(table())
        sys.exit()
    groups = {"cnn": cnn_rows, "digits": digits_rows, "mlp": mlp_rows,
              "skewed": skewed_rows, "w8a8": w8a8_rows}  # fmt: skip
    for row in groups[args.only]() if args.only else run():
        print(
            f"{row['row']:<72} {row['ratio']:9.4f} {row['unit']}  ({row['baseline']})"
        )
