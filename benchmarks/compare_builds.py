"""Two builds of the CPU kernels side by side, weights hot: what a change to
the tiles does to every product, on this CPU.

    cp qarray/_cpu/libqarray_cpu.so /tmp/before.so      # before the change
    ... change qarray/_cpu/, then sh scripts/build_kernels.sh .venv/bin/python
    .venv/bin/python -m benchmarks.compare_builds /tmp/before.so \\
        qarray/_cpu/libqarray_cpu.so [--rounds 2] [--only "conv|int4"]

A process registers one build's FFI targets, so each round runs every row
once per build, in a fresh process each, the builds alternating (the
machine's speed drifts between minutes: interleaving keeps both sides under
the same drift). A row's time is the lower quartile of its calls (the noise
of a shared machine only adds time); a build's figure is its best round. The
weights stay hot, so this measures the tiles, not memory (bench_kernels'
cold rows measure that). ``QARRAY_CPU_ISA`` applies to both builds;
``--before-isa`` / ``--after-isa`` set it for one side (an ISA renamed between
the builds: the build before dc92bb0 called AVX-VNNI "avx2", after it
"avxvnni"). The library in ``qarray/_cpu/`` is restored afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qarray import _ffi

PRODUCT_SHAPES = [
    (1, 4096, 4096),
    (4, 1024, 1024),
    (8, 1024, 1024),
    (16, 4096, 4096),
    (64, 1024, 1024),
    (512, 1024, 1024),
]
KN_SHAPES = [(1, 4096, 4096), (3, 4096, 4096), (16, 4096, 4096), (64, 1024, 1024)]
INT4_SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (64, 1024, 1024), (512, 1024, 1024)]
CONV_SHAPES = [  # bench_kernels.ISA_CONV_SHAPES: the CNN 3x3 and PointNet 1x1 layers
    (8, 32, (64, 64), 32, (3, 3), "SAME"),
    (8, 64, (1024,), 128, (1,), "VALID"),
]


def _cases():
    """(name, make) for every row: make() builds the jitted call."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import qarray as qa
    from qarray import _formulations
    from qarray._conv import ConvQ

    rng = np.random.default_rng(0)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    def product(layout, shape, act):
        m, k, n = shape
        q, s = qa.unpack(qa.quantize(normal(*((k, n) if layout == "kn" else (n, k)))))
        fn = _formulations.matmul if layout == "kn" else _formulations.linear
        f = jax.jit(lambda x, q, s: fn(x, q, s, act, "kernel"))
        x = normal(m, k)
        return lambda: f(x, q, s)

    def int4(shape, act):
        m, k, n = shape
        p, s = qa.unpack(qa.quantize(normal(n, k), bits=4, group_size=128))
        f = jax.jit(lambda x, p, s: _formulations.linear_int4(x, p, s, act, "kernel"))
        x = normal(m, k)
        return lambda: f(x, p, s)

    def conv(shape, act):
        batch, cin, spatial, cout, kernel, padding = shape
        qw = qa.quantize(normal(cout, cin, *kernel, scale=0.1).reshape(cout, -1))
        q, s = qa.unpack(qw)
        x = normal(batch, cin, *spatial)
        prim = ConvQ(
            jax.typeof(x), jax.typeof(qw), kernel, padding=padding, activations=act
        )
        f = jax.jit(lambda x, q, s: prim.forward(x, q, s, "kernel"))
        return lambda: f(x, q, s)

    for act in ("int8", "float32"):
        for shape in PRODUCT_SHAPES:
            yield f"linear_q {act} {shape}", lambda s=shape, a=act: product("nk", s, a)
        for shape in KN_SHAPES:
            yield f"matmul_q {act} {shape}", lambda s=shape, a=act: product("kn", s, a)
        for shape in INT4_SHAPES:
            yield f"int4 {act} {shape}", lambda s=shape, a=act: int4(s, a)
        for shape in CONV_SHAPES:
            what = f"{shape[1]}->{shape[3]} {shape[4]}"
            yield f"conv_q {act} {what}", lambda s=shape, a=act: conv(s, a)


def _child(reps: int, only: list[str] | None) -> None:
    """This process's build: every row's lower-quartile ms, a JSON line each."""
    import jax

    for name, make in _cases():
        if only and not any(o in name for o in only):
            continue
        f = make()
        jax.block_until_ready(f())
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(f())
            times.append(time.perf_counter() - t)
        times.sort()
        row = {"row": name, "ms": 1e3 * times[len(times) // 4], "isa": _ffi.isa()}
        print(json.dumps(row), flush=True)


def _install(build: Path) -> None:
    """build as qarray/_cpu's library: a new file renamed over the old (a
    process that maps the old one keeps it)."""
    staged = _ffi.LIBRARY.with_suffix(".staged")
    shutil.copy(build, staged)
    os.replace(staged, _ffi.LIBRARY)


def compare(
    before: Path,
    after: Path,
    rounds: int,
    reps: int,
    only: str | None,
    isas: dict[str, str | None],
):
    """{row: {"before": ms, "after": ms, "isa": ...}}, each the best of its
    rounds; ``isas`` maps "before" / "after" to the QARRAY_CPU_ISA of that
    side (None: the environment's)."""
    with tempfile.TemporaryDirectory() as tmp:
        builds = {}
        for label, path in (("before", before), ("after", after)):
            builds[label] = Path(tmp) / f"{label}.so"
            shutil.copy(path, builds[label])
        kept = Path(tmp) / "kept.so"
        shutil.copy(_ffi.LIBRARY, kept)
        best: dict[str, dict[str, float]] = {}
        try:
            for _ in range(rounds):
                for label, build in builds.items():
                    _install(build)
                    args = [sys.executable, "-m", "benchmarks.compare_builds"]
                    args += ["--child", "--reps", str(reps), "--only", only or ""]
                    env = dict(os.environ)
                    if isas[label]:
                        env["QARRAY_CPU_ISA"] = isas[label]
                    out = subprocess.run(
                        args, capture_output=True, text=True, check=True, env=env
                    )
                    for line in out.stdout.splitlines():
                        row = json.loads(line)
                        sides = best.setdefault(row["row"], {})
                        sides[label] = min(sides.get(label, float("inf")), row["ms"])
                        sides[f"{label} isa"] = row["isa"]
        finally:
            _install(kept)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", nargs="?", type=Path)
    parser.add_argument("after", nargs="?", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--only", default=None, help='rows whose name has one of "a|b"')
    parser.add_argument("--before-isa", default=None, help="QARRAY_CPU_ISA before")
    parser.add_argument("--after-isa", default=None, help="QARRAY_CPU_ISA after")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    only = args.only.split("|") if args.only else None
    if args.child:
        return _child(args.reps, only)
    if not (args.before and args.after):
        parser.error("give the two builds: BEFORE.so AFTER.so")
    isas = {"before": args.before_isa, "after": args.after_isa}
    rows = compare(args.before, args.after, args.rounds, args.reps, args.only, isas)
    print("| row | isa | before ms | after ms | before / after |")
    print("|---|---|---|---|---|")
    for name, sides in rows.items():
        ratio = sides["before"] / sides["after"]
        isa = sides["before isa"]
        if sides["after isa"] != isa:
            isa = f"{isa} -> {sides['after isa']}"
        print(
            f"| {name} | {isa} | {sides['before']:.3f} | {sides['after']:.3f}"
            f" | {ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
