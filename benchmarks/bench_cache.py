"""The VJP residual cache at the Tesseract level: apply then vector_jacobian_product.

In-process endpoints (tesseract_api.apply / vector_jacobian_product), the same
inputs for both calls, side by side: the cache off; what ships (the policy of
qarray.tesseract.ResidualCache.pays with the default settings); the compiled
pullback forced on every apply; and tesseract-core's stock jax_apply filling
its own LRU. Two networks: one linear layer (a miss recomputes only
quantize(w) and the products the VJP needs) and three relu layers (a miss
recomputes the whole forward pass). Each with the same inputs every
repetition and as a training loop (new weights every step, each variant's LRU
kept across steps, stale entries and all): what sets the default policy.
"""

import dataclasses

import numpy as np
from tesseract_core.runtime import jax_recipes
from tesseract_core.runtime.experimental import set_jax_vjp_cache_size

from benchmarks._timing import interleaved
from qarray.tesseract.internal import ResidualCache

# (network, (M, K, N) with every layer N x N after the first), target for what
# ships: with the cache on, apply + vjp is never slower than with it off, with
# the same inputs repeated and in a training loop (new weights every step)
CASES = (
    ("linear layer", 1, "none", (512, 2048, 2048), 1.0),
    ("linear layer", 1, "none", (4, 64, 32), 1.0),
    ("3-layer relu network", 3, "relu", (256, 1024, 1024), 1.0),
    ("3-layer relu network", 3, "relu", (16, 256, 256), 1.0),
)


def _api():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tesseract_api

    return tesseract_api


def _inputs(api, rng, depth, activation, shape):
    m, k, n = shape
    layers, width = [], k
    for i in range(depth):
        last = i == depth - 1
        layers.append(
            {
                "w": rng.standard_normal((width, n)).astype(np.float32)
                / np.float32(np.sqrt(width)),
                "bias": rng.standard_normal(n).astype(np.float32),
                "activation": "none" if last else activation,
            }
        )
        width = n
    x = rng.standard_normal((m, k)).astype(np.float32)
    return api.InputSchema.model_validate({"x": x, "layers": layers})


# a training loop never repeats its weights: that many distinct steps, in turn
STEPS = 12


def run(reps=15):
    rows = []
    for loop in (False, True):
        rows += _rows(reps, loop)
    return rows


def _rows(reps, loop):
    """Each case with the same inputs every repetition, or (``loop``) with
    new weights every step, as a training loop sends them."""
    import itertools

    api = _api()
    rows = []
    for network, depth, activation, shape, target in CASES:
        m, _, n = shape
        rng = np.random.default_rng(0)
        steps = [
            _inputs(api, rng, depth, activation, shape)
            for _ in range(STEPS if loop else 1)
        ]
        inputs = steps[0]
        g = {"y": rng.standard_normal((m, n)).astype(np.float32)}
        paths = {"x"} | {f"layers.[{i}].w" for i in range(depth)}
        turns = {}  # each variant walks the steps on its own

        def apply_then_vjp(apply, g=g, paths=paths, steps=steps, turns=turns):
            walk = turns.setdefault(id(api.RUNTIME.cache), itertools.cycle(steps))
            inputs = next(walk)
            apply(inputs)
            return api.vector_jacobian_product(inputs, paths, {"y"}, g)

        # one cache per variant, swapped in for its turn: each keeps its own
        # LRU across repetitions, as one server would (in a training loop,
        # stale entries of earlier steps stay alive until evicted)
        shipped = api.RUNTIME.cache
        caches = {
            "off": ResidualCache(0, shipped.min_flops, shipped.min_intensity),
            "ours": ResidualCache(
                shipped.size, shipped.min_flops, shipped.min_intensity
            ),
            "forced": ResidualCache(shipped.size, shipped.min_flops, 0),
            "stock": ResidualCache(0, shipped.min_flops, shipped.min_intensity),
        }

        def turn(name, apply=None, caches=caches):
            api.RUNTIME = dataclasses.replace(api.RUNTIME, cache=caches[name])
            # tesseract-core's own LRU, which the VJP's fallback (jax_vjp) reads
            set_jax_vjp_cache_size(8 if name == "stock" else 0)
            return apply_then_vjp(apply or api.apply)

        def stock_apply(request):
            return jax_recipes.jax_apply(api.apply_jit, request)

        cached = inputs.cache_pays()
        variants = {
            "ours": (
                "default policy, ships: " + ("caches" if cached else "does not cache"),
                target,
            ),
            "forced": ("compiled pullback, caching every apply", None),
            "stock": ("tesseract-core's jax_apply", None),
        }
        times = interleaved(
            {
                "off": lambda: turn("off"),
                "ours": lambda: turn("ours"),
                "forced": lambda: turn("forced"),
                "stock": lambda: turn("stock", stock_apply),
            },
            reps=reps,
        )
        set_jax_vjp_cache_size(0)
        api.RUNTIME = dataclasses.replace(api.RUNTIME, cache=shipped)
        for name, (label, row_target) in variants.items():
            rows.append(
                {
                    "row": f"{network}: apply + vjp"
                    + (" (training loop, new weights every step)" if loop else "")
                    + f", cache on ({label}) / cache off",
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
