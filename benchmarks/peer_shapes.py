"""What bench_peers.py (torch) and compare_peers.py (jax) share: the shapes,
the data and the cache flush. NumPy only."""

from __future__ import annotations

import os

import numpy as np

# (M, K, N), weights (N, K) like nn.Linear's
SHAPES = [
    (1, 4096, 4096),
    (16, 4096, 4096),
    (1, 1024, 1024),
    (64, 1024, 1024),
    (512, 1024, 1024),
]


def inputs(m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """x (M, K) and float32 weights (N, K), the same on both sides."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    return x, w


def last_level_cache_bytes() -> int:
    """The largest CPU cache (sysfs), or 64 MiB when it cannot be read."""
    sizes = []
    root = "/sys/devices/system/cpu/cpu0/cache"
    for index in os.listdir(root) if os.path.isdir(root) else []:
        try:
            with open(f"{root}/{index}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=64 * 2**20)


def flush_buffer() -> np.ndarray:
    """float32 data of twice the last-level cache: reading it between calls
    leaves none of the weights in cache."""
    return np.ones(2 * last_level_cache_bytes() // 4, np.float32)
