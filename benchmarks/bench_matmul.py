"""matmul_q and quantize against dense float32, side by side (XLA:CPU)."""

import jax
import jax.numpy as jnp
import numpy as np

import qarray as qa
from benchmarks._timing import interleaved
from qarray import _kernels

MATMUL_SHAPES = [
    (1, 4096, 4096),
    (8, 4096, 4096),
    (64, 4096, 4096),
    (1, 1024, 1024),
    (64, 1024, 1024),
    (512, 1024, 1024),
]
# (activations, shape) -> target ratio to jitted dense f32 x @ w
TARGETS = {
    ("float32", (1, 4096, 4096)): 1.25,
    ("float32", (64, 1024, 1024)): 1.3,
    ("float32", (512, 1024, 1024)): 1.3,
    ("int8", (1, 4096, 4096)): 1.25,
    ("int8", (64, 1024, 1024)): 2.0,
    ("int8", (512, 1024, 1024)): 2.0,
}
FLOOR = 1.0  # any path, any shape measured


def _data(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    return x, w


def matmul_rows(reps):
    dense = jax.jit(lambda x, w: x @ w)
    quantized = jax.jit(qa.matmul_q, static_argnums=2)
    rows = []
    for m, k, n in MATMUL_SHAPES:
        x, w = _data(m, k, n)
        qw = qa.quantize(w)
        jax.block_until_ready(qa.unpack(qw))
        times = interleaved(
            {
                "dense": lambda x=x, w=w: dense(x, w),
                "float32": lambda x=x, qw=qw: quantized(x, qw, "float32"),
                "int8": lambda x=x, qw=qw: quantized(x, qw, "int8"),
            },
            reps=reps if m * k * n < 2**28 else max(5, reps // 3),
        )
        for activations in ("float32", "int8"):
            target = TARGETS.get((activations, (m, k, n)), FLOOR)
            label = "weight-only" if activations == "float32" else "int8 activations"
            strategy = _kernels.choose_strategy(m, k, n, activations, "cpu")
            rows.append(
                {
                    "row": f"{label} matmul_q ({strategy})",
                    "shape": (m, k, n),
                    "baseline": "jitted dense f32 x @ w",
                    "ratio": times["dense"] / times[activations],
                    "target": target,
                    "unit": "x faster",
                    "ms": 1e3 * times[activations],
                    "baseline_ms": 1e3 * times["dense"],
                }
            )
    return rows


def grad_row(reps, shape=(512, 1024, 1024)):
    """Straight-through forward + backward (grad wrt x and w) vs dense."""
    m, k, n = shape
    x, w = _data(m, k, n)
    g = jnp.asarray(np.random.default_rng(1).standard_normal((m, n)), jnp.float32)
    dense = jax.jit(jax.grad(lambda x, w: jnp.sum((x @ w) * g), (0, 1)))
    ste = jax.jit(
        jax.grad(lambda x, w: jnp.sum(qa.matmul_q(x, qa.quantize(w)) * g), (0, 1))
    )
    times = interleaved({"dense": lambda: dense(x, w), "ste": lambda: ste(x, w)}, reps)
    return {
        "row": "straight-through fwd + bwd (grad wrt x and w)",
        "shape": shape,
        "baseline": "jitted dense f32 fwd + bwd",
        "ratio": times["dense"] / times["ste"],
        "target": 1.0,
        "unit": "x faster",
        "ms": 1e3 * times["ste"],
        "baseline_ms": 1e3 * times["dense"],
    }


def quantize_row(reps, shape=(4096, 4096)):
    x = jnp.asarray(np.random.default_rng(2).standard_normal(shape), jnp.float32)
    quantize = jax.jit(qa.quantize)
    scale2 = jax.jit(lambda x: x * 2.0)  # one read + one write of f32: bandwidth
    # a QArray is not a pytree: block on its parts
    times = interleaved(
        {"quantize": lambda: qa.unpack(quantize(x)), "x*2": lambda: scale2(x)}, reps
    )
    gbs = x.nbytes / times["quantize"] / 1e9
    floor = x.nbytes / times["x*2"] / 1e9
    return {
        "row": "quantize throughput (GB/s of f32 input)",
        "shape": shape,
        "baseline": f"absolute; x * 2 (one f32 read + write) runs at {floor:.1f} GB/s",
        "ratio": gbs,
        "target": 20.0,
        "unit": "GB/s",
        "ms": 1e3 * times["quantize"],
        "baseline_ms": 1e3 * times["x*2"],
    }


def _temp_bytes(fn, *args):
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return analysis.temp_size_in_bytes if analysis is not None else float("nan")


def memory_row(shape=(1, 4096, 4096)):
    """Peak scratch memory of the compiled weight-only matmul (XLA's own count)."""
    m, k, n = shape
    x, w = _data(m, k, n)
    qw = qa.quantize(w)
    ours = _temp_bytes(qa.matmul_q, x, qw)
    naive = _temp_bytes(lambda x, qw: x @ qa.dequantize(qw), x, qw)
    f32_weights = k * n * 4
    return {
        "row": "peak extra memory, weight-only matmul_q (MB of scratch)",
        "shape": shape,
        "baseline": f"f32 weights {f32_weights / 2**20:.0f} MB; x @ dequantize(qw) "
        f"needs {naive / 2**20:.1f} MB",
        "ratio": ours / 2**20,
        "target": f32_weights / 2**20,
        "unit": "MB (must stay below the f32 weights)",
        "lower_is_better": True,
    }


def error_rows(k=4096, n=4096):
    """Relative error vs the dense float64 product, Gaussian data, K = 4096."""
    rows = []
    rng = np.random.default_rng(3)
    w = rng.standard_normal((k, n)).astype(np.float32)
    qw = qa.quantize(jnp.asarray(w))
    for activations, target in (("float32", 9.0e-3), ("int8", 1.25e-2)):
        worst, where = 0.0, None
        for m in (1, 8, 64, 512):  # every CPU strategy
            x = rng.standard_normal((m, k)).astype(np.float32)
            exact = x.astype(np.float64) @ w.astype(np.float64)
            y = np.asarray(qa.matmul_q(jnp.asarray(x), qw, activations), np.float64)
            err = np.linalg.norm(y - exact) / np.linalg.norm(exact)
            if err > worst:
                worst, where = err, m
        label = "weight-only" if activations == "float32" else "int8 activations"
        rows.append(
            {
                "row": f"relative error, {label}, Gaussian, K = {k}",
                "shape": (where, k, n),
                "baseline": "dense float64 x @ w; worst over M in 1, 8, 64, 512",
                "ratio": worst,
                "target": target,
                "unit": "relative error",
                "lower_is_better": True,
            }
        )
    return rows


def run(reps=15):
    return [
        *matmul_rows(reps),
        grad_row(reps),
        quantize_row(reps),
        memory_row(),
        *error_rows(),
    ]
