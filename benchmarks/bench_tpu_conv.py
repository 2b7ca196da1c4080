"""conv_q on an accelerator, device time inside one program: ratios to the
float32 and bf16 convolutions in the same run (issue "TPU kernels": conv_q
where its GEMM maps onto the chip's int8 path).

    python -m benchmarks.bench_tpu_conv [--calls 50] [--repeats 5]
        [--out FILE.json] [--quick]

As ``benchmarks.bench_tpu``: each row times ``--calls`` dependent
convolutions in one jitted ``fori_loop`` (``device_ms``: the output, as many
channels as the input, is the next input), the median of ``--repeats``
programs. Rows, for x (B, C, *spatial) and weights (C, C, *kernel):

- ``f32``, ``bf16``: ``lax.conv_general_dilated`` dense, the baselines (bf16
  operands summing in float32);
- ``int8_conv``: a raw int8 x int8 -> int32 convolution (XLA alone, no
  scales);
- ``conv_q``: weight-only on float32 x (the int8 weights converted in the
  program, the default precision);
- ``conv_q_w8a8``: int8 activations at conv_q's default (``_conv.ConvQ``'s
  choice for this backend), and the same forced to each of
  ``float_sums`` and ``int8_conv`` (``_conv.CONV_STRATEGIES``).

``--quick`` runs one small shape (a check that every row runs, on any
backend).
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qarray as qa
from benchmarks.bench_tpu import device_ms
from qarray._conv import ConvQ

# (batch, channels, spatial, kernel): a CNN surrogate's 3x3 layer on a 64x64
# field, a ResNet stage's 3x3 layer, a PointNet-style kernel-1 Conv1d
SHAPES = [
    (8, 32, (64, 64), (3, 3)),
    (16, 256, (28, 28), (3, 3)),
    (8, 128, (1024,), (1,)),
]
QUICK = [(2, 16, (12, 12), (3, 3))]


def _numbers(nsp: int):
    space = "DHW"[3 - nsp :]
    return ("NC" + space, "OI" + space, "NC" + space)


def _dense(x, w, preferred=None):
    """SAME padding, stride 1: the output keeps x's shape."""
    nsp = w.ndim - 2
    return lax.conv_general_dilated(
        x,
        w,
        (1,) * nsp,
        "SAME",
        dimension_numbers=_numbers(nsp),
        preferred_element_type=preferred,
    )


def products(kernel) -> dict[str, tuple[str, object]]:
    """name -> (x's dtype, fn(x, w) -> y with x's shape)."""

    def conv_q(activations, strategy=None):
        def fn(x, w):
            qw = qa.pack(*w["q8"])
            if strategy is None:
                return qa.conv_q(x, qw, kernel, padding="SAME", activations=activations)
            prim = ConvQ(
                jax.typeof(x),
                jax.typeof(qw),
                kernel,
                padding="SAME",
                activations=activations,
            )
            return prim.forward(x, *w["q8"], strategy)

        return fn

    return {
        "f32": ("float32", lambda x, w: _dense(x, w["f32"])),
        "bf16": ("bfloat16", lambda x, w: _dense(x, w["bf16"], jnp.float32)),
        "int8_conv": ("int8", lambda x, w: _dense(x, w["int8"], jnp.int32)),
        "conv_q": ("float32", conv_q("float32")),
        "conv_q_w8a8": ("float32", conv_q("int8")),
        "conv_q_w8a8_float_sums": ("float32", conv_q("int8", "float_sums")),
        "conv_q_w8a8_int8_conv": ("float32", conv_q("int8", "int8_conv")),
    }


def run(shapes, calls: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    results = []
    for batch, channels, spatial, kernel in shapes:
        terms = channels * math.prod(kernel)  # summed per output
        w = rng.standard_normal((channels, channels, *kernel)) / np.sqrt(terms)
        w = jnp.asarray(w, jnp.float32)
        weights = {
            "f32": w,
            "bf16": w.astype(jnp.bfloat16),
            "int8": jnp.asarray(rng.integers(-127, 128, w.shape), jnp.int8),
            "q8": qa.unpack(qa.quantize(w.reshape(channels, -1))),
        }
        x = rng.standard_normal((batch, channels, *spatial)).astype(np.float32)
        row = {"shape": [batch, channels, list(spatial), list(kernel)], "ms": {}}
        for name, (dtype, fn) in products(kernel).items():
            x0 = jnp.asarray(x if dtype != "int8" else np.clip(x * 30, -127, 127))
            x0 = x0.astype(jnp.dtype(dtype))
            try:  # k=1: the weights keep y at x's scale from call to call
                row["ms"][name] = device_ms(fn, x0, weights, 1, calls, repeats)
            except Exception as e:  # a row XLA refuses to compile: recorded
                row.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:300]
        for base in ("f32", "bf16"):
            row[f"vs_{base}"] = {n: row["ms"][base] / t for n, t in row["ms"].items()}
        results.append(row)
        ratios = "  ".join(f"{n} {r:.2f}x" for n, r in row["vs_bf16"].items())
        print(f"{row['shape']}: bf16 {row['ms']['bf16']:.3f} ms; vs bf16: {ratios}")
    device = jax.devices()[0]
    return {
        "device": str(device),
        "device_kind": getattr(device, "device_kind", device.platform),
        "jax": jax.__version__,
        "calls": calls,
        "repeats": repeats,
        "rows": results,
        "ratio": "baseline ms / row ms (higher is faster)",
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true", help="one small shape")
    args = parser.parse_args(argv)
    shapes = SHAPES
    if args.quick:
        shapes, args.calls, args.repeats = QUICK, 2, 1
    report = run(shapes, args.calls, args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
