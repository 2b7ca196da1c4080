"""The products on an accelerator, device time inside one program: ratios to
bf16 and float32 in the same run (issue "TPU kernels").

    python -m benchmarks.bench_tpu [--k 8192 --n 8192] [--rows 1,8,64,512,4096]
        [--calls 50] [--repeats 5] [--out FILE.json] [--quick]

A call from Python costs about half a millisecond on a TPU host whatever it
does, so each row times ``--calls`` dependent products in one jitted
``lax.fori_loop`` (each product's whole output feeds the next x: XLA slices
away what is unused) and reports the median of ``--repeats`` such programs,
per product. The weights stay in device memory (HBM), read once a product.
Rows, for x (m, K) and weights W (N, K):

- ``bf16``, ``f32``: ``x @ W.T`` dense, the baselines (every ratio is the
  baseline's time / the row's: higher is faster);
- ``int8_dot``: a raw int8 x int8 -> int32 dot (XLA alone, no scales);
- ``xla_int8_convert`` / ``xla_int4_convert``: bf16 x with int8 / ``jnp.int4``
  weights converted to bf16 inside the program (XLA's own fusion);
- ``xla_int8_mixed``: bf16 x and qarray's int8 weights as they are in one
  ``dot_general`` (mixed dtypes: JAX converts both inside it, as qwix's
  weight-only product does), the scales after: qwix's form as qarray's
  (measured level with the other XLA forms, under the vector kernel at one
  row: docs/accelerators.md);
- ``int4_dot``: ``jnp.int4`` x ``jnp.int4`` -> int32 (on a TPU only);
- ``linear_q``, ``linear_q_w8a8``, ``linear_q_int4``: qarray's products on
  float32 x (weight-only, int8 activations, int4 G=128 weight-only) at the
  default precision; the same with ``_bf16``: on bf16 x, as a bf16 model
  calls them and as the bf16 baseline and qwix read x (half float32's bytes);
- ``xla_int4_packed``: bf16 x with qarray's packed int4 weights read as
  ``jnp.int4`` (a bitcast, low nibble first as qarray packs), their group
  scales applied in float32 and rounded once to bf16 inside the program
  (``_numerics.dequantize_groups_bf16``): whether XLA fuses qarray's own
  layout as it does ``jnp.int4`` (``xla_int4_convert``); ``linear_q``'s
  int4_bf16, which a TPU takes past its kernels' rows;
- ``pallas_int8``, ``pallas_w8a8``, ``pallas_int4``: qarray's Pallas kernels
  (``qarray/_tpu``) called directly with their default blocks: int8 weights
  with x in bf16 parts, with x as one int8 part, int4 G=128 weights;
- ``qwix_int8``, ``qwix_w8a8``, ``qwix_int4``: qwix's quantized ``dot_general``
  on bf16 x (int8 per-channel weights, with x quantized per row, int4 with
  128-entry tiles): the peer made for this chip (rows left out where qwix
  is not installed);
- ``vjp_x``: the VJP's product for x (``y_bar @ W``, qarray's ``matmul_q`` on
  the same int8 weights); ``vjp_x_int4``: the same through ``linear_q``'s
  pullback on the int4 weights.

``--quick`` runs small shapes (a check that every row runs, on any backend).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qarray as qa
from qarray import _tpu
from qarray._numerics import dequantize_groups_bf16

ROWS = (1, 8, 64, 512, 4096)
GROUP = 128
# rows XLA compiles only for a TPU (XLA:CPU refuses an int4 x int4 dot)
TPU_ONLY = ("int4_dot",)
# Pallas' interpreter off the chip (the --quick check on CPU)
INTERPRET = jax.default_backend() != "tpu"


def weights(k: int, n: int) -> dict:
    """Every form of one (N, K) weight matrix the rows read, on the device."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32) / np.sqrt(k)
    q8 = qa.quantize(w)
    q4 = qa.quantize(w, bits=4, group_size=min(GROUP, k))
    int8 = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
    return {
        "bf16": w.astype(jnp.bfloat16),
        "f32": w,
        "int8": int8,
        "int4": jnp.clip(int8 // 16, -8, 7).astype(jnp.int4),
        "q8": qa.unpack(q8),
        "q4": qa.unpack(q4),
        **_qwix_weights(w),
    }


def _qarray_products(group: int) -> dict[str, Callable]:
    """qarray's linear_q rows: weight-only, W8A8, int4 G=``group``."""
    return {
        "linear_q": lambda x, w: qa.linear_q(x, qa.pack(*w["q8"])),
        "linear_q_w8a8": lambda x, w: qa.linear_q(x, qa.pack(*w["q8"]), "int8"),
        "linear_q_int4": lambda x, w: qa.linear_q(x, qa.pack(*w["q4"], 4, group)),
    }


def _int4_x_cotangent(y_bar, w, group: int):
    """linear_q's pullback for x on the int4 weights (N, K): y_bar (m, N) @ W
    (the forward's output unused, so the program keeps only the pullback)."""
    q = qa.pack(*w["q4"], 4, group)
    x = jnp.zeros((y_bar.shape[0], q.shape[1]), y_bar.dtype)
    _, pullback = jax.vjp(lambda x: qa.linear_q(x, q), x)
    return pullback(y_bar)[0]


def _nt(a, b, out=None):
    """a (m, K) . b (N, K) over K."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=out)


def products(k: int, n: int) -> dict[str, tuple[str, Callable]]:
    """name -> (x's dtype, fn(x, w) -> (m, N)) for each row."""
    group = min(GROUP, k)
    return {
        "bf16": ("bfloat16", lambda x, w: _nt(x, w["bf16"], jnp.float32)),
        "f32": ("float32", lambda x, w: _nt(x, w["f32"])),
        "int8_dot": ("int8", lambda x, w: _nt(x, w["int8"], jnp.int32)),
        "xla_int8_convert": (
            "bfloat16",
            lambda x, w: _nt(x, w["int8"].astype(jnp.bfloat16), jnp.float32),
        ),
        "xla_int4_convert": (
            "bfloat16",
            lambda x, w: _nt(x, w["int4"].astype(jnp.bfloat16), jnp.float32),
        ),
        "xla_int8_mixed": (
            "bfloat16",
            lambda x, w: _nt(x, w["q8"][0], jnp.float32) * w["q8"][1],
        ),
        "int4_dot": ("int4", lambda x, w: _nt(x, w["int4"], jnp.int32)),
        # qarray's products, on float32 x and on bf16 x
        **{
            name + suffix: (dtype, product)
            for suffix, dtype in (("", "float32"), ("_bf16", "bfloat16"))
            for name, product in _qarray_products(group).items()
        },
        "xla_int4_packed": (
            "bfloat16",
            lambda x, w: _nt(x, dequantize_groups_bf16(*w["q4"]), jnp.float32),
        ),
        # qarray's Pallas kernels (qarray/_tpu), called directly
        "pallas_int8": (
            "float32",
            lambda x, w: _tpu.int8_product(x, *w["q8"], nk=True, interpret=INTERPRET),
        ),
        "pallas_w8a8": (
            "float32",
            lambda x, w: _tpu.int8_product(
                x, *w["q8"], nk=True, mxu="int8", parts=1, interpret=INTERPRET
            ),
        ),
        "pallas_int4": (
            "float32",
            lambda x, w: _tpu.int4_product(
                x, *w["q4"], group_size=group, interpret=INTERPRET
            ),
        ),
        # the VJP's product for x: y_bar (m, N) @ W (N, K), on (N, K) weights
        # read as matmul_q's (k, n) = (N, K); with K == N the loop keeps shape
        "vjp_x": ("float32", lambda x, w: qa.matmul_q(x, qa.pack(*w["q8"]))),
        "vjp_x_int4": ("float32", lambda x, w: _int4_x_cotangent(x, w, group)),
        **_qwix_products(),
    }


def _qwix_products() -> dict[str, tuple[str, Callable]]:
    """qwix's quantized dots on bf16 x (none where qwix is not installed)."""
    try:
        import qwix
    except ImportError:
        return {}
    dims = (((1,), (1,)), ((), ()))

    def per_row(x):
        return qwix.quantize(x, jnp.int8, channelwise_axes=[0])

    return {
        "qwix_int8": ("bfloat16", lambda x, w: qwix.dot_general(x, w["qwix8"], dims)),
        "qwix_w8a8": (
            "bfloat16",
            lambda x, w: qwix.dot_general(per_row(x), w["qwix8"], dims),
        ),
        "qwix_int4": ("bfloat16", lambda x, w: qwix.dot_general(x, w["qwix4"], dims)),
    }


def _qwix_weights(w) -> dict:
    """The weights as qwix's QArrays (bf16 scales, as its users' models)."""
    try:
        import qwix
    except ImportError:
        return {}
    w = w.astype(jnp.bfloat16)
    return {
        "qwix8": qwix.quantize(w, jnp.int8, channelwise_axes=[0]),
        "qwix4": qwix.quantize(
            w, jnp.int4, channelwise_axes=[0], tiled_axes={1: min(GROUP, w.shape[1])}
        ),
    }


def _next_x(y, dtype, k: int):
    """The next x from the whole of y (m, N), in x's dtype, kept in range."""
    if jnp.issubdtype(dtype, jnp.integer):
        return (y % 7 - 3).astype(dtype)
    return (y.astype(jnp.float32) * (1.0 / np.sqrt(k))).astype(dtype)


def device_ms(fn, x0, w, k: int, calls: int, repeats: int) -> float:
    """Median ms per product over ``repeats`` programs of ``calls`` dependent
    products each (one dispatch per program)."""

    @jax.jit
    def program(x, w):
        body = lambda _, x: _next_x(fn(x, w), x.dtype, k)  # noqa: E731
        return lax.fori_loop(0, calls, body, x)

    program(x0, w).block_until_ready()  # compile, and warm the weights
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        program(x0, w).block_until_ready()
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return statistics.median(times)


def run(k: int, n: int, rows, calls: int, repeats: int) -> dict:
    if k != n:
        raise SystemExit("bench_tpu: the loop feeds y back as x: --k must equal --n")
    w = weights(k, n)
    rng = np.random.default_rng(1)
    results = []
    for m in rows:
        x = rng.standard_normal((m, k)).astype(np.float32)
        row = {"m": m, "ms": {}}
        for name, (dtype, fn) in products(k, n).items():
            if name in TPU_ONLY and jax.default_backend() != "tpu":
                continue
            if name.startswith("pallas_") and not (INTERPRET or _tpu.available()):
                continue  # a chip whose libtpu refuses the kernels: tpu_kernels_host
            x0 = jnp.asarray(x if dtype != "int8" else np.clip(x * 30, -127, 127))
            x0 = x0.astype(jnp.dtype(dtype))
            row["ms"][name] = device_ms(fn, x0, w, k, calls, repeats)
        for base in ("bf16", "f32"):
            row[f"vs_{base}"] = {
                name: row["ms"][base] / ms for name, ms in row["ms"].items()
            }
        results.append(row)
        print(_line(row), flush=True)
    device = jax.devices()[0]
    return {
        "device": str(device),
        "device_kind": getattr(device, "device_kind", device.platform),
        "platform": device.platform,
        "jax": jax.__version__,
        "k": k,
        "n": n,
        "calls": calls,
        "repeats": repeats,
        "rows": results,
        "ratio": "baseline ms / row ms (higher is faster)",
    }


def _line(row) -> str:
    ratios = "  ".join(f"{k} {v:.2f}x" for k, v in row["vs_bf16"].items())
    return f"m={row['m']}: bf16 {row['ms']['bf16']:.3f} ms; vs bf16: {ratios}"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="small shapes")
    args = parser.parse_args(argv)
    if args.quick:
        args.k = args.n = 256
        args.rows, args.calls, args.repeats = "1,8", 3, 2
    rows = [int(r) for r in args.rows.split(",")]
    report = run(args.k, args.n, rows, args.calls, args.repeats)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
