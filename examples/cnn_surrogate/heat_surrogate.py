"""The steady heat equation, its NumPy solver, and a CNN surrogate of it.

    -div(k grad u) = 1 on the unit square, u = 0 on the boundary,

on a GRID x GRID cell-centred finite-volume grid (harmonic-mean face
conductivities). The input is the log-conductivity field ``log_k``, a smooth
Gaussian random field; the output is the temperature ``u``. The surrogate is
a fully convolutional network (dilated 3x3 convolutions, residual, zero
padding like the boundary condition) from ``log_k (1, GRID, GRID)`` to
``u (1, GRID, GRID)``: an equinox model that ``qarray.nn.quantize`` turns
int8.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.linalg import spsolve

GRID = 32
WIDTH = 32
DILATIONS = (1, 2, 4, 8, 4, 2, 1)


def random_log_k(rng: np.random.Generator, count: int, grid: int = GRID) -> np.ndarray:
    """``count`` smooth Gaussian random fields (count, grid, grid), unit
    standard deviation, correlation length ~ 1/6 of the domain."""
    freq = np.fft.fftfreq(grid)[:, None] ** 2 + np.fft.fftfreq(grid)[None, :] ** 2
    spectrum = np.exp(-freq * (grid / 6) ** 2 * 2 * np.pi**2)
    noise = rng.standard_normal((count, grid, grid))
    fields = np.fft.ifft2(np.fft.fft2(noise) * np.sqrt(spectrum)).real
    fields /= fields.std(axis=(1, 2), keepdims=True)
    return fields.astype(np.float32)


def solve(log_k: np.ndarray, source: np.ndarray | None = None) -> np.ndarray:
    """u (grid, grid) for one log-conductivity field, in float64; ``source``
    (grid, grid) the heat source on the right-hand side (default 1)."""
    grid = log_k.shape[0]
    k = np.exp(np.asarray(log_k, np.float64))
    h2 = (1.0 / grid) ** 2
    index = np.arange(grid * grid).reshape(grid, grid)
    rows, cols, vals = [], [], []
    diag = np.zeros((grid, grid))
    for axis in (0, 1):
        # faces between neighbours along axis: harmonic means
        a = np.take(k, range(grid - 1), axis=axis)
        b = np.take(k, range(1, grid), axis=axis)
        face = 2 * a * b / (a + b) / h2
        i = np.take(index, range(grid - 1), axis=axis).ravel()
        j = np.take(index, range(1, grid), axis=axis).ravel()
        rows += [i, j]
        cols += [j, i]
        vals += [-face.ravel(), -face.ravel()]
        lo = [slice(None)] * 2
        hi = [slice(None)] * 2
        lo[axis], hi[axis] = slice(0, grid - 1), slice(1, grid)
        diag[tuple(lo)] += face
        diag[tuple(hi)] += face
        # boundary faces: u = 0 half a cell outside, conductivity of the cell
        first = [slice(None)] * 2
        last = [slice(None)] * 2
        first[axis], last[axis] = 0, grid - 1
        diag[tuple(first)] += 2 * k[tuple(first)] / h2
        diag[tuple(last)] += 2 * k[tuple(last)] / h2
    rows.append(index.ravel())
    cols.append(index.ravel())
    vals.append(diag.ravel())
    n = grid * grid
    matrix = coo_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), (n, n)
    ).tocsr()
    rhs = np.ones(n) if source is None else np.asarray(source, np.float64).ravel()
    return spsolve(matrix, rhs).reshape(grid, grid)


def dataset(rng: np.random.Generator, count: int, grid: int = GRID, source=None):
    """(log_k, u), each (count, grid, grid) float32 (``source``: ``solve``'s)."""
    log_k = random_log_k(rng, count, grid)
    u = np.stack([solve(f, source) for f in log_k]).astype(np.float32)
    return log_k, u


class Surrogate(eqx.Module):
    """log_k (1, G, G) -> u (1, G, G): a lift, dilated residual blocks, a
    projection; ``u_scale`` puts the output in the solver's units (an array
    leaf, not a static field: model files hold arrays only)."""

    lift: eqx.nn.Conv2d
    blocks: list
    project: eqx.nn.Conv2d
    u_scale: jax.Array

    def __init__(self, key, width: int = WIDTH, u_scale: float = 1.0):
        keys = jax.random.split(key, len(DILATIONS) + 2)
        self.lift = eqx.nn.Conv2d(1, width, 3, padding=1, key=keys[0])
        self.blocks = [
            eqx.nn.Conv2d(width, width, 3, padding=d, dilation=d, key=k)
            for d, k in zip(DILATIONS, keys[1:-1], strict=True)
        ]
        self.project = eqx.nn.Conv2d(width, 1, 3, padding=1, key=keys[-1])
        self.u_scale = jnp.asarray(u_scale, jnp.float32)

    def __call__(self, log_k):
        h = jax.nn.gelu(self.lift(log_k))
        for block in self.blocks:
            h = h + jax.nn.gelu(block(h))
        return self.project(h) * self.u_scale


def relative_l2(pred, true) -> float:
    """Mean over fields of ||pred - true|| / ||true||."""
    pred, true = np.asarray(pred, np.float64), np.asarray(true, np.float64)
    axes = tuple(range(1, true.ndim))
    err = np.sqrt(((pred - true) ** 2).sum(axes) / (true**2).sum(axes))
    return float(err.mean())


def predict(model, log_k, batch: int = 64) -> np.ndarray:
    """The model on many fields (n, G, G) -> (n, G, G), in batches."""
    run = eqx.filter_jit(lambda m, f: jax.vmap(m)(f[:, None])[:, 0])
    out = [np.asarray(run(model, jnp.asarray(log_k[i : i + batch])))
           for i in range(0, len(log_k), batch)]  # fmt: skip
    return np.concatenate(out)
