"""The int8 products as users run them, against jitted float32, weights cold
and hot (suite ``kernels``).

    .venv/bin/python -m benchmarks.bench_kernels [--quick] [--strategies]
    QARRAY_CPU_ISA=avx2 .venv/bin/python -m benchmarks.bench_kernels --isa-table

Cold: a many-layer model reads its weights from memory, not from cache: each
call takes the next of several distinct copies of the weights, together more
than twice the last-level cache (for both sides: the float32 baseline rotates
its own copies). Hot: the same weights every call. Ours is the primitive under
``jax.jit`` with the payload and scales as arguments (what ``qarray.nn`` and
the Tesseract run); the baseline is the faster float32 spelling for the layout
(``x @ w`` for (K, N); for (N, K) the faster of ``x @ w.T`` and
``(w @ x.T).T``). ``--strategies`` adds a row per formulation (the kernel and
the XLA ones), which is what ``_formulations.choose_strategy`` is set from. Every
row names the instruction set its product ran on (``isa``: avx512, avx2,
i8mm, dotprod for the kernel, ``xla`` for XLA's formulations).

``--isa-table``: issue 37's targets, each problem as the kernel (on the
instruction set ``QARRAY_CPU_ISA`` forces, or the CPU's best), as XLA's
formulation (what qarray runs without kernels) and as jitted float32, the
three interleaved in one run, weights cold; a Markdown table.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

import qarray as qa
from benchmarks._timing import interleaved
from benchmarks.peer_shapes import last_level_cache_bytes
from qarray import _ffi, _formulations, _numerics
from qarray._conv import ConvQ

SHAPES = [
    (1, 4096, 4096),
    (8, 4096, 4096),
    (16, 4096, 4096),
    (64, 4096, 4096),
    (1, 1024, 1024),
    (16, 1024, 1024),
    (64, 1024, 1024),
    (512, 1024, 1024),
]
# (activations, shape) -> target ratio to float32, weights cold (issue 18)
TARGETS = {
    ("float32", (1, 4096, 4096)): 3.0,
    ("int8", (1, 4096, 4096)): 3.5,
    ("float32", (1, 1024, 1024)): 2.5,
    ("int8", (1, 1024, 1024)): 2.5,
    ("float32", (16, 4096, 4096)): 2.0,
    ("int8", (16, 4096, 4096)): 3.0,
}
FLOORS = {"float32": 1.2, "int8": 2.0}  # every other shape, cold


def copies_beyond_cache(nbytes: int) -> int:
    """Distinct copies of ``nbytes`` that together pass twice the cache."""
    return max(2, -(-2 * last_level_cache_bytes() // max(nbytes, 1)) + 1)


def rotating(items):
    """A zero-argument function returning the next item, round and round."""
    cycle = itertools.cycle(items)
    return lambda: next(cycle)


def _product(layout):
    op = qa.matmul_q if layout == "kn" else qa.linear_q
    return lambda x, q, s, activations, strategy: _strategy_call(
        op, x, q, s, activations, strategy
    )


def _strategy_call(op, x, q, s, activations, strategy):
    if strategy is None:
        return op(x, qa.pack(q, s), activations)
    fn = _formulations.matmul if op is qa.matmul_q else _formulations.linear
    return fn(x, q, s, activations, strategy)


def rows_for(layout, shape, reps, cold, strategies=False):
    m, k, n = shape
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    stored = (k, n) if layout == "kn" else (n, k)
    w = rng.standard_normal(stored).astype(np.float32)
    q, s = (jnp.asarray(a) for a in jax.block_until_ready(qa.unpack(qa.quantize(w))))
    count_q = copies_beyond_cache(q.nbytes) if cold else 1
    count_w = copies_beyond_cache(w.nbytes) if cold else 1
    qs = [(q + 0, s + 0) for _ in range(count_q)]  # distinct buffers
    ws = [jnp.asarray(w) + 0 for _ in range(count_w)]
    next_q, next_w = rotating(qs), rotating(ws)
    if layout == "kn":
        spellings = {"x @ w": jax.jit(lambda x, w: x @ w)}
    else:
        spellings = {
            "x @ w.T": jax.jit(lambda x, w: x @ w.T),
            "(w @ x.T).T": jax.jit(lambda x, w: (w @ x.T).T),
        }
    ours = jax.jit(_product(layout), static_argnums=(3, 4))
    # the faster spelling is chosen first, alone: timed next to ours, the
    # slower one (x @ w.T at one row copies w transposed) would flush the
    # caches ours then runs in
    if len(spellings) > 1:
        trial = {name: (lambda f=f: f(x, next_w())) for name, f in spellings.items()}
        trial_times = interleaved(trial, reps=3)
        fastest = min(trial_times, key=trial_times.get)
        spellings = {fastest: spellings[fastest]}
    fns = {name: (lambda f=f: f(x, next_w())) for name, f in spellings.items()}
    variants = [(a, None) for a in ("float32", "int8")]
    if strategies:
        variants += [("float32", st) for st in _formulations.WEIGHT_ONLY_STRATEGIES]
        variants += [("int8", st) for st in _formulations.INT8_STRATEGIES]
        if not _ffi.available():
            variants = [v for v in variants if v[1] != "kernel"]
        # the TPU's Pallas kernel runs only interpreted on a CPU
        variants = [v for v in variants if v[1] != "pallas"]
    for activations, strategy in variants:
        fns[(activations, strategy)] = lambda a=activations, st=strategy: ours(
            x, *next_q(), a, st
        )
    heavy = m * k * n >= 2**28
    times = interleaved(fns, reps=max(5, reps // 3) if heavy else reps)
    best = min(spellings, key=lambda name: times[name])
    rows = []
    for activations, strategy in variants:
        chosen = strategy or _formulations.choose_strategy(
            m, k, n, activations, "cpu", layout
        )
        target = None
        if strategy is None and cold:
            target = TARGETS.get((activations, shape), FLOORS[activations])
        label = "weight-only" if activations == "float32" else "W8A8"
        op = "matmul_q" if layout == "kn" else "linear_q"
        forced = "" if strategy is None else ", forced"
        rows.append(
            {
                "row": f"{label} {op} ({chosen}{forced}), weights "
                + ("cold" if cold else "hot"),
                "shape": shape,
                "baseline": f"jitted f32 {best}, weights "
                + ("cold" if cold else "hot"),
                "ratio": times[best] / times[(activations, strategy)],
                "target": target,
                "unit": "x faster",
                "ms": 1e3 * times[(activations, strategy)],
                "baseline_ms": 1e3 * times[best],
                "isa": isa_of(chosen),
            }
        )
    return rows


def isa_of(strategy: str) -> str:
    """Where a formulation runs: the kernels' instruction set, or "xla"."""
    return (_ffi.isa() or "xla") if strategy == "kernel" else "xla"


# quantize's throughput (issue 26): GB/s of float32 input, inputs cold
QUANTIZE_SHAPE, QUANTIZE_TARGET = (4096, 4096), 20.0


def quantize_rows(reps=21, shape=QUANTIZE_SHAPE):
    """``qarray.quantize`` (its CPU kernel where it runs) against the XLA
    formulation (``_numerics.quantize_rows``), each on distinct copies of the
    input beyond the cache: GB/s of float32 read, and the ratio."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    xs = rotating([x + i for i in range(copies_beyond_cache(x.nbytes))])
    ours = jax.jit(lambda x: qa.unpack(qa.quantize(x)))
    xla = jax.jit(_numerics.quantize_rows)
    times = interleaved({"ours": lambda: ours(xs()), "xla": lambda: xla(xs())}, reps)
    gbs = {k: x.nbytes / t / 1e9 for k, t in times.items()}
    return [
        {
            "row": f"quantize, GB/s of float32 input ({_ffi.status()})",
            "shape": shape,
            "baseline": "the XLA formulation (_numerics.quantize_rows): "
            f"{gbs['xla']:.1f} GB/s",
            "ratio": gbs["ours"],
            "target": QUANTIZE_TARGET,
            "unit": "GB/s",
            "ms": 1e3 * times["ours"],
            "baseline_ms": 1e3 * times["xla"],
            "isa": _ffi.isa() or "xla",
        }
    ]


def run(reps=21, strategies=False, shapes=SHAPES):
    rows = quantize_rows(reps)
    for shape in shapes:
        for layout in ("nk", "kn"):
            for cold in (True, False):
                rows += rows_for(layout, shape, reps, cold, strategies and cold)
    return rows


# issue 37's targets: (what, shape, activations) -> ratio to float32, cold
ISA_PRODUCT_SHAPES = [
    (1, 4096, 4096),
    (1, 1024, 1024),
    (16, 4096, 4096),
    (64, 4096, 4096),
    (16, 1024, 1024),
    (64, 1024, 1024),
    (512, 1024, 1024),
]
# int4's rows (issue 44's: one row is bound by memory, the others by compute)
ISA_INT4_SHAPES = [
    (1, 4096, 4096),
    (16, 4096, 4096),
    (64, 1024, 1024),
    (512, 1024, 1024),
]


def product_target(shape, activations):
    if shape[0] == 1:
        return 2.5 if shape[1] == 4096 else 2.0
    return 2.0 if activations == "int8" else 1.2


def _cold(make, nbytes):
    """A zero-argument function rotating over copies of ``make()`` beyond
    the cache."""
    return rotating([make() for _ in range(copies_beyond_cache(nbytes))])


def isa_product_row(layout, shape, activations, reps):
    m, k, n = shape
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    stored = (k, n) if layout == "kn" else (n, k)
    w = jnp.asarray(rng.standard_normal(stored), jnp.float32)
    q, s = jax.block_until_ready(qa.unpack(qa.quantize(w)))
    next_q = _cold(lambda: (q + 0, s + 0), q.nbytes)
    next_w = _cold(lambda: w + 0, w.nbytes)
    fn = _formulations.matmul if layout == "kn" else _formulations.linear
    xla = _formulations.choose_strategy(
        m, k, n, activations, "cpu", layout, kernels=False
    )
    if layout == "kn":
        f32 = jax.jit(lambda x, w: x @ w)
    else:  # the faster spelling at one row (x @ w.T copies w transposed)
        f32 = jax.jit(lambda x, w: (w @ x.T).T if m == 1 else x @ w.T)
    ours = jax.jit(lambda x, q, s, st: fn(x, q, s, activations, st), static_argnums=3)
    fns = {
        "f32": lambda: f32(x, next_w()),
        "kernel": lambda: ours(x, *next_q(), "kernel"),
        "xla": lambda: ours(x, *next_q(), xla),
    }
    heavy = m * k * n >= 2**28
    times = interleaved(fns, reps=max(5, reps // 3) if heavy else reps)
    op = "matmul_q (kn)" if layout == "kn" else "linear_q (nk)"
    label = "weight-only" if activations == "float32" else "W8A8"
    return _isa_row(
        f"{label} {op}", shape, times, xla, product_target(shape, activations)
    )


def isa_int4_row(activations, reps, shape=(1, 4096, 4096), group=128):
    m, k, n = shape
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    p, s = jax.block_until_ready(qa.unpack(qa.quantize(w, bits=4, group_size=group)))
    next_q = _cold(lambda: (p + 0, s + 0), p.nbytes)
    next_w = _cold(lambda: w + 0, w.nbytes)
    f32 = jax.jit(lambda x, w: (w @ x.T).T)
    ours = jax.jit(
        lambda x, p, s, st: _formulations.linear_int4(x, p, s, activations, st),
        static_argnums=3,
    )
    times = interleaved(
        {
            "f32": lambda: f32(x, next_w()),
            "kernel": lambda: ours(x, *next_q(), "kernel"),
            "xla": lambda: ours(x, *next_q(), "dequantize"),
        },
        reps,
    )
    label = "int4 weight-only" if activations == "float32" else "int4 W4A8"
    target = 3.0 if activations == "float32" and m == 1 else None  # issue 37's
    return _isa_row(f"{label} linear_q (G={group})", shape, times, "dequantize", target)


# the CNN surrogate's 3x3 layer (a batch of 64 x 64 fields) and PointNet's
# pointwise layer (bench_conv's rows with targets)
ISA_CONV_SHAPES = [
    (8, 32, (64, 64), 32, (3, 3), "SAME"),
    (8, 64, (1024,), 128, (1,), "VALID"),
]


def isa_conv_row(shape, activations, reps):
    batch, cin, spatial, cout, kernel, padding = shape
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((batch, cin, *spatial)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((cout, cin, *kernel)) * 0.1, jnp.float32)
    qw = qa.quantize(w.reshape(cout, -1))
    q, s = qa.unpack(qw)
    space = "DHW"[3 - w.ndim + 2 :]
    numbers = ("NC" + space, "OI" + space, "NC" + space)
    f32 = jax.jit(
        lambda x, w: jax.lax.conv_general_dilated(
            x, w, (1,) * (w.ndim - 2), padding, dimension_numbers=numbers
        )
    )
    prim = ConvQ(
        jax.typeof(x), jax.typeof(qw), kernel, padding=padding, activations=activations
    )
    ours = jax.jit(lambda x, q, s, st: prim.forward(x, q, s, st), static_argnums=3)
    # XLA's formulation without kernels: conv_q's default there
    xla = "float_sums" if activations == "int8" else "dequantized"
    times = interleaved(
        {
            "f32": lambda: f32(x, w),
            "kernel": lambda: ours(x, q, s, "kernel"),
            "xla": lambda: ours(x, q, s, xla),
        },
        reps,
    )
    label = "weight-only" if activations == "float32" else "W8A8"
    target = 1.5 if activations == "int8" else None
    shown = (batch, cin, *spatial, cout, *kernel)
    return _isa_row(f"{label} conv_q {kernel}", shown, times, xla, target)


def _isa_row(what, shape, times, xla, target):
    return {
        "row": what,
        "shape": shape,
        "isa": _ffi.isa() or "xla",
        "f32_ms": 1e3 * times["f32"],
        "kernel": times["f32"] / times["kernel"],
        "xla": times["f32"] / times["xla"],
        "xla_strategy": xla,
        "target": target,
    }


def isa_table(reps=21):
    """Issue 37's rows (see the module doc): kernel, XLA, float32 per row."""
    if not _ffi.available():
        raise SystemExit(f"the kernels do not run here: {_ffi.status()}")
    rows = []
    for shape in ISA_PRODUCT_SHAPES:
        for layout in ("nk", "kn"):
            for activations in ("float32", "int8"):
                rows.append(isa_product_row(layout, shape, activations, reps))
    for shape in ISA_INT4_SHAPES:
        for activations in ("float32", "int8"):
            rows.append(isa_int4_row(activations, reps, shape=shape))
    for shape in ISA_CONV_SHAPES:
        for activations in ("int8", "float32"):
            rows.append(isa_conv_row(shape, activations, reps))
    return rows


def print_isa_table(rows):
    isa = rows[0]["isa"] if rows else "?"
    print(
        f"| row | shape | jitted f32 ms | kernel ({isa}) | XLA formulation | target |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        target = f">= {r['target']}x" if r["target"] else ""
        met = (
            ""
            if not r["target"]
            else (" ok" if r["kernel"] >= r["target"] else " MISS")
        )
        print(
            f"| {r['row']} | {r['shape']} | {r['f32_ms']:.3f} | {r['kernel']:.2f}x |"
            f" {r['xla']:.2f}x ({r['xla_strategy']}) | {target}{met} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--strategies", action="store_true")
    parser.add_argument("--shapes", default=None, help="e.g. 1x4096x4096,64x1024x1024")
    parser.add_argument("--isa-table", action="store_true")
    args = parser.parse_args()
    if args.isa_table:
        print(f"kernels: {_ffi.status()}")
        print_isa_table(isa_table(5 if args.quick else 21))
        raise SystemExit(0)
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    print(f"kernels: {_ffi.status()}")
    for row in run(5 if args.quick else 21, args.strategies, shapes):
        print(
            f"{row['row']:<58} {row['shape']!s:<18} {row['ratio']:6.2f}x "
            f"({row['ms']:.3f} ms vs {row['baseline_ms']:.3f} ms {row['baseline']})"
            f" [{row.get('isa', '?')}]"
        )
