"""conv_q against jitted float32 ``lax.conv_general_dilated`` (suite ``conv``).

    .venv/bin/python -m benchmarks.bench_conv [--quick] [--served]

Shapes from the models people serve: a CNN surrogate's 3x3 layers on a 64x64
and a 32x32 field, one field at a time and in a batch, and PointNet's
kernel-1 Conv1d. Conv weights are small (kilobytes), so the activations set
the memory traffic and the rows are hot. Each formulation in
``qarray._conv.CONV_STRATEGIES`` gets a forced row, which is what conv_q's
default is set from; a training-step row times ``jax.grad`` of a loss through
one layer with float32 weights quantized every call (straight-through).
The CNN surrogate example's served step closes the suite
(``--served``: those rows only).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qarray as qa
from benchmarks._timing import interleaved
from benchmarks.bench_kernels import isa_of
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
                "isa": isa_of(how),
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


def served_cnn_rows(reps, batch=16, fields=8):
    """The CNN surrogate example (examples/cnn_surrogate) served in-process:
    its ModelTesseract (weight-only as shipped, and with int8 activations)
    against the float32 surrogate behind tesseract-core's jax_apply /
    jax_vjp (the stock Tesseract of the same model, default settings). A
    step is an apply and the VJP of its output wrt log_k, a new batch of
    fields each time (an inverse problem's loop), through the endpoints'
    Python functions."""
    import equinox as eqx
    from tesseract_core.runtime import jax_recipes

    from qarray.checkpoint import load_tree
    from qarray.tesseract import ModelTesseract

    example = Path(__file__).resolve().parents[1] / "examples" / "cnn_surrogate"
    sys.path.insert(0, str(example))  # its tesseract_api imports heat_surrogate
    from heat_surrogate import GRID, Surrogate

    # its own module name: the top-level tesseract_api may be loaded already
    spec = importlib.util.spec_from_file_location(
        "cnn_surrogate_api", example / "tesseract_api.py"
    )
    api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api)

    model_file = example / "surrogate.safetensors"
    skeleton = Surrogate(jax.random.key(0))
    ours = {
        "float32": api.TESSERACT,
        "int8": ModelTesseract(
            skeleton, api.forward, model_file=model_file, activations="int8"
        ),
    }
    dense = load_tree(model_file, skeleton)
    dense_jit = eqx.filter_jit(lambda inputs: api.forward(dense, inputs))
    rng = np.random.default_rng(0)
    requests = itertools.cycle(
        [
            api.InputSchema(log_k=rng.standard_normal((batch, GRID, GRID)).astype("f"))
            for _ in range(fields)
        ]
    )
    cotangent = {"u": np.ones((batch, GRID, GRID), np.float32)}

    def step(apply, vjp):
        inputs = next(requests)
        apply(inputs)
        return vjp(inputs, {"log_k"}, {"u"}, cotangent)

    fns = {
        "f32": lambda: step(
            lambda i: jax_recipes.jax_apply(dense_jit, i),
            lambda *a: jax_recipes.jax_vjp(dense_jit, *a),
        ),
    }
    for activations, tess in ours.items():
        fns[activations] = lambda t=tess: step(t.apply, t.vector_jacobian_product)
    times = interleaved(fns, reps=reps)
    return [
        {
            "row": "CNN surrogate served step, apply + vjp wrt log_k "
            f"({'weight-only, as shipped' if activations == 'float32' else 'W8A8'})",
            "shape": (batch, 1, GRID, GRID),
            "baseline": "float32 surrogate, tesseract-core's jax_apply + jax_vjp",
            "ratio": times["f32"] / times[activations],
            # the target: the example as it ships
            "target": 1.0 if activations == "float32" else None,
            "unit": "x faster",
            "ms": 1e3 * times[activations],
            "baseline_ms": 1e3 * times["f32"],
        }
        for activations in ours
    ]


def run(reps=21, shapes=SHAPES):
    rows = [row for shape in shapes for row in rows_for(shape, reps)]
    return rows + served_cnn_rows(max(5, reps // 2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--served", action="store_true", help="the served rows only")
    args = parser.parse_args()
    for row in run(5 if args.quick else 21, shapes=[] if args.served else SHAPES):
        print(
            f"{row['row']:<66} {row['shape']!s:<26} {row['ratio']:6.2f}x "
            f"({row['ms']:.3f} ms vs {row['baseline_ms']:.3f} ms)"
        )
