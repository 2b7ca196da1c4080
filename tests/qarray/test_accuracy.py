"""qarray.nn.evaluate and plan against errors computed in NumPy.

Covers: qarray/nn/_accuracy.py, qarray/nn/_plan.py"""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray.nn as qnn
from qarray.tesseract import Network
from support import reference as ref


def mlp(rng, widths=(16, 32, 32, 8)):
    """(Network of float32 nk layers, relu between, and its weights)."""
    ws, bs = [], []
    for k, n in itertools.pairwise(widths):
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        ws.append(w)
        bs.append((0.1 * rng.standard_normal(n)).astype(np.float32))
    layers = [
        qnn.Linear(w, b, precision="float32") for w, b in zip(ws, bs, strict=True)
    ]
    acts = ["relu"] * (len(ws) - 1) + ["none"]
    return Network(layers, acts), ws, bs


def numpy_errors(ws, bs, x, dense, r):
    """Output and input-gradient errors of the network with weights
    ``dense`` (float64) against the float32 weights ``ws``."""

    def run(weights):
        h, pre = x.astype(np.float64), []
        for i, (w, b) in enumerate(zip(weights, bs, strict=True)):
            z = h @ w.T + b
            pre.append(z)
            h = np.maximum(z, 0) if i < len(weights) - 1 else z
        g = r.astype(np.float64)
        for i in reversed(range(len(weights))):
            if i < len(weights) - 1:
                g = g * (pre[i] > 0)
            g = g @ weights[i]
        return h, g

    y_ref, g_ref = run([w.astype(np.float64) for w in ws])
    y, g = run(dense)
    return {
        "output_rel_l2": np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref),
        "output_sqnr_db": 10 * np.log10(np.sum(y_ref**2) / np.sum((y - y_ref) ** 2)),
        "gradient_rel_l2": np.linalg.norm(g - g_ref) / np.linalg.norm(g_ref),
        "gradient_cosine": np.sum(g * g_ref)
        / np.linalg.norm(g)
        / np.linalg.norm(g_ref),
    }


def probe(x, network):
    y = np.asarray(network(x))
    return np.random.default_rng(0).standard_normal(y.shape).astype(np.float32)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_evaluate_matches_numpy(rng, precision):
    network, ws, bs = mlp(rng)
    x = rng.standard_normal((40, 16)).astype(np.float32)
    report = qnn.evaluate(network, x, precision=precision, group_size=8)
    r = probe(x, network)

    def quantized(w):
        return ref.roundtrip4(w, 8) if precision == "int4" else ref.roundtrip(w)

    floats = [w.astype(np.float64) for w in ws]
    want = numpy_errors(ws, bs, x, [quantized(w).astype(np.float64) for w in ws], r)
    for key, value in want.items():
        assert report["model"][key] == pytest.approx(value, rel=2e-3, abs=1e-6), key
    for i, layer in enumerate(report["layers"]):
        assert layer["precision"] == precision
        w = ws[i].astype(np.float64)
        sqnr = 10 * np.log10(np.sum(w**2) / np.sum((w - quantized(ws[i])) ** 2))
        assert layer["weight_sqnr_db"] == pytest.approx(sqnr, rel=1e-3)
        alone = [*floats[:i], quantized(ws[i]).astype(np.float64), *floats[i + 1 :]]
        want = numpy_errors(ws, bs, x, alone, r)
        assert layer["alone_output_rel_l2"] == pytest.approx(
            want["output_rel_l2"], rel=2e-3
        )
        assert layer["alone_gradient_cosine"] == pytest.approx(
            want["gradient_cosine"], rel=1e-4
        )
        n, k = ws[i].shape
        assert layer["bytes"] == (
            n * k // 2 + 4 * n * k // 8 if precision == "int4" else n * k + 4 * n
        )


def test_evaluate_and_plan_take_a_quant_config(rng):
    """A QuantConfig is what the keywords are shorthand for: the same report;
    W8A8 calibration, which evaluate and plan do not measure, refused."""
    network, _, _ = mlp(rng)
    x = rng.standard_normal((20, 16)).astype(np.float32)
    config = qnn.QuantConfig(precision="int4", group_size=8)
    by_config = qnn.evaluate(network, x, config)
    by_keywords = qnn.evaluate(network, x, precision="int4", group_size=8)
    assert by_config["model"] == by_keywords["model"]
    assert [layer["precision"] for layer in by_config["layers"]] == ["int4"] * 3
    planned = qnn.plan(network, x, 1.0, config)
    assert planned["precisions"] == ["int4"] * 3  # a loose budget: all cheapest
    assert planned["group_size"] == 8
    w8a8 = qnn.QuantConfig(activations="int8", smoothquant=0.5)
    with pytest.raises(ValueError, match="measures weight quantization"):
        qnn.evaluate(network, x, w8a8)
    with pytest.raises(ValueError, match="QuantConfig: method"):
        qnn.plan(network, x, 0.1, method="bogus")


def greedy(ws, bs, x, r, budget, group):
    """The documented plan, in NumPy: start cheapest, move the layer whose
    quantization alone costs most one step up until the model meets budget."""
    ladder = ("int4", "int8", "float32")
    floats = [w.astype(np.float64) for w in ws]

    def dense(w, p):
        return {"int4": ref.roundtrip4(w, group), "int8": ref.roundtrip(w)}.get(p, w)

    def error(choice):
        weights = [
            dense(w, p).astype(np.float64) for w, p in zip(ws, choice, strict=True)
        ]
        return numpy_errors(ws, bs, x, weights, r)["output_rel_l2"]

    def alone(i, p):
        weights = [*floats[:i], dense(ws[i], p).astype(np.float64), *floats[i + 1 :]]
        return numpy_errors(ws, bs, x, weights, r)["output_rel_l2"]

    choice = ["int4"] * len(ws)
    while error(choice) > budget:
        movable = [i for i, p in enumerate(choice) if p != "float32"]
        worst = max(movable, key=lambda i: alone(i, choice[i]))
        choice[worst] = ladder[ladder.index(choice[worst]) + 1]
    return choice, error(choice)


@pytest.mark.parametrize("budget", [0.05, 0.02, 0.005])
def test_plan_follows_sensitivity_and_meets_the_budget(rng, budget):
    network, ws, bs = mlp(rng)
    x = rng.standard_normal((64, 16)).astype(np.float32)
    r = probe(x, network)
    want, error = greedy(ws, bs, x, r, budget, 8)
    result = qnn.plan(network, x, budget, group_size=8)
    assert result["precisions"] == want
    assert result["model"]["output_rel_l2"] <= budget
    assert result["model"]["output_rel_l2"] == pytest.approx(error, rel=2e-3)
    sizes = {
        "int4": lambda n, k: n * k // 2 + 4 * n * k // 8,
        "int8": lambda n, k: n * k + 4 * n,
        "float32": lambda n, k: 4 * n * k,
    }
    assert result["bytes"] == sum(
        sizes[p](*w.shape) for p, w in zip(want, ws, strict=True)
    )


def test_plan_limits(rng):
    network, _, _ = mlp(rng)
    x = rng.standard_normal((16, 16)).astype(np.float32)
    # a budget of zero keeps everything float32; a loose one takes all int4
    assert qnn.plan(network, x, 0.0, group_size=8)["precisions"] == ["float32"] * 3
    assert qnn.plan(network, x, 10.0, group_size=8)["precisions"] == ["int4"] * 3
    with pytest.raises(ValueError, match="metric must be one of"):
        qnn.plan(network, x, 0.1, metric="loss")
    # K = 16 is not a multiple of 32: the first layer can only be int8
    assert qnn.plan(network, x, 10.0, group_size=32)["precisions"][0] == "int8"


class TinyCNN(eqx.Module):
    """conv (2 -> 6, K = 18), relu, conv (6 -> 3, K = 54), relu, conv
    (3 -> 1, K = 27); SAME padding, one example (C, H, W) -> (1, H, W)."""

    convs: list

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        shapes = [(2, 6), (6, 3), (3, 1)]
        self.convs = [
            eqx.nn.Conv2d(i, o, 3, padding=1, key=k)
            for (i, o), k in zip(shapes, keys, strict=True)
        ]

    def __call__(self, x):
        for conv in self.convs[:-1]:
            x = jax.nn.relu(conv(x))
        return self.convs[-1](x)


def numpy_cnn(model, x, r, weights):
    """(y, the input gradient of sum(y * r)) of TinyCNN with ``weights`` in
    float64, examples one by one."""
    geometry = ((1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    ys, gs = [], []
    for xi, ri in zip(x, r, strict=True):
        h, pre = xi.astype(np.float64), []
        for i, (conv, w) in enumerate(zip(model.convs, weights, strict=True)):
            z = ref.conv(h, w, *geometry) + np.asarray(conv.bias)
            pre.append((h, z))
            h = np.maximum(z, 0) if i < 2 else z
        g = ri.astype(np.float64)
        for i in reversed(range(3)):
            if i < 2:
                g = g * (pre[i][1] > 0)
            g, _ = ref.conv_vjp(pre[i][0], weights[i], g, *geometry)
        ys.append(h)
        gs.append(g)
    return np.stack(ys), np.stack(gs)


def test_plan_of_a_cnn_with_int4_convolutions(rng):
    model = TinyCNN(jax.random.key(3))
    x = rng.standard_normal((6, 2, 8, 8)).astype(np.float32)
    group = 18  # divides K = 18 and 54, not 27: the last conv is int8 or float32
    report = qnn.evaluate(model, x, precision="int4", group_size=group)
    assert [layer["precision"] for layer in report["layers"]] == [
        "int4",
        "int4",
        "int8",
    ]
    loose = qnn.plan(model, x, 10.0, group_size=group)
    assert loose["precisions"] == ["int4", "int4", "int8"]
    budget = report["model"]["output_rel_l2"] / 3
    result = qnn.plan(model, x, budget, group_size=group)
    assert result["model"]["output_rel_l2"] <= budget
    # the verified errors, recomputed in NumPy for the chosen precisions
    r = np.random.default_rng(0).standard_normal((6, 1, 8, 8))
    weights = []
    for conv, p in zip(model.convs, result["precisions"], strict=True):
        w = np.asarray(conv.weight)
        flat = w.reshape(w.shape[0], -1)
        if p != "float32":
            flat = ref.roundtrip4(flat, group) if p == "int4" else ref.roundtrip(flat)
        weights.append(flat.reshape(w.shape).astype(np.float64))
    floats = [np.asarray(c.weight, np.float64) for c in model.convs]
    y_ref, g_ref = numpy_cnn(model, x, np.asarray(r, np.float32), floats)
    y, g = numpy_cnn(model, x, np.asarray(r, np.float32), weights)
    want = np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref)
    assert result["model"]["output_rel_l2"] == pytest.approx(want, rel=1e-3)
    want_g = np.linalg.norm(g - g_ref) / np.linalg.norm(g_ref)
    assert result["model"]["gradient_rel_l2"] == pytest.approx(want_g, rel=1e-3)

    # the plan applied: stored layers at the chosen precisions, same outputs
    planned = qnn.apply_plan(model, result)
    kinds = [
        c.precision if isinstance(c, qnn.Conv) else "float32" for c in planned.convs
    ]
    assert kinds == result["precisions"]
    got = np.asarray(jax.vmap(planned)(x), np.float64)
    assert np.linalg.norm(got - y_ref) / np.linalg.norm(y_ref) == pytest.approx(
        want, rel=1e-3
    )
    with pytest.raises(ValueError, match="the plan has 2 layers"):
        qnn.apply_plan(model, {**result, "precisions": ["int8", "int8"]})


class Tagger(eqx.Module):
    """Token indices (T,) -> embedding (16) -> GRU (16 -> 16) -> LSTM
    (16 -> 8) over the sequence -> a Linear (8 -> 3) of the last state."""

    embed: eqx.nn.Embedding
    gru: eqx.nn.GRUCell
    lstm: eqx.nn.LSTMCell
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(20, 16, key=k[0])
        self.gru = eqx.nn.GRUCell(16, 16, key=k[1])
        self.lstm = eqx.nn.LSTMCell(16, 8, key=k[2])
        self.head = eqx.nn.Linear(8, 3, key=k[3])

    def __call__(self, tokens):
        xs = jax.vmap(self.embed)(tokens)
        _, hs = jax.lax.scan(lambda h, x: (self.gru(x, h),) * 2, jnp.zeros(16), xs)
        zero = (jnp.zeros(8), jnp.zeros(8))
        (h, _), _ = jax.lax.scan(lambda hc, x: (self.lstm(x, hc), None), zero, hs)
        return self.head(h)


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def numpy_tagger(model, tokens, w):
    """Tagger in float64 with weights ``w`` (embed, gru ih, gru hh, lstm ih,
    lstm hh, head), one sequence at a time."""
    gb, gbn = np.asarray(model.gru.bias), np.asarray(model.gru.bias_n)
    lb, hb = np.asarray(model.lstm.bias), np.asarray(model.head.bias)
    out = []
    for seq in tokens:
        h, hl, c = np.zeros(16), np.zeros(8), np.zeros(8)
        for t in seq:
            x = w[0][t]
            (ir, iz, in_), (hr, hz, hn) = (
                np.split(w[1] @ x + gb, 3),
                np.split(w[2] @ h, 3),
            )
            r, z = _sigmoid(ir + hr), _sigmoid(iz + hz)
            new = np.tanh(in_ + r * (hn + gbn))
            h = new + z * (h - new)
            i, f, g, o = np.split(w[3] @ h + w[4] @ hl + lb, 4)
            c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
            hl = _sigmoid(o) * np.tanh(c)
        out.append(w[5] @ hl + hb)
    return np.stack(out)


def test_evaluate_and_plan_of_embeddings_and_recurrent_cells(rng):
    model = Tagger(jax.random.key(5))
    tokens = rng.integers(0, 20, (12, 6)).astype(np.int32)
    floats = [
        np.asarray(a, np.float64)
        for a in (
            model.embed.weight,
            model.gru.weight_ih,
            model.gru.weight_hh,
            model.lstm.weight_ih,
            model.lstm.weight_hh,
            model.head.weight,
        )
    ]
    y_ref = numpy_tagger(model, tokens, floats)

    def error(weights):
        y = numpy_tagger(model, tokens, weights)
        return np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref)

    report = qnn.evaluate(model, tokens, precision="int4", group_size=8)
    kinds = [layer["kind"] for layer in report["layers"]]
    assert kinds == ["Embedding", "GRUCell", "LSTMCell", "Linear"]
    assert report["layers"][1]["shape"] == [[48, 16], [48, 16]]
    assert [layer["precision"] for layer in report["layers"]] == ["int4"] * 4
    # int4 rows per group of 8: the table's rows and each cell's two matrices
    quantized = [ref.roundtrip4(np.asarray(w, np.float32), 8) for w in floats]
    assert report["model"]["output_rel_l2"] == pytest.approx(error(quantized), rel=2e-3)
    assert report["model"]["gradient_rel_l2"] is None  # indices: no gradient
    alone = [*floats[:1], *quantized[1:3], *floats[3:]]  # the GRU cell alone
    assert report["layers"][1]["alone_output_rel_l2"] == pytest.approx(
        error(alone), rel=2e-3
    )
    sizes = [n * k // 2 + 4 * n * k // 8 for n, k in (w.shape for w in floats)]
    assert [layer["bytes"] for layer in report["layers"]] == [
        sizes[0],
        sizes[1] + sizes[2],
        sizes[3] + sizes[4],
        sizes[5],
    ]

    budget = report["model"]["output_rel_l2"] / 2
    result = qnn.plan(model, tokens, budget, group_size=8)
    assert result["model"]["output_rel_l2"] <= budget
    chosen = iter(result["precisions"])
    dense = []
    for group in ([floats[0]], floats[1:3], floats[3:5], [floats[5]]):
        p = next(chosen)
        for w in group:
            w32 = np.asarray(w, np.float32)
            back = {"int4": ref.roundtrip4(w32, 8), "int8": ref.roundtrip(w32)}
            dense.append(np.asarray(back.get(p, w), np.float64))
    assert result["model"]["output_rel_l2"] == pytest.approx(error(dense), rel=2e-3)
    planned = qnn.apply_plan(model, result)
    got = np.asarray(jax.vmap(planned)(tokens), np.float64)
    assert np.linalg.norm(got - y_ref) / np.linalg.norm(y_ref) == pytest.approx(
        error(dense), rel=2e-3
    )

    def precision(stored):
        return getattr(stored, "precision", "float32")  # float: an array

    parts = (planned.embed, planned.gru.weight_ih, planned.lstm.weight_hh, planned.head)
    assert [precision(p) for p in parts] == result["precisions"]
    assert not any(
        isinstance(p, eqx.nn.Linear) for p in parts if precision(p) != "float32"
    )
    with pytest.raises(ValueError, match="integer ones"):
        qnn.plan(model, tokens, budget, metric="gradient")
