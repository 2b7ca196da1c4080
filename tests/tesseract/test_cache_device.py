"""The VJP residual cache on the device JAX computes on: jax.devices()[0], the
CPU here and the chip under QARRAY_TEST_PLATFORM=tpu. tesseract_api.py in
process (Tesseract.from_tesseract_api) with a resident int8 network, its
cache's hits and misses read from the cache's counters, every answer against
the NumPy reference (support/network.py): the key's device, the counters,
the LRU under QARRAY_VJP_CACHE_SIZE, the residuals kept on the device.

Covers: qarray/tesseract/_cache.py"""

import contextlib
import os
import sys

import jax
import numpy as np
import pytest
from tesseract_core import Tesseract

from qarray.checkpoint import save_model
from support import network as net
from support.devices import caller_device
from support.server import ROOT

RTOL = ATOL = 2e-4
SIZE = 2  # QARRAY_VJP_CACHE_SIZE: small, so eviction shows
WIDTH = 16


@contextlib.contextmanager
def in_process(api_path, env: dict):
    """(Tesseract, API module): ``api_path`` served in process, its module
    imported with ``env`` set (the runtime reads its settings at import);
    the process's environment, ``sys.path`` and ``sys.modules`` entry for
    the module as they were afterwards."""
    from tesseract_core.runtime.core import load_module_from_path

    name = api_path.stem
    saved = dict(os.environ), list(sys.path), sys.modules.get(name)
    os.environ.update(env)
    try:
        module = load_module_from_path(api_path)
        with Tesseract.from_tesseract_api(module) as tess:
            yield tess, module
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        sys.path[:] = saved[1]
        if saved[2] is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved[2]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(Tesseract, its module, the model's layers): three relu layers, PyTorch's
    (out, in) layout, quantized to int8 at load."""
    rng = np.random.default_rng(11)
    layers = [
        net.make_layer(rng, WIDTH, WIDTH, "nk", "w", True, activation)
        for activation in ("relu", "relu", "none")
    ]
    path = tmp_path_factory.mktemp("model") / "model.safetensors"
    save_model(path, layers)
    env = {"QARRAY_MODEL": str(path), "QARRAY_VJP_CACHE_SIZE": str(SIZE)}
    with in_process(ROOT / "tesseract_api.py", env) as (tess, module):
        yield tess, module, layers


@pytest.fixture
def cache(served):
    """The served module's cache, emptied (its counters run on)."""
    cache = served[1].RUNTIME.cache
    assert cache.size == SIZE
    cache.resize(0)
    cache.resize(SIZE)
    return cache


def _vjp(served, x, g):
    """The VJP for x, checked against the NumPy reference's."""
    tess, _, layers = served
    got = tess.vector_jacobian_product({"x": x}, ["x"], ["y"], {"y": g})["x"]
    want = net.vjp({"x": x, "layers": layers}, g)["x"]
    assert isinstance(got, np.ndarray)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def _counts(cache) -> tuple[int, int]:
    return cache.hits, cache.misses


def test_a_vjp_after_an_apply_of_its_inputs_hits_other_inputs_miss(served, cache):
    tess, _, layers = served
    rng = np.random.default_rng(0)
    x, other = net.normal(rng, (5, WIDTH)), net.normal(rng, (5, WIDTH))
    g = net.normal(rng, (5, WIDTH))
    y = tess.apply({"x": x})["y"]
    np.testing.assert_allclose(
        y, net.forward({"x": x, "layers": layers}), rtol=RTOL, atol=ATOL
    )
    hits, misses = _counts(cache)
    _vjp(served, x, g)
    assert _counts(cache) == (hits + 1, misses)
    _vjp(served, other, g)  # no apply of these inputs came first
    assert _counts(cache) == (hits + 1, misses + 1)
    _vjp(served, x.copy(), g)  # equal bytes, another array: still kept
    assert _counts(cache) == (hits + 2, misses + 1)
    cache.resize(0)  # the same inputs, recomputed: the same answer (the reference)
    cache.resize(SIZE)
    _vjp(served, x, g)
    assert _counts(cache) == (hits + 2, misses + 2)


def test_the_lru_keeps_at_most_the_cache_size(served, cache):
    """QARRAY_VJP_CACHE_SIZE entries: a third apply drops the oldest one no
    VJP has read."""
    tess, _, _ = served
    rng = np.random.default_rng(1)
    xs = [net.normal(rng, (3, WIDTH)) for _ in range(4)]
    g = net.normal(rng, (3, WIDTH))
    a, b, c, unrelated = xs
    tess.apply({"x": a})
    tess.apply({"x": b})
    assert len(cache) == SIZE
    # a VJP request (a miss): applies store their pullbacks again (after
    # SIZE applies with no VJP, inference traffic, they stop)
    hits, misses = _counts(cache)
    _vjp(served, unrelated, g)
    tess.apply({"x": c})
    assert len(cache) == SIZE
    _vjp(served, a, g)  # evicted
    assert _counts(cache) == (hits, misses + 2)
    _vjp(served, b, g)
    _vjp(served, c, g)
    assert _counts(cache) == (hits + 2, misses + 2)


def test_the_key_names_the_device_and_the_residuals_stay_on_it(served, cache):
    tess, module, _ = served
    device = jax.devices()[0]
    rng = np.random.default_rng(2)
    x = net.normal(rng, (4, WIDTH))
    tess.apply({"x": x})
    ((key, entry),) = cache._entries.items()
    assert key.device == device  # the chip under QARRAY_TEST_PLATFORM=tpu
    kept = jax.tree.leaves(entry.kept)
    assert kept, "the activations' residuals are kept"
    for leaf in kept:  # device arrays, not host copies
        assert isinstance(leaf, jax.Array), type(leaf)
        assert leaf.devices() == {device}
    for leaf in jax.tree.leaves(entry.constants):  # the resident model's
        assert leaf.devices() == {device}
    assert entry.constants[0] is module.RUNTIME.resident  # not a copy


def _other_device():
    """A device other than the default: the second of several, or the host's
    CPU beside an accelerator; None where there is one device alone."""
    devices = jax.devices()
    if len(devices) > 1:
        return devices[1]
    if jax.default_backend() != "cpu":
        return jax.devices("cpu")[0]
    return None


def test_a_vjp_placed_on_another_device_misses(served, cache):
    """A pullback kept on one device answers the VJPs placed there; one
    placed elsewhere recomputes there instead of copying the residuals."""
    other = _other_device()
    if other is None:
        pytest.skip("one device: nowhere else to place a VJP")
    tess, _, _ = served
    rng = np.random.default_rng(3)
    x, g = net.normal(rng, (3, WIDTH)), net.normal(rng, (3, WIDTH))
    with jax.default_device(other):
        tess.apply({"x": x})
    ((key, entry),) = cache._entries.items()
    assert key.device == other
    assert all(leaf.devices() == {other} for leaf in jax.tree.leaves(entry.kept))
    hits, misses = _counts(cache)
    _vjp(served, x, g)  # on jax.devices()[0]
    assert _counts(cache) == (hits, misses + 1)
    with jax.default_device(other):
        _vjp(served, x, g)
    assert _counts(cache) == (hits + 1, misses + 1)


@pytest.fixture(scope="module")
def request_network():
    """tesseract_api.py in process without a resident model: the network,
    its float weights, comes with each request (QAT)."""
    with in_process(ROOT / "tesseract_api.py", {"QARRAY_MODEL": ""}) as (tess, module):
        yield tess, module


def test_a_qat_loop_through_tesseract_jax(request_network):
    """Three SGD steps of quantization-aware training through tesseract-jax
    (apply_tesseract under jax.grad): each step's gradient is the NumPy
    straight-through reference's, its VJP served by the pullback its apply
    kept on the device (a cache hit), and the loss falls."""
    from tesseract_jax import apply_tesseract

    tess, module = request_network
    cache = module.RUNTIME.cache
    rng = np.random.default_rng(4)
    layers = [
        net.make_layer(rng, 8, 8, "nk", "w", True, "relu"),
        net.make_layer(rng, 8, 4, "nk", "w", True, "none"),
    ]
    x, target = net.normal(rng, (6, 8)), net.normal(rng, (6, 4))

    def loss(weights):
        request = {
            "x": x,
            "layers": [
                {**layer, **w} for layer, w in zip(layers, weights, strict=True)
            ],
        }
        y = apply_tesseract(tess, request)["y"]
        return jax.numpy.sum((y - target) ** 2)

    weights = [{"w": layer["w"], "bias": layer["bias"]} for layer in layers]
    losses = []
    with caller_device():
        for _ in range(3):
            inputs = {
                "x": x,
                "layers": [
                    {**layer, **w} for layer, w in zip(layers, weights, strict=True)
                ],
            }
            y = net.forward(inputs)
            want = net.vjp(inputs, 2 * (y - target))
            hits = cache.hits
            value, grads = jax.value_and_grad(loss)(weights)
            assert cache.hits == hits + 1  # the VJP read apply's pullback
            np.testing.assert_allclose(value, np.sum((y - target) ** 2), rtol=RTOL)
            for i, grad in enumerate(grads):
                for name in ("w", "bias"):
                    np.testing.assert_allclose(
                        grad[name], want[f"layers.[{i}].{name}"], rtol=RTOL, atol=ATOL
                    )
            losses.append(float(value))
            weights = jax.tree.map(
                lambda w, g: np.asarray(w - 0.01 * g), weights, grads
            )
    assert losses[2] < losses[0], losses
