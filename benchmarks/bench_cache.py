"""The VJP residual cache at the Tesseract level: apply then vector_jacobian_product.

In-process endpoints (tesseract_api.apply / vector_jacobian_product), the same
inputs for both calls, side by side: the cache off; what ships (apply caches its
compiled pullback only where that pays, which for this linear layer is nowhere:
see tesseract_api._cache_pays); the compiled pullback forced on every apply; and
tesseract-core's stock jax_apply filling the same LRU.
"""

import numpy as np
from tesseract_core.runtime import jax_recipes
from tesseract_core.runtime.experimental import set_jax_vjp_cache_size

from benchmarks._timing import interleaved

TARGETS = {(512, 2048, 2048): 0.85, (4, 64, 32): 1.05}


def _api():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tesseract_api

    return tesseract_api


def run(reps=15):
    api = _api()
    rows = []
    for shape, target in TARGETS.items():
        m, k, n = shape
        rng = np.random.default_rng(0)
        inputs = api.InputSchema(
            x=rng.standard_normal((m, k)).astype(np.float32),
            w=rng.standard_normal((k, n)).astype(np.float32),
        )
        g = {"y": rng.standard_normal((m, n)).astype(np.float32)}

        def apply_then_vjp(apply, inputs=inputs, g=g):
            apply(inputs)
            return api.vector_jacobian_product(inputs, {"x", "w"}, {"y"}, g)

        def off():
            set_jax_vjp_cache_size(0)
            return apply_then_vjp(api.apply)

        def ours(intensity=api.VJP_CACHE_MIN_INTENSITY):
            set_jax_vjp_cache_size(8)
            saved, api.VJP_CACHE_MIN_INTENSITY = api.VJP_CACHE_MIN_INTENSITY, intensity
            try:
                return apply_then_vjp(api.apply)
            finally:
                api.VJP_CACHE_MIN_INTENSITY = saved

        def stock():
            set_jax_vjp_cache_size(8)
            return apply_then_vjp(lambda i: jax_recipes.jax_apply(api.apply_jit, i))

        variants = {
            "ours": ("default policy, ships: caches only where it pays", target),
            "forced": ("compiled pullback, caching every apply", None),
            "stock": ("tesseract-core's jax_apply", None),
        }
        times = interleaved(
            {"off": off, "ours": ours, "forced": lambda: ours(0), "stock": stock},
            reps=reps,
        )
        set_jax_vjp_cache_size(api.VJP_CACHE_SIZE)
        for name, (label, row_target) in variants.items():
            rows.append(
                {
                    "row": f"apply + vjp, cache on ({label}) / cache off",
                    "shape": shape,
                    "baseline": "same in-process endpoints, cache off",
                    "ratio": times[name] / times["off"],
                    "target": row_target,
                    "unit": "x the time (lower is better)",
                    "lower_is_better": True,
                    "ms": 1e3 * times[name],
                    "baseline_ms": 1e3 * times["off"],
                }
            )
    return rows
