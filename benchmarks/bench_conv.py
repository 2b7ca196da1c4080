"""conv_q against jitted float32 ``lax.conv_general_dilated`` (suite ``conv``).

    .venv/bin/python -m benchmarks.bench_conv [--quick]

Shapes from the models people serve: a CNN surrogate's 3x3 layers on a 64x64
and a 32x32 field, one field at a time and in a batch, and PointNet's
kernel-1 Conv1d. Conv weights are small (kilobytes), so the activations set
the memory traffic and the rows are hot. Each formulation in
``qarray._conv.CONV_STRATEGIES`` gets a forced row, which is what conv_q's
default is set from; a training-step row times ``jax.grad`` of a loss through
one layer with float32 weights quantized every call (straight-through).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qarray as qa
from benchmarks._timing import interleaved
from qarray._conv import CONV_STRATEGIES, ConvQ

# (batch, in channels, spatial, out channels, kernel, padding)
SHAPES = [
    (1, 32, (64, 64), 32, (3, 3), "SAME"),
    (8, 32, (64, 64), 32, (3, 3), "SAME"),
    (16, 64, (32, 32), 64, (3, 3), "SAME"),
    (8, 64, (1024,), 128, (1,), "VALID"),
]


# (batch, in channels, spatial) -> targets of conv_q's default rows against
# float32 (issue 26): the CNN surrogate's and PointNet's layers
TARGETS = {
    (8, 32, (64, 64)): {"float32": 1.2, "int8": 2.0},
    (8, 64, (1024,)): {"float32": 1.2, "int8": 2.0},
}


def _dense(x, w, padding):
    space = "DHW"[3 - w.ndim + 2 :]
    numbers = ("NC" + space, "OI" + space, "NC" + space)
    return lax.conv_general_dilated(
        x, w, (1,) * (w.ndim - 2), padding, dimension_numbers=numbers
    )


def rows_for(shape, reps):
    batch, cin, spatial, cout, kernel, padding = shape
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((batch, cin, *spatial)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((cout, cin, *kernel)) * 0.1, jnp.float32)
    qw = qa.quantize(w.reshape(cout, -1))
    q, s = qa.unpack(qw)
    conv = {"padding": padding}
    dense = jax.jit(lambda x, w: _dense(x, w, padding))
    fns = {"f32": lambda: dense(x, w)}
    variants = [(a, None) for a in ("float32", "int8")]
    variants += [("int8", st) for st in CONV_STRATEGIES if st != "dequantized"]
    for activations, strategy in variants:
        prim = ConvQ(
            jax.typeof(x),
            jax.typeof(qw),
            kernel,
            padding=padding,
            activations=activations,
        )
        if strategy is None:
            f = jax.jit(
                lambda x, q, s, a=activations: qa.conv_q(
                    x, qa.pack(q, s), kernel, activations=a, **conv
                )
            )
        else:
            f = jax.jit(lambda x, q, s, p=prim, st=strategy: p.forward(x, q, s, st))
        fns[(activations, strategy)] = lambda f=f: f(x, q, s)

    # a training step's gradient: float32 weights, quantized every call
    def loss_f32(x, w):
        return jnp.sum(jnp.tanh(_dense(x, w, padding)))

    def loss_q(x, w):
        y = qa.conv_q(x, qa.quantize(w.reshape(cout, -1)), kernel, **conv)
        return jnp.sum(jnp.tanh(y))

    grad_f32 = jax.jit(jax.grad(loss_f32, (0, 1)))
    grad_q = jax.jit(jax.grad(loss_q, (0, 1)))
    fns["grad f32"] = lambda: grad_f32(x, w)
    fns["grad q"] = lambda: grad_q(x, w)

    heavy = batch * cin * cout * int(np.prod(spatial)) * int(np.prod(kernel)) > 2**28
    times = interleaved(fns, reps=max(5, reps // 3) if heavy else reps)
    shown = (batch, cin, *spatial, cout, *kernel)
    rows = []
    for activations, strategy in variants:
        label = "weight-only" if activations == "float32" else "W8A8"
        if activations == "float32":
            default = "dequantized"
        else:  # what conv_q picks here (ConvQ._kernel_pays)
            prim = ConvQ(jax.typeof(x), jax.typeof(qw), kernel, padding=padding,
                         activations=activations)  # fmt: skip
            default = "kernel" if prim._kernel_pays(x) else "float_sums"
        how = strategy or default
        forced = "" if strategy is None else ", forced"
        targets = {} if strategy else TARGETS.get((batch, cin, spatial), {})
        rows.append(
            {
                "row": f"{label} conv_q {kernel} ({how}{forced})",
                "shape": shown,
                "baseline": "jitted f32 lax.conv_general_dilated",
                "ratio": times["f32"] / times[(activations, strategy)],
                "target": targets.get(activations),
                "unit": "x faster",
                "ms": 1e3 * times[(activations, strategy)],
                "baseline_ms": 1e3 * times["f32"],
            }
        )
    rows.append(
        {
            "row": f"grad of conv_q {kernel}, float32 weights quantized per call",
            "shape": shown,
            "baseline": "jax.grad of the same layer in float32",
            "ratio": times["grad f32"] / times["grad q"],
            "target": None,
            "unit": "x faster",
            "ms": 1e3 * times["grad q"],
            "baseline_ms": 1e3 * times["grad f32"],
        }
    )
    return rows


def run(reps=21, shapes=SHAPES):
    return [row for shape in shapes for row in rows_for(shape, reps)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for row in run(5 if args.quick else 21):
        print(
            f"{row['row']:<66} {row['shape']!s:<26} {row['ratio']:6.2f}x "
            f"({row['ms']:.3f} ms vs {row['baseline_ms']:.3f} ms)"
        )
