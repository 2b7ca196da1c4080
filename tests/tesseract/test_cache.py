"""The VJP residual cache (qarray.tesseract._cache): what a kept pullback
holds, and that its cotangents are the recomputed ones."""

import jax
import jax.numpy as jnp
import numpy as np

import qarray
from qarray.tesseract._cache import ResidualCache, same_bytes


def _network(inputs, weights, scales):
    """relu(x @ dequantize(W)^T) twice: a linear layer's pullback needs W."""
    h = inputs["x"]
    for qvalue, scale in zip(weights, scales, strict=True):
        h = jax.nn.relu(qarray.linear_q(h, qarray.pack(qvalue, scale)))
    return {"y": h}


def _constants(rng, width=64, depth=2):
    weights = [
        jnp.asarray(rng.integers(-127, 128, (width, width), dtype=np.int8))
        for _ in range(depth)
    ]
    scales = [jnp.full((width,), 0.01, jnp.float32) for _ in range(depth)]
    return weights, scales


def test_a_kept_pullback_holds_no_copy_of_the_constants():
    rng = np.random.default_rng(0)
    weights, scales = _constants(rng)
    cache = ResidualCache(8, 0, 0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    cache.apply(_network, {"x": x}, (weights, scales))
    (entry,) = cache._entries.values()
    kept = jax.tree.leaves(entry.kept)
    # only what depends on x: no int8 (64, 64) weight among the residuals
    assert kept, "the activations' residuals are kept"
    assert not any(leaf.dtype == jnp.int8 for leaf in kept)
    assert sum(leaf.nbytes for leaf in kept) < sum(w.nbytes for w in weights)
    assert not all(entry.signature.keep)  # the weights' residuals were dropped


def test_a_kept_pullback_gives_the_recomputed_cotangents():
    rng = np.random.default_rng(1)
    weights, scales = _constants(rng)
    cache = ResidualCache(8, 0, 0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    g = rng.standard_normal((3, 64)).astype(np.float32)
    out = cache.apply(_network, {"x": x}, (weights, scales))
    got = cache.vjp(_network, {"x": x}, {"y": g}, ["x"])
    y, pullback = jax.vjp(lambda x: _network({"x": x}, weights, scales)["y"], x)
    (want,) = pullback(g)
    np.testing.assert_allclose(out["y"], y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["x"], want, rtol=1e-5, atol=1e-5)
    # NumPy: straight-through, so d x = (g * relu'(z2)) W2 ... through both
    w = [
        np.asarray(q, np.float64) * np.asarray(s)[:, None]
        for q, s in zip(weights, scales, strict=True)
    ]
    z1 = x @ w[0].T
    h1 = np.maximum(z1, 0)
    z2 = h1 @ w[1].T
    d2 = g * (z2 > 0)
    d1 = (d2 @ w[1]) * (z1 > 0)
    np.testing.assert_allclose(got["x"], d1 @ w[0], rtol=1e-4, atol=1e-4)


def test_same_bytes_is_bitwise():
    """The key's compare: equal bytes, not equal values (-0.0 != 0.0, a NaN
    equals itself), contiguous (memcmp) or strided (NumPy) alike."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((64, 33)).astype(np.float32)
    assert same_bytes(a, a.copy())
    b = a.copy()
    b[63, 32] = np.nextafter(b[63, 32], np.float32(np.inf))  # the last byte's element
    assert not same_bytes(a, b)
    zeros = np.zeros(5, np.float32)
    assert not same_bytes(zeros, -zeros)  # equal values, different bits
    nan = np.full(3, np.nan, np.float32)
    assert same_bytes(nan, nan.copy())  # unequal values, same bits
    assert same_bytes(a[:, ::2], a.copy()[:, ::2])  # strided: not memcmp's
    assert not same_bytes(a[:, ::2], b[:, ::2])  # [63, 32] is among them
    c = np.zeros((2, 2), np.complex128)
    assert same_bytes(c[:, :1], c.copy()[:, :1])
    assert same_bytes(np.zeros((0, 4), np.int8), np.zeros((0, 4), np.int8))


def test_a_vjp_compares_the_request_once(monkeypatch):
    """A hit reads the request's arrays against the kept key's once (the
    LRU's reordering finds the stored key by identity): the compare is the
    size of the request, a VJP's cost on a big one."""
    from qarray.tesseract import _cache

    rng = np.random.default_rng(3)
    weights, scales = _constants(rng)
    cache = ResidualCache(8, 0, 0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    g = rng.standard_normal((3, 64)).astype(np.float32)
    cache.apply(_network, {"x": x}, (weights, scales))
    calls = []

    def counted(a, b):
        calls.append(a.shape)
        return same_bytes(a, b)

    monkeypatch.setattr(_cache, "same_bytes", counted)
    assert cache.vjp(_network, {"x": x.copy()}, {"y": g}, ["x"]) is not None
    assert calls == [x.shape]
