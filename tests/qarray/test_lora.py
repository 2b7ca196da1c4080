"""qnn.lora (QLoRA adapters on quantized layers) and qnn.merge against NumPy:
values and gradients w.r.t. a, b and x, int8 and int4, with and without jit;
Linear and Conv, then ConvTranspose, Embedding, GRUCell / LSTMCell and
SpectralConv."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qarray.nn as qnn
from support import reference as ref
from support.compiled import call, vcall


def normal(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# The models under test run through module-level jitted helpers: each
# compiles once per model structure and shapes, cached across tests (run
# eagerly, every jnp op of a layer is an XLA compile of its own, ~0.1-0.2 s
# each on a TPU, where the suite runs in one process). Kept eager on
# purpose, a call of each kind: test_linear_adapter_values_and_gradients
# [jit=False] (LoRA on Linear: values and gradients), test_conv_adapter_
# against_numpy (LoRA on Conv and its base), test_spectral_adapter's and
# test_every_kind_starts_as_the_base_and_trains_only_its_adapters's exact
# "starts as the base" checks (LoRA on SpectralConv; on ConvTranspose,
# Embedding, GRUCell and SpectralConv, and those bases).


@eqx.filter_jit
def update_of(adapter, x):
    """An adapter's low-rank term alone."""
    return adapter.update(x)


@eqx.filter_jit
def lookup(model, index):
    """An embedding's rows at ``index`` (one lookup per entry)."""
    return jax.vmap(lambda m, i: m(i), in_axes=(None, 0))(model, index)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def dense(layer_w, precision, layout):
    """The (N, K) matrix a stored layer of float weights multiplies by."""
    w = np.asarray(layer_w)
    if layout == "kn":
        return ref.roundtrip(w).T  # stored (K, N), a scale per row of K
    return ref.roundtrip4(w, 16) if precision == "int4" else ref.roundtrip(w)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "precision, layout", [("int8", "nk"), ("int4", "nk"), ("int8", "kn")]
)
def test_linear_adapter_values_and_gradients(rng, precision, layout, jit):
    k, n, rank, alpha = 32, 24, 4, 8.0
    w = normal(rng, (n, k) if layout == "nk" else (k, n))
    bias = normal(rng, (n,))
    base = qnn.Linear.from_float(
        jax.device_put(w), jax.device_put(bias), layout=layout, precision=precision,
        group_size=16 if precision == "int4" else None,
    )  # fmt: skip
    adapted = qnn.lora(base, rank, alpha=alpha, key=jax.random.key(0))
    assert isinstance(adapted, qnn.LoRA) and adapted.a.shape == (rank, k)
    x = normal(rng, (5, k))
    run = call if jit else (lambda m, x: m(x))  # jit=False: eager, on purpose
    # b starts at zero: the adapted layer is the base
    np.testing.assert_array_equal(run(adapted, x), run(base, x))
    adapted = eqx.tree_at(
        lambda m: m.b, adapted, jax.device_put(normal(rng, (n, rank)))
    )
    a, b = np.asarray(adapted.a, np.float64), np.asarray(adapted.b, np.float64)
    wd = dense(w, precision, layout).astype(np.float64)
    scale = alpha / rank
    u = x @ a.T
    want = x @ wd.T + bias + scale * u @ b.T
    np.testing.assert_allclose(run(adapted, x), want, rtol=1e-5, atol=1e-5)
    g = normal(rng, (5, n))

    def loss(pair):
        m, x = pair
        return jnp.sum(m(x) * g)

    grad = eqx.filter_grad(loss)
    gm, gx = (eqx.filter_jit(grad) if jit else grad)((adapted, jax.device_put(x)))
    du = scale * g @ b
    np.testing.assert_allclose(gm.a, du.T @ x, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gm.b, scale * g.T @ u, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gx, g @ wd + du @ a, rtol=1e-4, atol=1e-5)
    # the frozen base gets no gradient
    assert not np.any(np.asarray(gm.base.scale))


def test_conv_adapter_against_numpy(rng):
    base = qnn.quantize(
        eqx.nn.Conv2d(3, 6, 3, stride=2, padding=1, key=jax.random.key(1))
    )
    adapted = qnn.lora(base, 2, key=jax.random.key(2))
    assert adapted.a.shape == (2, 3, 3, 3)
    adapted = eqx.tree_at(lambda m: m.b, adapted, jax.device_put(normal(rng, (6, 2))))
    x = normal(rng, (3, 9, 9))
    geometry = ((2, 2), ((1, 1), (1, 1)), (1, 1))
    low = ref.conv(x, np.asarray(adapted.a), *geometry)
    update = np.einsum("nr,r...->n...", np.asarray(adapted.b, np.float64), low)
    # eager, on purpose: this file's eager call of a Conv and its adapter
    np.testing.assert_allclose(
        adapted(x), np.asarray(base(x)) + update, rtol=1e-4, atol=1e-4
    )
    grouped = qnn.quantize(eqx.nn.Conv1d(4, 4, 3, groups=2, key=jax.random.key(0)))
    with pytest.raises(TypeError, match="groups 1"):
        qnn.lora(grouped, 2, key=jax.random.key(0))


def test_partition_trains_only_the_adapters_and_merge_folds_them(rng):
    mlp = eqx.nn.MLP(16, 4, 32, depth=2, key=jax.random.key(3))
    model = qnn.lora(qnn.quantize(mlp, precision="int4", group_size=16), 4,
                     key=jax.random.key(4))  # fmt: skip
    params, frozen = eqx.partition(model, qnn.lora_spec(model))
    leaves = jax.tree.leaves(params)
    assert len(leaves) == 2 * 3  # a and b of each of the three layers
    x, y = normal(rng, (64, 16)), normal(rng, (64, 4))
    optimizer = optax.adam(1e-2)
    state = optimizer.init(params)

    @eqx.filter_jit
    def step(params, state):
        def loss(p):
            m = eqx.combine(p, frozen)
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(30):
        params, state, value = step(params, state)
        losses.append(float(value))
    assert losses[-1] < 0.8 * losses[0]
    trained = eqx.combine(params, frozen)
    # the frozen int4 payloads are untouched
    np.testing.assert_array_equal(
        trained.layers[0].base.qvalue, model.layers[0].base.qvalue
    )
    merged = qnn.merge(trained)
    assert isinstance(merged.layers[0], qnn.Linear) and merged.layers[0].trainable
    # float weights W + (alpha / r) b a, re-quantized every call: near the adapted model
    ya, ym = vcall(trained, x), vcall(merged, x)
    assert rel_err(ym, ya) < 0.15
    assert qnn.freeze(merged).layers[0].qvalue.dtype == np.uint8


def test_where_and_errors():
    mlp = qnn.quantize(eqx.nn.MLP(8, 2, 8, depth=1, key=jax.random.key(0)))
    first = mlp.layers[0]
    adapted = qnn.lora(
        mlp, 2, where=lambda layer: layer is first, key=jax.random.key(0)
    )
    assert isinstance(adapted.layers[0], qnn.LoRA)
    assert isinstance(adapted.layers[1], qnn.Linear)
    with pytest.raises(ValueError, match="positive int rank"):
        qnn.lora(mlp, 0, key=jax.random.key(0))


# --- the other quantized kinds: ConvTranspose, Embedding, recurrent cells,
# SpectralConv. Each against NumPy on its dequantized weights plus the
# low-rank term computed in NumPy; gradients w.r.t. a and b against jax.grad
# of the float layer whose weights are W + (alpha / rank) b a in plain jnp;
# merge against the adapted layer.


def with_b(adapted, rng, scale=0.5):
    """The adapter with a nonzero b (lora starts it at zero)."""
    b = normal(rng, adapted.b.shape, scale)
    return eqx.tree_at(lambda m: m.b, adapted, jax.device_put(b))


@eqx.filter_jit
def grads_ab(fn, adapted, g):
    """d sum(fn(adapted) * g) / d (a, b) (jitted: ``fn`` is static)."""
    grads = eqx.filter_grad(lambda ab: jnp.sum(fn(eqx.tree_at(
        lambda m: (m.a, m.b), adapted, ab)) * g))((adapted.a, adapted.b))  # fmt: skip
    return grads


@eqx.filter_jit
def float_grads(float_fn, a, b, g):
    """d sum(float_fn(a, b) * g) / d (a, b) (jitted: ``float_fn`` is static)."""
    return jax.grad(lambda a, b: jnp.sum(float_fn(a, b) * g), argnums=(0, 1))(a, b)


def check_grads(fn, float_fn, adapted, g):
    """Gradients w.r.t. a and b of the adapted layer against those of
    ``float_fn(a, b)``, the float reference (plain jnp)."""
    got = grads_ab(fn, adapted, g)
    want = float_grads(float_fn, adapted.a, adapted.b, g)
    for x, y in zip(got, want, strict=True):
        top = float(np.abs(np.asarray(y)).max())
        assert top > 0
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4 * top)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_conv_transpose_adapter(rng, precision):
    from tests.qarray.test_nn_layers import conv_transpose

    layer = eqx.nn.ConvTranspose2d(
        4, 6, 3, stride=2, padding=1, output_padding=1, key=jax.random.key(5)
    )
    base = qnn.quantize(layer, precision=precision, group_size=4)
    assert isinstance(base, qnn.ConvTranspose)
    rank, alpha = 2, 3.0
    assert qnn.adapter_shapes(base, rank) == [((2, 4, 3, 3), (6, 2))]
    adapted = qnn.lora(base, rank, alpha=alpha, key=jax.random.key(6))
    x = normal(rng, (4, 5, 5))
    np.testing.assert_array_equal(call(adapted, x), call(base, x))
    adapted = with_b(adapted, rng)
    w = np.asarray(layer.weight)
    flat = w.reshape(6, -1)
    deq = ref.roundtrip4(flat, 4) if precision == "int4" else ref.roundtrip(flat)
    deq = deq.reshape(w.shape)
    geometry = ((2, 2), ((1, 1), (1, 1)), (1, 1), (1, 1))
    low = conv_transpose(x, np.asarray(adapted.a), *geometry)  # (rank, 10, 10)
    update = np.einsum("nr,r...->n...", np.asarray(adapted.b, np.float64), low)
    want = conv_transpose(x, deq, *geometry) + np.asarray(layer.bias).reshape(6, 1, 1)
    want = want + (alpha / rank) * update
    got = call(adapted, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    def float_fn(a, b):
        dense = jnp.asarray(deq) + (alpha / rank) * jnp.einsum("nr,r...->n...", b, a)
        return eqx.tree_at(lambda m: m.weight, layer, dense)(x)

    g = normal(rng, want.shape)
    check_grads(lambda m: m(x), float_fn, adapted, g)
    merged = qnn.merge(adapted)
    assert isinstance(merged, qnn.ConvTranspose) and merged.trainable
    assert merged.output_padding == (1, 1) and merged.precision == precision
    np.testing.assert_allclose(
        merged.weight,
        deq + (alpha / rank) * np.einsum("nr,r...->n...", adapted.b, adapted.a),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    assert rel_err(call(merged, x), got) < 0.1


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_embedding_adapter(rng, precision):
    table = normal(rng, (12, 8))
    base = qnn.quantize(
        eqx.nn.Embedding(weight=jax.device_put(table)),
        precision=precision,
        group_size=4,
    )
    rank, alpha = 3, 6.0
    assert qnn.adapter_shapes(base, rank) == [((3, 12), (8, 3))]
    adapted = qnn.lora(base, rank, alpha=alpha, key=jax.random.key(7))
    index = np.asarray([0, 5, 11, 5])
    np.testing.assert_array_equal(lookup(adapted, index), lookup(base, index))
    adapted = with_b(adapted, rng)
    deq = ref.roundtrip4(table, 4) if precision == "int4" else ref.roundtrip(table)
    a, b = np.asarray(adapted.a, np.float64), np.asarray(adapted.b, np.float64)
    # peft's embedding adapter: the rows of a^T gathered, then b^T
    want = deq[index] + (alpha / rank) * a.T[index] @ b.T
    got = lookup(adapted, index)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(call(adapted, 7), want[0] * 0 + deq[7] + (alpha / rank)
                               * a.T[7] @ b.T, rtol=1e-5, atol=1e-5)  # fmt: skip

    def float_fn(a, b):
        return (jnp.asarray(deq) + (alpha / rank) * (b @ a).T)[index]

    check_grads(lambda m: lookup(m, index), float_fn, adapted, normal(rng, want.shape))
    merged = qnn.merge(adapted)
    assert isinstance(merged, qnn.Embedding) and merged.trainable
    assert merged.precision == precision
    np.testing.assert_allclose(
        merged.weight, deq + (alpha / rank) * (b @ a).T, rtol=1e-5, atol=1e-6
    )
    assert rel_err(lookup(merged, index), got) < 0.1


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_recurrent_cell_adapters(rng, cell):
    """A cell's weight_ih and weight_hh each get an adapter (tree order:
    ih, hh); the cell runs them as ``W @ x``."""
    size, hidden, rank, alpha = 6, 4, 2, 2.0
    make = eqx.nn.GRUCell if cell == "gru" else eqx.nn.LSTMCell
    layer = make(size, hidden, key=jax.random.key(8))
    base = qnn.quantize(layer)
    gates = 3 if cell == "gru" else 4
    assert qnn.adapter_shapes(base, rank) == [
        ((rank, size), (gates * hidden, rank)),
        ((rank, hidden), (gates * hidden, rank)),
    ]
    adapted = qnn.lora(base, rank, alpha=alpha, key=jax.random.key(9))
    assert isinstance(adapted.weight_ih, qnn.LoRA)
    x, h, c = normal(rng, (size,)), normal(rng, (hidden,)), normal(rng, (hidden,))
    state = h if cell == "gru" else (h, c)
    np.testing.assert_array_equal(
        jax.tree.leaves(call(adapted, x, state)), jax.tree.leaves(call(base, x, state))
    )
    adapted = eqx.tree_at(
        lambda m: (m.weight_ih.b, m.weight_hh.b),
        adapted,
        (jax.device_put(normal(rng, (gates * hidden, rank))),
         jax.device_put(normal(rng, (gates * hidden, rank)))),
    )  # fmt: skip
    ws = []
    for name in ("weight_ih", "weight_hh"):
        lo = getattr(adapted, name)
        a, b = np.asarray(lo.a, np.float64), np.asarray(lo.b, np.float64)
        ws.append(
            ref.roundtrip(np.asarray(getattr(layer, name))) + (alpha / rank) * b @ a
        )
    bias = np.asarray(layer.bias)
    if cell == "gru":
        (ir, iz, in_), (hr, hz, hn) = (
            np.split(ws[0] @ x + bias, 3),
            np.split(ws[1] @ h, 3),
        )
        reset, update = _sigmoid(ir + hr), _sigmoid(iz + hz)
        new = np.tanh(in_ + reset * (hn + np.asarray(layer.bias_n)))
        want = [new + update * (h - new)]
    else:
        i, f, g, o = np.split(ws[0] @ x + ws[1] @ h + bias, 4)
        c_new = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
        want = [_sigmoid(o) * np.tanh(c_new), c_new]
    got = jax.tree.leaves(call(adapted, x, state))
    for u, v in zip(got, want, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)
    # gradients w.r.t. the input adapter: the float cell with W_ih + (alpha / r) b a
    hh = jax.device_put(ws[1].astype(np.float32))
    deq_ih = jax.device_put(ref.roundtrip(np.asarray(layer.weight_ih)))

    def float_fn(a, b):
        dense = deq_ih + (alpha / rank) * b @ a
        cell_ = eqx.tree_at(lambda m: (m.weight_ih, m.weight_hh), layer, (dense, hh))
        return jax.tree.leaves(cell_(x, state))[0]

    g = normal(rng, (hidden,))

    def through_cell(ih):
        return jax.tree.leaves(
            eqx.tree_at(lambda c: c.weight_ih, adapted, ih)(x, state)
        )[0]

    check_grads(through_cell, float_fn, adapted.weight_ih, g)
    merged = qnn.merge(adapted)
    assert isinstance(merged.weight_ih, qnn.Linear) and merged.weight_hh.trainable
    np.testing.assert_allclose(merged.weight_ih.weight, ws[0], rtol=1e-5, atol=1e-6)
    for u, v in zip(jax.tree.leaves(call(merged, x, state)), got, strict=True):
        np.testing.assert_allclose(u, v, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_spectral_adapter(rng, precision):
    """a (rank, C, *modes) and b (N, rank), complex (as real and imaginary
    parts): the kept modes through a then b, shared over modes."""
    c_in, c_out, modes, rank, alpha = 4, 3, (3, 2), 2, 4.0
    layer = qnn.SpectralConv(c_in, c_out, modes, key=jax.random.key(10))
    base = qnn.quantize(layer, precision=precision, group_size=4)
    assert qnn.adapter_shapes(base, rank) == [((2, 4, 3, 2, 2), (3, 2, 2))]
    adapted = qnn.lora(base, rank, alpha=alpha, key=jax.random.key(11))
    x = normal(rng, (2, c_in, 6, 5))  # a batch axis too
    # eager, as the layers are used (and one program each: XLA's CPU FFTs
    # jitted into different programs differ by an ulp)
    np.testing.assert_array_equal(adapted(x), base(x))
    adapted = with_b(adapted, rng, scale=0.3)
    a = np.asarray(adapted.a, np.float64)
    b = np.asarray(adapted.b, np.float64)
    a, b = a[..., 0] + 1j * a[..., 1], b[..., 0] + 1j * b[..., 1]
    deq = ref.spectral_roundtrip(np.asarray(layer.weight), precision, 4)
    # the low-rank term: the complex (C, N, *modes) weights sum_r b a (the
    # rank channels stay in Fourier space: no transform between a and b)
    low_rank = np.einsum("or,rixy->ioxy", b, a)
    assert np.linalg.matrix_rank(low_rank[:, :, 1, 1]) == rank
    update = ref.spectral_conv(x, low_rank, modes)
    want = ref.spectral_conv(x, deq, modes) + (alpha / rank) * update
    got = call(adapted, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    folded = deq + (alpha / rank) * low_rank
    np.testing.assert_allclose(update_of(adapted, x[0]), update[0], rtol=1e-4,
                               atol=1e-4 * np.abs(update).max())  # fmt: skip
    deq_parts = jax.device_put(np.stack([deq.real, deq.imag], -1).astype(np.float32))

    def float_fn(a, b):
        ac, bc = (
            jax.lax.complex(a[..., 0], a[..., 1]),
            jax.lax.complex(b[..., 0], b[..., 1]),
        )
        d = (alpha / rank) * jnp.einsum("or,rixy->ioxy", bc, ac)
        parts = deq_parts + jnp.stack([jnp.real(d), jnp.imag(d)], -1)
        return qnn.SpectralConv(c_in, c_out, modes, weight=parts)(x)

    check_grads(lambda m: m(x), float_fn, adapted, normal(rng, want.shape))
    merged = qnn.merge(adapted)
    assert isinstance(merged, qnn.SpectralConv) and merged.trainable
    assert merged.precision == precision
    np.testing.assert_allclose(
        merged.weight[..., 0] + 1j * merged.weight[..., 1], folded,
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    assert rel_err(call(merged, x), got) < 0.1


class _Every(eqx.Module):
    """One of each quantized kind."""

    up: eqx.nn.ConvTranspose1d
    embed: eqx.nn.Embedding
    gru: eqx.nn.GRUCell
    spectral: qnn.SpectralConv

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.up = eqx.nn.ConvTranspose1d(2, 3, 4, stride=2, padding=1, key=k[0])
        self.embed = eqx.nn.Embedding(5, 3, key=k[1])
        self.gru = eqx.nn.GRUCell(3, 3, key=k[2])
        self.spectral = qnn.SpectralConv(3, 2, 3, key=k[3])

    def __call__(self, x, index):
        h = self.up(x)  # (3, 16)
        h = self.gru(self.embed(index), h.mean(-1))
        return self.spectral(self.up(x) * h[:, None])


def test_every_kind_starts_as_the_base_and_trains_only_its_adapters(rng):
    base = qnn.quantize(_Every(jax.random.key(12)), precision="int8")
    model = qnn.lora(base, 2, key=jax.random.key(13))
    x = normal(rng, (2, 8))
    # eager, on purpose: this file's eager call of ConvTranspose, Embedding,
    # GRUCell and SpectralConv, each with its adapter and as its base
    np.testing.assert_array_equal(model(x, 3), base(x, 3))
    params, frozen = eqx.partition(model, qnn.lora_spec(model))
    shapes = qnn.adapter_shapes(base, 2)
    assert len(shapes) == 5  # up, embed, gru's two matrices, spectral
    assert [a.shape for a in jax.tree.leaves(params)] == [
        s for pair in shapes for s in pair
    ]
    g = eqx.filter_jit(
        eqx.filter_grad(lambda p: jnp.sum(eqx.combine(p, frozen)(x, 3) ** 2))
    )(params)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(g))
    # b starts at zero: only the b's move first
    nodes = jax.tree.leaves(g, is_leaf=lambda n: isinstance(n, qnn.LoRA))
    adapters = [n for n in nodes if isinstance(n, qnn.LoRA)]
    assert len(adapters) == 5  # the cell's two inside it
    assert all(np.abs(np.asarray(n.b)).max() > 0 for n in adapters)
