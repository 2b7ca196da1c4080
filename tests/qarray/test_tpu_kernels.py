"""qarray's Pallas kernel (qarray/_tpu) against the NumPy reference: compiled
on a TPU, in Pallas' interpreter elsewhere (CI's CPU). Its precision is a
number of bf16 parts of x: one part is x rounded to bf16 (2**-9 an entry),
two ~2**-17, three float32's.

Covers: qarray/_tpu/__init__.py, qarray/_tpu/_weight_only.py"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from qarray import _tpu

INTERPRET = jax.default_backend() != "tpu"
# relative error (Frobenius) of the product for x in 1, 2, 3 bf16 parts
PARTS_TOLERANCE = {1: 2.0**-8, 2: 2.0**-15, 3: 1e-6}


def rel_err(got, want):
    got = np.asarray(got, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("nk", [True, False], ids=["nk", "kn"])
@pytest.mark.parametrize("shape", [(1, 256, 128), (5, 300, 130), (16, 2100, 600)])
def test_matches_numpy(rng, shape, nk, parts):
    """Both layouts, padded tails on every axis, several blocks of K and N."""
    m, k, n = shape
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scale = rng.random(n).astype(np.float32)
    stored = w if nk else np.ascontiguousarray(w.T)
    got = _tpu.weight_only_product(
        jnp.asarray(x), stored, scale, nk=nk, parts=parts, interpret=INTERPRET
    )
    want = (x.astype(np.float64) @ w.T.astype(np.float64)) * scale
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert rel_err(got, want) <= PARTS_TOLERANCE[parts]
    if parts == 1:  # exactly the product of x rounded to bf16
        x16 = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
        assert rel_err(got, (x16 @ w.T.astype(np.float64)) * scale) <= 1e-6


def test_empty_axes_give_zeros():
    for m, k, n in [(0, 16, 8), (2, 0, 3), (2, 8, 0)]:
        got = _tpu.weight_only_product(
            jnp.ones((m, k)),
            jnp.ones((n, k), jnp.int8),
            jnp.ones(n),
            nk=True,
            parts=1,
            interpret=INTERPRET,
        )
        assert got.shape == (m, n) and not np.asarray(got).any()


def test_parts_follow_the_precision_asked_for():
    P = lax.Precision
    assert _tpu.parts_for(P.DEFAULT, "tpu") == 1
    assert _tpu.parts_for(P.HIGH, "cpu") == 2
    assert _tpu.parts_for(P.HIGHEST, "tpu") == 3
    assert _tpu.parts_for((P.DEFAULT, P.HIGHEST), "tpu") == 1  # x's precision
    with jax.default_matmul_precision("default"):
        assert _tpu.parts_for(None, "cpu") == 1
    with jax.default_matmul_precision("highest"):
        assert _tpu.parts_for(None, "tpu") == 3
    if jax.config.jax_default_matmul_precision is None:
        # the platform's default: one pass on a TPU, float32 elsewhere
        assert (_tpu.parts_for(None, "tpu"), _tpu.parts_for(None, "cpu")) == (1, 3)
