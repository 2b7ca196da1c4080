"""AWQ, SmoothQuant and static activation scales (qnn.quantize(method="awq"),
smoothquant=alpha, static=...) against NumPy: the scales chosen, the stored
weights, the layers' outputs and gradients, model files, and what they buy
on a model with outlier input channels.

Covers: qarray/nn/_calibrate.py, qarray/nn/_scales.py, qarray/nn/_product.py,
qarray/nn/_config.py"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray.nn as qnn
from qarray.checkpoint import load_quantized, save_tree
from qarray.nn._calibrate import CLIP_RATIOS, Calibration, calibrated
from qarray.nn._kinds import quantized
from qarray.nn._scales import AWQ_CLIP_GRID, AWQ_GRID, awq_clip
from support import reference as ref
from support.models import Outliers


def outlier_inputs(rng, n, k, channels=(3, 11), factor=40.0):
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[:, list(channels)] *= factor
    return x


def numpy_awq(w, b, x, group_size):
    """AWQ's grid searched by brute force in float64: for each exponent,
    s = mean|x|^alpha / sqrt(max * min), the layer's output error with
    weights roundtrip4(W * s) / s; (the errors, the scale of each)."""
    mean = np.maximum(np.abs(x).mean(axis=0), 1e-4).astype(np.float64)
    y = x.astype(np.float64) @ w.T.astype(np.float64)
    errors, scales = [], []
    for alpha in AWQ_GRID:
        s = mean**alpha
        s = s / np.sqrt(s.max() * s.min())
        back = ref.roundtrip4((w * s).astype(np.float32), group_size) / s
        errors.append(np.sum((y - x.astype(np.float64) @ back.T) ** 2))
        scales.append(s)
    return np.array(errors), scales


def rtn(values, qmax):
    """Round-to-nearest of one row or group: scale max|v| / qmax (float32),
    values rounded half to even and clipped; (dequantized, float32)."""
    values = np.asarray(values, np.float32)
    scale = np.float32(np.abs(values).max() / np.float32(qmax))
    if scale == 0:
        return np.zeros_like(values)
    q = np.clip(np.round(values / scale), -qmax, qmax)
    return (q * scale).astype(np.float32)


def numpy_clip(scaled, inputs, group_size, sweeps=2):
    """AWQ's clipping search by brute force, row by row in float64 (the
    output error through the inputs themselves): the index into
    AWQ_CLIP_GRID of each row's (group's) clip, and the clipped weights.
    int8 (group_size None): the ratio of least ||X (w - Q(clip(w)))||^2;
    int4: each group's of its own share ||X_g (w_g - Q(clip(w_g)))||^2, or
    none where that leaves the row worse than no clipping, then ``sweeps``
    passes giving each group in turn the ratio of least row error."""
    scaled = np.asarray(scaled, np.float32)
    x = np.asarray(inputs, np.float64)
    out, k = scaled.shape
    size = k if group_size is None else group_size
    qmax = 127 if group_size is None else 7
    count = k // size
    grid = np.asarray(AWQ_CLIP_GRID, np.float32)
    choice = np.zeros((out, count), int)
    clipped = np.empty_like(scaled)

    def cut(seg, r):
        bound = grid[r] * np.abs(seg).max()  # float32, as the layer computes it
        return np.clip(seg, -bound, bound)

    for row in range(out):
        segs = [scaled[row, g * size : (g + 1) * size] for g in range(count)]
        moved = np.array(
            [[seg - rtn(cut(seg, r), qmax) for seg in segs] for r in range(len(grid))],
            np.float64,
        )  # (ratios, groups, G)
        cols = [x[:, g * size : (g + 1) * size] for g in range(count)]

        def row_error(pick, moved=moved, cols=cols):
            y = sum(cols[g] @ moved[pick[g], g] for g in range(count))
            return np.sum(y**2)

        own = [
            int(np.argmin([np.sum((cols[g] @ moved[r, g]) ** 2)
                           for r in range(len(grid))]))
            for g in range(count)
        ]  # fmt: skip
        pick = own
        if count > 1:
            none = [0] * count
            pick = list(own if row_error(own) <= row_error(none) else none)
            for _ in range(sweeps):
                for g in range(count):
                    tries = []
                    for r in range(len(grid)):
                        pick[g] = r
                        tries.append(row_error(pick))
                    pick[g] = int(np.argmin(tries))
        choice[row] = pick
        clipped[row] = np.concatenate([cut(segs[g], pick[g]) for g in range(count)])
    return choice, clipped


@pytest.mark.parametrize("group_size", [None, 8])
def test_awq_clip_against_brute_force(rng, group_size):
    """awq_clip's ratios and clipped weights are the brute force's
    (numpy_clip, through x / s), on correlated inputs with skewed channels;
    its choices move the outputs less than no clipping, and clip some rows
    (groups)."""
    mix = rng.standard_normal((8, 32)) * np.geomspace(0.2, 4, 32)
    x = (rng.standard_normal((120, 8)) @ mix).astype(np.float32)
    w = rng.standard_normal((6, 32)).astype(np.float32)
    s_cols = rng.uniform(0.5, 2.0, 32)
    scaled = (w * s_cols).astype(np.float32)
    got, ratios = awq_clip(scaled, x, s_cols, group_size=group_size)
    index, want = numpy_clip(scaled, x / s_cols, group_size)
    np.testing.assert_array_equal(ratios, np.asarray(AWQ_CLIP_GRID, np.float32)[index])
    np.testing.assert_array_equal(np.asarray(got), want)
    assert (index > 0).any()  # something was clipped
    qmax = 127 if group_size is None else 7
    size = group_size or 32

    def error(weights):
        back = np.stack(
            [np.concatenate([rtn(row[i : i + size], qmax) for i in range(0, 32, size)])
             for row in weights]
        )  # fmt: skip
        return np.sum(((x / s_cols) @ (scaled - back).T.astype(np.float64)) ** 2)

    assert error(want) < error(scaled)


def test_awq_search_against_brute_force(rng):
    """A tiny layer (K = 16, int4 G = 8) whose inputs have outlier channels:
    the scale AWQ keeps is the brute-force search's best (its error the
    least of the grid's), the stored weights those of W * s clipped by the
    brute-force clipping search (numpy_clip), and the layer computes (x /
    s) @ W'^T + b."""
    k1, _ = jax.random.split(jax.random.key(0))
    dense = eqx.nn.Linear(16, 6, key=k1)
    x = outlier_inputs(rng, 200, 16)
    w, b = np.asarray(dense.weight), np.asarray(dense.bias)
    got = qnn.quantize(dense, precision="int4", group_size=8, method="awq", data=x)
    assert got.channel_scale is not None and got.activation_scale is None
    s = np.asarray(got.channel_scale, np.float64)
    errors, _ = numpy_awq(w, b, x, 8)
    back = ref.roundtrip4((w * s).astype(np.float32), 8) / s
    y = x.astype(np.float64) @ w.T
    chosen = np.sum((y - x.astype(np.float64) @ back.T) ** 2)
    assert chosen == pytest.approx(errors.min(), rel=1e-3)
    assert errors.min() < 0.8 * errors[0]  # alpha = 0 is round-to-nearest
    _, clipped = numpy_clip((w * s).astype(np.float32), x / s, 8)
    values, scale = ref.quantize4(clipped, 8)
    np.testing.assert_array_equal(np.asarray(got.qvalue), ref.pack4(values))
    np.testing.assert_allclose(np.asarray(got.scale), scale, rtol=1e-6)
    want = (x / s) @ ref.dequantize4(values, scale).astype(np.float64).T + b
    np.testing.assert_allclose(jax.vmap(got)(x), want, rtol=1e-4, atol=1e-4)
    # the gradient with respect to x is the stored layer's: W'^T r / s
    r = rng.standard_normal((200, 6)).astype(np.float32)
    (gx,) = jax.grad(lambda x: jnp.sum(jax.vmap(got)(x) * r), argnums=(0,))(x)
    np.testing.assert_allclose(
        gx, (r @ ref.dequantize4(values, scale)) / s, rtol=1e-4, atol=1e-4
    )


def test_smoothquant_scales_and_outputs(rng):
    """channel_scale = max|x|^a / max|W|^(1-a) per input channel, the
    weights quantize(W * s), and the int8 product of x / s quantized per
    row: as NumPy computes them."""
    dense = eqx.nn.Linear(24, 8, key=jax.random.key(1))
    x = outlier_inputs(rng, 64, 24)
    w, b = np.asarray(dense.weight, np.float64), np.asarray(dense.bias)
    got = qnn.quantize(dense, activations="int8", smoothquant=0.6, data=x)
    s = np.abs(x).max(axis=0) ** 0.6 / np.abs(w).max(axis=0) ** 0.4
    np.testing.assert_allclose(np.asarray(got.channel_scale), s, rtol=1e-5)
    qvalue, scale = ref.quantize((w * s).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(got.qvalue), qvalue)
    folded = (x / s).astype(np.float32)
    want = ref.linear_q(folded, qvalue, scale, activations="int8") + b
    np.testing.assert_allclose(jax.vmap(got)(x), want, rtol=1e-4, atol=1e-4)


def brute_force_clip(magnitudes, ratios, weights):
    """The activation scale r * max / 127 whose int8 grid (values past it
    clipped) has the least squared error on ``magnitudes`` (n, C), channel c's
    weighed by ``weights[c]``, r searched over ``ratios`` one by one in
    float64."""
    v = np.asarray(magnitudes, np.float64)
    top = v.max()
    best, best_error = None, np.inf
    for r in ratios:
        step = r * top / 127
        q = np.clip(np.round(v / step), -127, 127) * step
        error = np.sum((v - q) ** 2 * weights)
        if error < best_error:
            best, best_error = step, error
    return best


@pytest.mark.parametrize("clip", ["absmax", "mse"])
@pytest.mark.parametrize("static", [True, "channel"])
def test_static_activation_scales(rng, static, clip):
    """Two layers: each one's activation scale is chosen on the inputs that
    reach it on the data (the second's through the first as quantized,
    weight-only), per tensor (True) or per channel ("channel": the ranges as
    a channel scale, max|x_c| / max_c max|x_c|): "absmax" max|x / s| / 127,
    "mse" the clipped grid of least squared error, each channel's weighed by
    its column of W * s squared (brute force); the product is of x / s
    rounded to that fixed grid."""
    k1, k2 = jax.random.split(jax.random.key(2))
    model = eqx.nn.Sequential(
        [eqx.nn.Linear(16, 12, key=k1), eqx.nn.Lambda(jax.nn.relu),
         eqx.nn.Linear(12, 4, key=k2)]
    )  # fmt: skip
    x = outlier_inputs(rng, 80, 16)
    got = qnn.quantize(model, activations="int8", static=static, clip=clip, data=x)
    first, second = got.layers[0], got.layers[2]
    h = x.astype(np.float64)
    for float_layer, layer in ((model.layers[0], first), (model.layers[2], second)):
        w = np.asarray(float_layer.weight, np.float64)
        b = np.asarray(float_layer.bias, np.float64)
        absmax = np.abs(h).max(axis=0)
        if static == "channel":
            s = np.where(absmax > 0, absmax / absmax.max(), 1.0)
            np.testing.assert_allclose(np.asarray(layer.channel_scale), s, rtol=1e-5)
        else:
            s = np.ones(w.shape[1])
            assert layer.channel_scale is None
        if clip == "absmax":
            a = np.abs(h / s).max() / 127
        else:
            weights = np.sum((w * s) ** 2, axis=0)
            a = brute_force_clip(np.abs(h / s), CLIP_RATIOS, weights)
        assert float(layer.activation_scale) == pytest.approx(a, rel=1e-5)
        assert layer.activations == "int8"
        qvalue, scale = ref.quantize((w * s).astype(np.float32))
        np.testing.assert_array_equal(np.asarray(layer.qvalue), qvalue)
        xq = np.clip(np.round(h / s / a), -127, 127)
        want = (xq * a) @ ref.dequantize(qvalue, scale).astype(np.float64).T + b
        np.testing.assert_allclose(
            jax.vmap(layer)(h.astype(np.float32)), want, rtol=1e-4, atol=1e-4
        )
        # the next layer calibrates on this one's weight-only output
        weight_only = h @ (ref.dequantize(qvalue, scale) / s).T + b
        h = np.maximum(weight_only, 0)


def test_smoothquant_halves_the_w8a8_error_of_outlier_channels(rng):
    """The issue's target, on held-out inputs: W8A8 with SmoothQuant at most
    half dynamic round-to-nearest's output error against float32 (NumPy
    computes the errors)."""
    model = Outliers(jax.random.key(0))
    calibration = outlier_inputs(rng, 128, 64, channels=(3, 17), factor=50.0)
    held_out = outlier_inputs(rng, 128, 64, channels=(3, 17), factor=50.0)
    y = np.asarray(jax.vmap(model)(held_out), np.float64)

    def error(quantized):
        got = np.asarray(jax.vmap(quantized)(held_out), np.float64)
        return np.linalg.norm(got - y) / np.linalg.norm(y)

    dynamic = error(qnn.quantize(model, activations="int8"))
    smooth = error(
        qnn.quantize(model, activations="int8", smoothquant=0.5, data=calibration)
    )
    assert smooth <= 0.5 * dynamic, (smooth, dynamic)


def test_model_files_keep_the_input_scales(tmp_path, rng):
    """save_tree / load_quantized: the channel and activation scales are
    stored beside the weights and the loaded model computes the same."""
    model = Outliers(jax.random.key(1))
    x = outlier_inputs(rng, 32, 64, channels=(3, 17), factor=50.0)
    stored = qnn.quantize(
        model, activations="int8", smoothquant=0.5, static=True, data=x
    )
    save_tree(tmp_path / "m.safetensors", stored)
    loaded = load_quantized(tmp_path / "m.safetensors", Outliers(jax.random.key(9)))
    assert loaded.l2.activations == "int8" and loaded.l2.channel_scale is not None
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(loaded)(x)), np.asarray(jax.vmap(stored)(x))
    )
    awq = qnn.quantize(model, precision="int4", group_size=32, method="awq", data=x)
    save_tree(tmp_path / "a.safetensors", awq)
    loaded = load_quantized(tmp_path / "a.safetensors", Outliers(jax.random.key(9)))
    assert loaded.l1.precision == "int4" and loaded.l1.activation_scale is None
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(loaded)(x)), np.asarray(jax.vmap(awq)(x))
    )


def test_evaluate_and_plan_with_awq(rng):
    """evaluate(method="awq") reports AWQ's and RTN's per-layer errors; plan
    never takes more bytes than round-to-nearest's plan."""
    model = Outliers(jax.random.key(2))
    x = outlier_inputs(rng, 64, 64, channels=(3, 17), factor=50.0)
    report = qnn.evaluate(model, x, precision="int4", group_size=32, method="awq")
    assert report["method"] == "awq"
    for layer in report["layers"]:
        assert {"rtn_weight_sqnr_db", "rtn_alone_output_rel_l2"} <= set(layer)
    # AWQ trades weight SQNR for output error on the data
    first = report["layers"][0]
    assert first["alone_output_rel_l2"] < first["rtn_alone_output_rel_l2"]
    budget = 0.02
    rtn = qnn.plan(model, x, budget, group_size=32)
    awq = qnn.plan(model, x, budget, group_size=32, method="awq")
    assert awq["bytes"] <= rtn["bytes"]
    assert awq["compared"]["rtn"] == rtn["bytes"]
    assert awq["model"]["output_rel_l2"] <= budget
    applied = qnn.apply_plan(model, awq, data=x)
    y = np.asarray(jax.vmap(model)(x), np.float64)
    got = np.asarray(jax.vmap(applied)(x), np.float64)
    assert np.linalg.norm(got - y) / np.linalg.norm(y) == pytest.approx(
        awq["model"]["output_rel_l2"], rel=1e-3
    )


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"precision": "int2"}, ValueError, "precision must be one of"),
        ({"precision": 8}, TypeError, "precision must be a string"),
        ({"activations": "int4"}, ValueError, "activations must be one of"),
        ({"method": "hqq"}, ValueError, "method must be one of"),
        ({"clip": "percentile"}, ValueError, "clip must be one of"),
        ({"group_size": 7}, ValueError, "group_size must be a positive even int"),
        ({"group_size": 8.0}, TypeError, "group_size must be an int"),
        ({"smoothquant": "half"}, TypeError, "smoothquant must be a number"),
        ({"smoothquant": 2.0, "activations": "int8"}, ValueError, r"in \[0, 1\]"),
        ({"static": "row", "activations": "int8"}, ValueError, "static must be"),
        ({"static": 1, "activations": "int8"}, ValueError, "static must be"),
        ({"static": True}, ValueError, "needs activations='int8'"),
        (
            {"method": "awq", "static": "channel", "activations": "int8"},
            ValueError,
            "each choose a scale per input channel",
        ),
    ],
)
def test_quant_config_pins_an_error_per_configuration(options, error, message):
    with pytest.raises(error, match=message):
        qnn.QuantConfig(**options)


def test_quant_config_is_what_the_keywords_build(rng):
    dense = eqx.nn.Linear(16, 8, key=jax.random.key(1))
    x = outlier_inputs(rng, 64, 16)
    config = qnn.QuantConfig(precision="int4", group_size=8, method="awq")
    by_config = qnn.quantize(dense, config, data=x)
    by_keywords = qnn.quantize(dense, precision="int4", group_size=8, method="awq",
                               data=x)  # fmt: skip
    for a, b in zip(
        jax.tree.leaves(by_config), jax.tree.leaves(by_keywords), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # keywords change a config; the result is checked again
    assert qnn.quantize(dense, config, method="rtn").channel_scale is None
    with pytest.raises(ValueError, match="group_size must be a positive even int"):
        qnn.quantize(dense, config, group_size=3)
    with pytest.raises(TypeError, match="unknown option"):
        qnn.quantize(dense, bits=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.precision = "int8"


def test_clear_errors(rng):
    dense = eqx.nn.Linear(8, 4, key=jax.random.key(0))
    x = rng.standard_normal((10, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="activations='int8'"):
        qnn.quantize(dense, smoothquant=0.5, data=x)
    with pytest.raises(ValueError, match="activations='int8'"):
        qnn.quantize(dense, static=True, data=x)
    with pytest.raises(ValueError, match="each choose a scale per input channel"):
        qnn.quantize(dense, activations="int8", method="awq", smoothquant=0.5, data=x)
    with pytest.raises(ValueError, match="smoothquant must be in"):
        qnn.quantize(dense, activations="int8", smoothquant=1.5, data=x)
    with pytest.raises(ValueError, match="needs data=X"):
        qnn.quantize(dense, method="awq")
    with pytest.raises(ValueError, match="static must be"):
        qnn.quantize(dense, activations="int8", static="row", data=x)
    with pytest.raises(
        TypeError, match=r"channel_scale to be a float32 array of shape \(8,\)"
    ):
        qnn.Linear(jnp.zeros((4, 8)), channel_scale=jnp.ones(5))
    with pytest.raises(ValueError, match="needs activations='int8'"):
        qnn.Linear(jnp.zeros((4, 8)), activation_scale=jnp.float32(1.0))


def test_awq_of_a_convolution(rng):
    """A Conv2d's channel scale (one per input channel, over its kernel's
    positions): the layer computes conv(x / s, roundtrip4(W')) + b, W' the
    brute-force clip of W * s on the im2col patches of x / s (numpy_clip),
    and AWQ's output error on the data is below round-to-nearest's."""
    conv = eqx.nn.Conv2d(4, 6, 3, padding=1, key=jax.random.key(3))
    x = rng.standard_normal((12, 4, 6, 6)).astype(np.float32)
    x[:, 1] *= 30.0  # an outlier channel
    got = qnn.quantize(conv, precision="int4", group_size=12, method="awq", data=x)
    rtn = qnn.quantize(conv, precision="int4", group_size=12)
    s = np.asarray(got.channel_scale, np.float64)
    assert s.shape == (4,)
    w = np.asarray(conv.weight)
    scaled = (w * s[None, :, None, None]).astype(np.float32).reshape(6, -1)
    padded = np.pad(x / s[:, None, None], ((0, 0), (0, 0), (1, 1), (1, 1)))
    patches = np.stack(
        [padded[:, :, i : i + 3, j : j + 3].reshape(12, -1)
         for i in range(6) for j in range(6)], axis=1,
    ).reshape(-1, 36)  # fmt: skip
    _, clipped = numpy_clip(scaled, patches, 12)
    values, scale = ref.quantize4(clipped, 12)
    back = ref.dequantize4(values, scale).reshape(w.shape).astype(np.float64)
    geometry = ((1, 1), ((1, 1), (1, 1)), (1, 1))
    b = np.asarray(conv.bias)
    want = np.stack([ref.conv(xi / s[:, None, None], back, *geometry) + b for xi in x])
    np.testing.assert_allclose(jax.vmap(got)(x), want, rtol=1e-4, atol=1e-4)
    y = np.asarray(jax.vmap(conv)(x), np.float64)
    awq_error = np.linalg.norm(want - y)
    rtn_error = np.linalg.norm(np.asarray(jax.vmap(rtn)(x), np.float64) - y)
    assert awq_error < rtn_error


def skewed_inputs(rng, mixing, n):
    """Correlated inputs of skewed channel scales (a few dozen directions,
    channel c's scale from 0.2 to 3), as a layer's usually are."""
    return (rng.standard_normal((n, mixing.shape[0])) @ mixing).astype(np.float32)


def test_awq_clipping_on_correlated_skewed_inputs(rng):
    """int4 (G = 32) on correlated, channel-skewed inputs: AWQ with its
    clipping search moves the outputs less than AWQ's channel scale alone
    (on the calibration inputs: never more, by construction) and less than
    round-to-nearest; on held-out inputs, the issue's target: at most 0.85x
    RTN's error (measured 0.68x; the scale alone 0.98x)."""
    k = 128
    mixing = (rng.standard_normal((24, k)) + 0.2 * np.eye(24, k)) * np.linspace(
        0.2, 3, k
    )
    x, held_out = skewed_inputs(rng, mixing, 256), skewed_inputs(rng, mixing, 256)
    dense = eqx.nn.Linear(k, 64, key=jax.random.key(4))

    def awq(clip):
        return calibrated(
            dense,
            x,
            lambda layer: quantized(layer, "int4", 32),
            Calibration(method="awq", awq_clip=clip),
        )

    rtn = qnn.quantize(dense, precision="int4", group_size=32)

    def error(layer, inputs):
        y = np.asarray(jax.vmap(dense)(inputs), np.float64)
        got = np.asarray(jax.vmap(layer)(inputs), np.float64)
        return np.linalg.norm(got - y) / np.linalg.norm(y)

    clipped, scaled = awq(True), awq(False)
    assert error(clipped, x) <= error(scaled, x) < 1.01 * error(rtn, x)
    assert error(clipped, x) < 0.85 * error(rtn, x)
    ratio = error(clipped, held_out) / error(rtn, held_out)
    assert ratio <= 0.85, ratio
