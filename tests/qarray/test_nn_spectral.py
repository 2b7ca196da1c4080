"""qarray.nn.SpectralConv (an FNO's Fourier layer) against a NumPy FFT
reference: float32, stored int8 / int4, trainable, gradients, model files."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray.nn as qnn
from qarray.checkpoint import load_quantized, save_tree
from support import reference as ref
from support.compiled import call

GEOMETRIES = [  # (in, out, modes, x shape)
    (3, 4, (5,), (3, 16)),
    (2, 3, (4, 3), (2, 8, 6)),
    (2, 2, (3, 2, 2), (2, 4, 6, 4)),
    (3, 2, (6, 4), (5, 3, 6, 6)),  # a batch axis; every frequency of an axis kept
]
IDS = ["1d", "2d", "3d", "2d-batched-all-modes"]


# Models are called through support.compiled and the helpers here (one XLA
# program per model structure and shape) rather than eagerly, op by op; one
# eager call of a stored SpectralConv stays, in
# test_freeze_model_files_and_equinox_tools.
@eqx.filter_jit
def weight_at_scale(model, scale):
    """The complex weight model stores with its scales replaced by scale."""
    return eqx.tree_at(lambda m: m.scale, model, scale).spectral_weight()


def as_complex(parts):
    return parts[..., 0] + 1j * parts[..., 1]


@pytest.mark.parametrize("precision", ["float32", "int8", "int4"])
@pytest.mark.parametrize("c_in, c_out, modes, x_shape", GEOMETRIES, ids=IDS)
def test_values_match_numpy(rng, c_in, c_out, modes, x_shape, precision):
    layer = qnn.SpectralConv(c_in, c_out, modes, key=jax.random.key(0))
    model = qnn.quantize(layer, precision=precision, group_size=2)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = as_complex(np.asarray(layer.weight))
    if precision != "float32":
        w = ref.spectral_roundtrip(np.asarray(layer.weight), precision, 2)
    want = ref.spectral_conv(x, w, modes)
    got = eqx.filter_jit(lambda m, x: m(x))(model, x)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_gradients_match_numpy(rng, precision):
    """Exact w.r.t. x and the stored scales; straight-through w.r.t. the
    trainable weights (the float layer's gradient at the quantized weights)."""
    c_in, c_out, modes = 2, 3, (3, 2)
    layer = qnn.SpectralConv(c_in, c_out, modes, key=jax.random.key(1))
    x = rng.standard_normal((c_in, 6, 4)).astype(np.float32)
    g = rng.standard_normal((c_out, 6, 4))
    w = ref.spectral_roundtrip(np.asarray(layer.weight), precision, 2)
    stored = qnn.quantize(layer, precision=precision, group_size=2)
    jx = ref.linear_jacobian(lambda v: ref.spectral_conv(v, w, modes), x)
    gx = eqx.filter_jit(jax.grad(lambda x, m, g: jnp.sum(m(x) * g)))(x, stored, g)
    np.testing.assert_allclose(gx, np.tensordot(g, jx, g.ndim), rtol=1e-4, atol=1e-5)
    # stored scales: the output is linear in them
    scale = np.asarray(stored.scale)

    def with_scale(s):
        return ref.spectral_conv(
            x,
            np.asarray(weight_at_scale(stored, np.asarray(s, np.float32))),
            modes,
        )

    js = ref.linear_jacobian(with_scale, scale)
    gs = eqx.filter_jit(
        jax.grad(
            lambda s, m, x, g: jnp.sum(eqx.tree_at(lambda m: m.scale, m, s)(x) * g)
        )
    )(scale, stored, x, g)
    np.testing.assert_allclose(gs, np.tensordot(g, js, g.ndim), rtol=1e-4, atol=1e-5)
    # trainable: straight-through, the float layer's gradient at W
    trainable = qnn.quantize(layer, precision=precision, group_size=2, trainable=True)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, x, g: jnp.sum(m(x) * g)))(
        trainable, x, g
    )

    def of_parts(parts):
        return ref.spectral_conv(x, parts[..., 0] + 1j * parts[..., 1], modes)

    parts = np.stack([w.real, w.imag], -1)
    jw = ref.linear_jacobian(of_parts, parts)
    np.testing.assert_allclose(
        grads.weight, np.tensordot(g, jw, g.ndim), rtol=1e-4, atol=1e-5
    )


def test_freeze_model_files_and_equinox_tools(rng, tmp_path):
    class FNOBlock(eqx.Module):
        spectral: qnn.SpectralConv
        pointwise: eqx.nn.Conv2d

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.spectral = qnn.SpectralConv(4, 4, (3, 3), key=k1)
            self.pointwise = eqx.nn.Conv2d(4, 4, 1, key=k2)

        def __call__(self, x):
            return jax.nn.gelu(self.spectral(x) + self.pointwise(x))

    block = FNOBlock(jax.random.key(2))
    x = rng.standard_normal((4, 8, 8)).astype(np.float32)
    qat = qnn.quantize(block, trainable=True)
    exported = qnn.freeze(qat)
    assert (
        exported.spectral.qvalue.dtype == np.int8 and exported.spectral.weight is None
    )
    # eager on purpose: the stored spectral layer op by op, against the jitted
    exported_x = exported(x)
    np.testing.assert_allclose(exported_x, call(qat, x), rtol=1e-5, atol=1e-6)
    assert 0 < exported.spectral.stored_error < 0.02
    file = tmp_path / "fno.safetensors"
    save_tree(file, exported)
    loaded = load_quantized(file, FNOBlock(jax.random.key(9)))
    exported_x = call(exported, x)
    np.testing.assert_array_equal(call(loaded, x), exported_x)
    # float32 and quantized models share the tree tools
    params, static = eqx.partition(exported, eqx.is_inexact_array)
    np.testing.assert_array_equal(call(eqx.combine(params, static), x), exported_x)
    batched = eqx.filter_jit(lambda m, xs: eqx.filter_vmap(m)(xs))(
        exported, np.stack([x, x])
    )
    np.testing.assert_allclose(batched[1], exported_x, rtol=1e-6, atol=1e-6)


def test_errors_name_the_shapes():
    with pytest.raises(ValueError, match="1 to 3 positive modes"):
        qnn.SpectralConv(2, 2, (1, 2, 3, 4), key=jax.random.key(0))
    layer = qnn.SpectralConv(2, 3, (5, 4), key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"requires x of shape \(\.\.\., 2"):
        layer(np.ones((3, 8, 8), np.float32))
    with pytest.raises(TypeError, match="exceed the frequencies"):
        layer(np.ones((2, 4, 8), np.float32))
    with pytest.raises(ValueError, match="group_size"):
        qnn.SpectralConv(3, 2, 2, key=jax.random.key(0), precision="int4", group_size=4)
    with pytest.raises(TypeError, match=r"float16 \(in, out, \*modes, 2\)"):
        qnn.SpectralConv(2, 3, 2, weight=np.ones((2, 3, 2), np.float32))


def test_evaluate_and_plan_cover_spectral_layers(rng):
    """qnn.evaluate lists a SpectralConv with its stored bytes (a row per
    output channel and mode); plan chooses its precision; apply_plan stores
    it so."""

    class Block(eqx.Module):
        spectral: qnn.SpectralConv
        head: eqx.nn.Conv1d

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.spectral = qnn.SpectralConv(4, 4, (6,), key=k1)
            self.head = eqx.nn.Conv1d(4, 1, 1, key=k2)

        def __call__(self, x):
            return self.head(jax.nn.gelu(self.spectral(x)))

    model = Block(jax.random.key(3))
    x = jnp.asarray(rng.standard_normal((32, 4, 16)), jnp.float32)
    report = qnn.evaluate(model, x, precision="int4", group_size=8)
    spectral = report["layers"][0]
    assert spectral["kind"] == "SpectralConv" and spectral["precision"] == "int4"
    rows = 4 * 6  # out * modes, 2 * in = 8 entries each
    assert spectral["bytes"] == rows * 8 // 2 + 4 * rows * (8 // 8)
    assert spectral["float32_bytes"] == 4 * 4 * 4 * 6 * 2
    assert 0 < spectral["alone_output_rel_l2"] < 0.2
    loose = qnn.plan(model, x, 10.0, group_size=8)
    assert loose["precisions"][0] == "int4"
    stored = qnn.apply_plan(model, loose)
    assert stored.spectral.precision == "int4" and stored.spectral.weight is None
    want = ref.spectral_conv(np.asarray(x[0]), ref.spectral_roundtrip(
        np.asarray(model.spectral.weight), "int4", 8), (6,))  # fmt: skip
    np.testing.assert_allclose(stored.spectral(x[0]), want, rtol=1e-4, atol=1e-5)
    tight = qnn.plan(model, x, 0.0, group_size=8)
    assert tight["precisions"] == ["float32", "float32"]
