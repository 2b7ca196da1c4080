"""Model files of any equinox model (keyed by pytree paths) and the PyTorch
converter with BatchNorm folding, against NumPy.

Covers: qarray/checkpoint/_tree.py, qarray/checkpoint/pytorch.py"""

import equinox as eqx
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import qarray.nn as qnn
from qarray.checkpoint import ModelFileError, load_quantized, load_tree, save_tree
from qarray.checkpoint._tree import leaf_paths
from qarray.checkpoint.pytorch import convert_tree, fold_batchnorm
from support import reference as ref
from support.compiled import call


class Net(eqx.Module):
    conv1: eqx.nn.Conv2d
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.conv1 = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k[0])
        self.blocks = [eqx.nn.Conv2d(4, 4, 3, padding=1, key=k[1]), eqx.nn.LayerNorm(4)]
        self.head = eqx.nn.Linear(4 * 5 * 5, 2, key=k[2])

    def __call__(self, x):
        h = jax.nn.relu(self.conv1(x))
        h = jax.nn.relu(self.blocks[0](h))
        h = jax.vmap(jax.vmap(self.blocks[1], 1, 1), 2, 2)(h)
        return self.head(h.ravel())


def test_leaf_paths_name_the_model_tree():
    paths = leaf_paths(call(Net, jax.random.key(0)))
    assert set(paths) == {
        "conv1.weight", "conv1.bias", "blocks.0.weight", "blocks.0.bias",
        "blocks.1.weight", "blocks.1.bias", "head.weight", "head.bias",
    }  # fmt: skip
    q = leaf_paths(qnn.quantize(call(Net, jax.random.key(0))))
    assert {"conv1.qvalue", "conv1.scale", "head.qvalue", "blocks.1.weight"} <= set(q)
    assert q["conv1.qvalue"].shape == (4, 9) and q["conv1.bias"].shape == (4,)


@pytest.mark.parametrize("stored", ["float", "quantized"])
def test_float_and_quantized_files_load_into_the_skeleton(tmp_path, rng, stored):
    trained = call(Net, jax.random.key(1))
    file = tmp_path / "m.safetensors"
    save_tree(file, trained if stored == "float" else qnn.quantize(trained))
    skeleton = call(Net, jax.random.key(99))  # other weights: the file supplies all
    model = load_quantized(file, skeleton)
    assert isinstance(model.conv1, qnn.Conv) and not model.conv1.trainable
    want = qnn.quantize(trained)
    x = rng.standard_normal((1, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(call(model, x), call(want, x), rtol=1e-6, atol=1e-6)
    # the weight error is recorded for a float file, unknown for a stored one
    w = np.asarray(trained.conv1.weight).reshape(4, -1)
    err = np.linalg.norm(w - ref.roundtrip(w)) / np.linalg.norm(w)
    if stored == "float":
        assert model.conv1.stored_error == pytest.approx(err, rel=1e-5)
    else:
        assert model.conv1.stored_error is None
    # the float file back into a float model, leaf for leaf
    if stored == "float":
        back = load_tree(file, skeleton)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(trained), strict=True):
            np.testing.assert_array_equal(a, b)


def test_mismatched_files_name_the_tensor(tmp_path):
    model = call(Net, jax.random.key(0))
    tensors = {k: np.asarray(v) for k, v in leaf_paths(model).items()}
    cases = {
        "missing": (
            {k: v for k, v in tensors.items() if k != "head.bias"},
            "missing: head.bias",
        ),
        "extra": (
            {**tensors, "fc9.weight": np.zeros(2, np.float32)},
            "unexpected: fc9.weight",
        ),
        "shape": (
            {**tensors, "head.bias": np.zeros(3, np.float32)},
            r"head.bias must have shape \(2,\)",
        ),
        "dtype": (
            {**tensors, "head.bias": np.zeros(2, np.float64)},
            "head.bias must be float32",
        ),
        "nan": ({**tensors, "head.bias": np.full(2, np.nan, np.float32)}, "NaN or Inf"),
    }
    for name, (bad, match) in cases.items():
        save_file(bad, str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(ModelFileError, match=match):
            load_quantized(tmp_path / f"{name}.safetensors", model)
    with pytest.raises(ModelFileError, match="does not exist"):
        load_tree(tmp_path / "nope.safetensors", model)


def _batchnorm(rng, c):
    return {
        "weight": rng.uniform(0.5, 2, c).astype(np.float32),
        "bias": rng.standard_normal(c).astype(np.float32),
        "running_mean": rng.standard_normal(c).astype(np.float32),
        "running_var": rng.uniform(0.5, 2, c).astype(np.float32),
    }


def test_fold_batchnorm_is_conv_then_batchnorm(rng):
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    bn = _batchnorm(rng, 3)
    x = rng.standard_normal((2, 6, 6))
    geometry = ((1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    y = ref.conv(x, w, *geometry) + b[:, None, None]
    shape = (-1, 1, 1)
    want = (y - bn["running_mean"].reshape(shape)) / np.sqrt(
        bn["running_var"].reshape(shape) + 1e-5
    ) * bn["weight"].reshape(shape) + bn["bias"].reshape(shape)
    fw, fb = fold_batchnorm(w, b, bn)
    got = ref.conv(x, fw, *geometry) + fb[:, None, None]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def pytorch_cnn_state_dict(rng, path):
    """What torch.save(model.state_dict()) holds for Conv2d(1,4,3)+BatchNorm2d,
    Conv2d(4,4,3)+BatchNorm2d, LayerNorm(4), Linear(100, 2), as safetensors."""
    sd = {
        "conv1.weight": rng.standard_normal((4, 1, 3, 3)).astype(np.float32),
        "conv1.bias": rng.standard_normal(4).astype(np.float32),
        "features.0.weight": rng.standard_normal((4, 4, 3, 3)).astype(np.float32),
        "features.1.weight": rng.standard_normal(4).astype(np.float32),
        "features.1.bias": rng.standard_normal(4).astype(np.float32),
        "head.weight": rng.standard_normal((2, 100)).astype(np.float32),
        "head.bias": rng.standard_normal(2).astype(np.float32),
    }
    for name in ("bn1", "bn2"):
        for k, v in _batchnorm(rng, 4).items():
            sd[f"{name}.{k}"] = v
        sd[f"{name}.num_batches_tracked"] = np.array(7, np.int64)
    save_file(sd, str(path))
    return sd


def test_convert_a_pytorch_cnn_with_batchnorm(tmp_path, rng):
    sd = pytorch_cnn_state_dict(rng, tmp_path / "sd.safetensors")
    errors = convert_tree(
        tmp_path / "sd.safetensors",
        tmp_path / "m.safetensors",
        fold=[("conv1", "bn1"), ("features.0", "bn2")],
        rename=[("features.0", "blocks.0"), ("features.1", "blocks.1")],
    )
    assert set(errors) == {"conv1", "features.0", "head"}
    assert all(0 < e < 0.01 for e in errors.values())
    stored = load_file(str(tmp_path / "m.safetensors"))
    assert stored["conv1.qvalue"].dtype == np.int8 and stored["conv1.qvalue"].shape == (
        4,
        9,
    )
    model = load_quantized(tmp_path / "m.safetensors", call(Net, jax.random.key(5)))
    # PyTorch's forward pass in float64, BatchNorm in inference mode, on the
    # folded and quantized weights
    x = rng.standard_normal((1, 5, 5)).astype(np.float32)
    geometry = ((1, 1), ((1, 1), (1, 1)), (1, 1), 1)

    def conv_bn(h, name, bn):
        w, b = fold_batchnorm(
            sd[f"{name}.weight"],
            sd.get(f"{name}.bias"),
            {k: sd[f"{bn}.{k}"] for k in _batchnorm(rng, 1)},
        )
        wq = ref.roundtrip(w.reshape(4, -1)).reshape(w.shape)
        return np.maximum(ref.conv(h, wq, *geometry) + b[:, None, None], 0)

    h = conv_bn(conv_bn(x, "conv1", "bn1"), "features.0", "bn2")
    mean, var = h.mean(0, keepdims=True), h.var(0, keepdims=True)
    h = (h - mean) / np.sqrt(var + 1e-5) * sd["features.1.weight"][:, None, None]
    h = h + sd["features.1.bias"][:, None, None]
    want = (
        ref.roundtrip(sd["head.weight"]).astype(np.float64) @ h.ravel()
        + sd["head.bias"]
    )
    np.testing.assert_allclose(call(model, x), want, rtol=1e-4, atol=1e-4)


def test_mixed_precision_files_load_layer_by_layer(tmp_path, rng):
    """float32 conv, int4 conv, int8 head: each layer loads as stored."""
    trained = call(Net, jax.random.key(4))
    # conv1's K = 9 has no even group size: blocks.0 (K = 36) is the int4 one
    plan = {"precisions": ["float32", "int4", "int8"], "group_size": 6}
    mixed = qnn.apply_plan(trained, plan)
    file = tmp_path / "mixed.safetensors"
    save_tree(file, mixed)
    tensors = load_file(str(file))
    assert tensors["blocks.0.qvalue"].dtype == np.uint8
    assert tensors["blocks.0.scale"].shape == (4, 6)
    assert "conv1.weight" in tensors and tensors["head.qvalue"].dtype == np.int8
    model = load_quantized(file, call(Net, jax.random.key(99)))
    assert isinstance(model.conv1, eqx.nn.Conv2d)
    assert (model.blocks[0].precision, model.blocks[0].group_size) == ("int4", 6)
    assert model.head.precision == "int8"
    x = rng.standard_normal((1, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(call(model, x), call(mixed, x), rtol=1e-6, atol=1e-6)
    # the same in NumPy: the int4 block's weights grouped by 6
    w = np.asarray(trained.blocks[0].weight).reshape(4, -1)
    np.testing.assert_allclose(
        np.asarray(model.blocks[0].quantized().qvalue),
        ref.pack4(ref.quantize4(w, 6)[0]),
    )
    # an int4 payload without scales of a whole number of groups is refused
    tensors["blocks.0.scale"] = np.ones((4, 5), np.float32)
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ModelFileError, match=r"blocks.0.qvalue is int4.*K = 36"):
        load_quantized(tmp_path / "bad.safetensors", call(Net, jax.random.key(0)))


class Decoder(eqx.Module):
    """Every other kind of layer qnn.quantize replaces: an embedding, a
    recurrent cell of each kind and a transposed convolution."""

    embed: eqx.nn.Embedding
    gru: eqx.nn.GRUCell
    lstm: eqx.nn.LSTMCell
    up: eqx.nn.ConvTranspose1d

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(10, 32, key=k[0])
        self.gru = eqx.nn.GRUCell(32, 32, key=k[1])
        self.lstm = eqx.nn.LSTMCell(32, 32, key=k[2])
        self.up = eqx.nn.ConvTranspose1d(1, 2, 4, stride=2, padding=1, key=k[3])

    def __call__(self, tokens):
        h = jax.numpy.zeros(32)
        state = (jax.numpy.zeros(32), jax.numpy.zeros(32))
        for t in tokens:
            h = self.gru(self.embed(t), h)
            state = self.lstm(h, state)
        return self.up(state[0][None])


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_embeddings_cells_and_transposed_convolutions_round_trip(tmp_path, precision):
    trained = call(Decoder, jax.random.key(1))
    quantized = qnn.quantize(trained, precision=precision, group_size=16)
    assert isinstance(quantized.embed, qnn.Embedding)
    assert isinstance(quantized.gru.weight_ih, qnn.Linear)
    assert isinstance(quantized.up, qnn.ConvTranspose)
    file = tmp_path / "decoder.safetensors"
    save_tree(file, quantized)
    model = load_quantized(file, call(Decoder, jax.random.key(7)))
    tokens = [3, 1, 4, 1, 5]
    np.testing.assert_array_equal(call(model, tokens), call(quantized, tokens))
    assert model.embed.precision == quantized.embed.precision
    assert model.lstm.weight_hh.precision == quantized.lstm.weight_hh.precision
    # the quantized decoder stays near the float one
    want = np.asarray(call(trained, tokens))
    err = np.linalg.norm(np.asarray(call(model, tokens)) - want) / np.linalg.norm(want)
    assert err < (0.15 if precision == "int4" else 0.02)


def test_convert_a_pytorch_transposed_convolution(tmp_path, rng):
    """nn.ConvTranspose2d's weight (in, out, *k) converted with --transposed:
    the loaded eqx.nn.ConvTranspose2d computes PyTorch's scatter definition."""
    w = rng.standard_normal((3, 4, 3, 2)).astype(np.float32)  # (in, out, kh, kw)
    b = rng.standard_normal(4).astype(np.float32)
    src, dst = tmp_path / "sd.safetensors", tmp_path / "m.safetensors"
    save_file({"up.weight": w, "up.bias": b}, str(src))
    convert_tree(src, dst, transposed=["up"])

    class Up(eqx.Module):
        up: eqx.nn.ConvTranspose2d

        def __init__(self, key):
            self.up = eqx.nn.ConvTranspose2d(3, 4, (3, 2), stride=2, padding=1, key=key)

        def __call__(self, x):
            return self.up(x)

    model = load_quantized(dst, call(Up, jax.random.key(0)))
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    # PyTorch: input (i, j) times w[:, :, a, b] lands on (2i + a - 1, 2j + b - 1)
    wq = ref.roundtrip(np.flip(w.swapaxes(0, 1), (2, 3)).reshape(4, -1))
    wt = np.flip(wq.reshape(4, 3, 3, 2), (2, 3)).swapaxes(0, 1)  # back to (in, out, k)
    out_h, out_w = (4 - 1) * 2 - 2 + 3, (5 - 1) * 2 - 2 + 2
    want = np.zeros((4, out_h, out_w)) + b[:, None, None]
    for i in range(4):
        for j in range(5):
            for a in range(3):
                for c in range(2):
                    r, s = 2 * i + a - 1, 2 * j + c - 1
                    if 0 <= r < out_h and 0 <= s < out_w:
                        want[:, r, s] += wt[:, :, a, c].T @ x[:, i, j]
    np.testing.assert_allclose(call(model, x), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ModelFileError, match="transposed layer 'down'"):
        convert_tree(src, dst, transposed=["down"])
