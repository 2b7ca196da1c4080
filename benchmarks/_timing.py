"""Side-by-side timing: interleaved repetitions, warm-up excluded, medians."""

import statistics
import time

import jax


def interleaved(fns: dict, reps: int, warmup: int = 2) -> dict[str, float]:
    """Median wall seconds per call of each zero-argument function.

    Every function runs ``warmup`` times first (compilation, caches), then the
    functions take turns, in a rotating order, ``reps`` times each, so drift in
    the machine's speed hits all of them alike. Results are blocked on.
    """
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    names = list(fns)
    times = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}
