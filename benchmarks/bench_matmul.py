"""matmul_q, linear_q and quantize against dense float32, side by side (XLA:CPU)."""

import jax
import jax.numpy as jnp
import numpy as np

import qarray as qa
from benchmarks._timing import interleaved
from qarray import _formulations

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
# linear_q (weights stored (N, K)) at these shapes, against the same targets as
# matmul_q: the layout changes how the product runs, not what it is for
LINEAR_SHAPES = [(1, 4096, 4096), (64, 1024, 1024), (512, 1024, 1024)]


def _data(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    return x, w


def _quantized_matmul(x, qvalue, scale, activations):
    # the QArray is built inside the compiled function, from its int8 payload and
    # scales (as the Tesseract does): a QArray *argument* of jax.jit takes JAX's
    # Python dispatch path (see dispatch_rows)
    return qa.matmul_q(x, qa.pack(qvalue, scale), activations)


def matmul_rows(reps):
    dense = jax.jit(lambda x, w: x @ w)
    quantized = jax.jit(_quantized_matmul, static_argnums=3)
    rows = []
    for m, k, n in MATMUL_SHAPES:
        x, w = _data(m, k, n)
        q, s = jax.block_until_ready(qa.unpack(qa.quantize(w)))
        times = interleaved(
            {
                "dense": lambda x=x, w=w: dense(x, w),
                "float32": lambda x=x, q=q, s=s: quantized(x, q, s, "float32"),
                "int8": lambda x=x, q=q, s=s: quantized(x, q, s, "int8"),
            },
            reps=reps if m * k * n < 2**28 else max(5, reps // 3),
        )
        for activations in ("float32", "int8"):
            target = TARGETS.get((activations, (m, k, n)), FLOOR)
            label = "weight-only" if activations == "float32" else "int8 activations"
            strategy = _formulations.choose_strategy(m, k, n, activations, "cpu", "kn")
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


def _quantized_linear(x, qvalue, scale, activations):
    # as _quantized_matmul: the QArray is built inside the compiled function
    return qa.linear_q(x, qa.pack(qvalue, scale), activations)


def linear_rows(reps):
    """linear_q against dense f32 ``x @ w.T`` with the same (N, K) weights.

    The baseline is the faster of two spellings of that product, ``x @ w.T``
    and ``(w @ x.T).T``: XLA:CPU runs the first ~10x slower for a single row
    (a strided matrix-vector product), so taking it alone would flatter
    linear_q. The baseline column says which won, and by how much.
    """
    spellings = {
        "x @ w.T": jax.jit(lambda x, w: x @ w.T),
        "(w @ x.T).T": jax.jit(lambda x, w: (w @ x.T).T),
    }
    quantized = jax.jit(_quantized_linear, static_argnums=3)
    rows = []
    for m, k, n in LINEAR_SHAPES:
        x, w_kn = _data(m, k, n)
        w = jnp.asarray(w_kn.T)  # (N, K), contiguous: a PyTorch nn.Linear.weight
        q, s = jax.block_until_ready(qa.unpack(qa.quantize(w)))
        times = interleaved(
            {
                **{
                    name: lambda f=f, x=x, w=w: f(x, w) for name, f in spellings.items()
                },
                "float32": lambda x=x, q=q, s=s: quantized(x, q, s, "float32"),
                "int8": lambda x=x, q=q, s=s: quantized(x, q, s, "int8"),
            },
            reps=reps if m * k * n < 2**28 else max(5, reps // 3),
        )
        best, other = sorted(spellings, key=times.get)
        baseline = (
            f"jitted dense f32 x @ w.T, w (N, K): {best} "
            f"({times[other] / times[best]:.2f}x faster than {other})"
        )
        for activations in ("float32", "int8"):
            label = "weight-only" if activations == "float32" else "int8 activations"
            strategy = _formulations.choose_strategy(m, k, n, activations, "cpu", "nk")
            rows.append(
                {
                    "row": f"{label} linear_q ({strategy})",
                    "shape": (m, k, n),
                    "baseline": baseline,
                    "ratio": times[best] / times[activations],
                    "target": TARGETS.get((activations, (m, k, n)), FLOOR),
                    "unit": "x faster",
                    "ms": 1e3 * times[activations],
                    "baseline_ms": 1e3 * times[best],
                }
            )
    return rows


def dispatch_rows(reps, shape=(1, 1024, 1024)):
    """What passing a QArray as a jit argument costs per call, over passing its
    parts: ``jax.jit`` takes JAX's Python dispatch path for hi-typed arguments
    (a JAX limitation); ``qarray.jit`` hands the parts across instead."""
    m, k, n = shape
    x, w = _data(m, k, n)
    qw = qa.quantize(w)
    q, s = jax.block_until_ready(qa.unpack(qw))
    as_argument = jax.jit(qa.matmul_q)
    through_qarray_jit = qa.jit(qa.matmul_q)
    built_inside = jax.jit(_quantized_matmul, static_argnums=3)
    times = interleaved(
        {
            "jax.jit": lambda: as_argument(x, qw),
            "qarray.jit": lambda: through_qarray_jit(x, qw),
            "parts": lambda: built_inside(x, q, s, "float32"),
        },
        reps,
    )
    targets = {"jax.jit": None, "qarray.jit": 0.02}
    return [
        {
            "row": f"{spelling} of a QArray argument (extra ms per call)",
            "shape": shape,
            "baseline": "same matmul_q, the QArray's parts as the arguments",
            "ratio": 1e3 * (times[spelling] - times["parts"]),
            "target": target,
            "unit": "ms",
            "lower_is_better": True,
            "ms": 1e3 * times[spelling],
            "baseline_ms": 1e3 * times["parts"],
        }
        for spelling, target in targets.items()
    ]


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
    # one read of the input and nothing else: the memory-bandwidth ceiling here
    absmax = jax.jit(lambda x: jnp.max(jnp.abs(x), axis=-1))
    # a QArray is not a pytree: block on its parts
    times = interleaved(
        {"quantize": lambda: qa.unpack(quantize(x)), "absmax": lambda: absmax(x)},
        reps,
    )
    gbs = x.nbytes / times["quantize"] / 1e9
    ceiling = x.nbytes / times["absmax"] / 1e9
    return {
        "row": "quantize throughput (GB/s of f32 input)",
        "shape": shape,
        "baseline": f"absolute; one read pass (row absmax alone) runs at "
        f"{ceiling:.1f} GB/s on this machine",
        "ratio": gbs,
        "target": 20.0,
        "unit": "GB/s",
        "ms": 1e3 * times["quantize"],
        "baseline_ms": 1e3 * times["absmax"],
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


def error_rows(k=4096, n=4096, rows=512):
    """Relative error vs the dense float64 product, Gaussian data, K = 4096.

    Each CPU strategy (M = 1, 8, 64, 512) computes the same 512 rows of x, in
    calls of M rows; the error is taken over all 512 (a single row's error
    varies by a few percent with its own maximum). Reported: the worst strategy.
    Both products multiply by the same Gaussian weights, stored (K, N) for
    matmul_q and (N, K) for linear_q (per-row scales in each layout).
    """
    out = []
    rng = np.random.default_rng(3)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    products = {
        "matmul_q": (_quantized_matmul, w),
        "linear_q": (_quantized_linear, w.T),
    }
    for name, (fn, stored) in products.items():
        q, s = qa.unpack(qa.quantize(jnp.asarray(stored)))
        product = jax.jit(fn, static_argnums=3)
        for activations, target in (("float32", 9.0e-3), ("int8", 1.25e-2)):
            worst, where = 0.0, None
            for m in (1, 8, 64, 512):
                y = np.concatenate(
                    [
                        np.asarray(product(x[i : i + m], q, s, activations), np.float64)
                        for i in range(0, rows, m)
                    ]
                )
                err = np.linalg.norm(y - exact) / np.linalg.norm(exact)
                if err > worst:
                    worst, where = err, m
            label = "weight-only" if activations == "float32" else "int8 activations"
            layout = "kn" if name == "matmul_q" else "nk"
            strategy = _formulations.choose_strategy(
                where, k, n, activations, "cpu", layout
            )
            out.append(
                {
                    "row": f"relative error, {name}, {label}, Gaussian, K = {k}",
                    "shape": (where, k, n),
                    "baseline": f"dense float64 x @ w over {rows} rows; worst "
                    f"strategy ({strategy}, M = {where})",
                    "ratio": worst,
                    "target": target,
                    "unit": "relative error",
                    "lower_is_better": True,
                }
            )
    return out


def run(reps=15):
    return [
        *matmul_rows(reps),
        *linear_rows(reps),
        *dispatch_rows(reps),
        grad_row(reps),
        quantize_row(reps),
        memory_row(),
        *error_rows(),
    ]
