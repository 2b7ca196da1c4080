"""qarray.nn in bfloat16 and float16 (issue 60): every layer kind takes x in
a narrow float dtype and answers in it, against NumPy float64 references of
the same layer on its dequantized weights; ``qnn.quantize`` of a bfloat16
model (weights quantized from their bfloat16 values, scales float32, biases
and trainable weights in the model's dtype, gradients in each parameter's
dtype); ``QuantConfig.matmul_precision`` reaching the primitives.

The references multiply by the layer's own quantized weights (``dequantized``),
checked apart to be the rounding of the float weights' values: XLA's float32
division is within 1 ulp, not correctly rounded (``qarray._numerics.absmax``),
and with 8 significant bits a bfloat16 row often holds an entry exactly on a
rounding tie (``w / scale = k + 1/2``), which either neighbour may then take.

Tolerances. Round to nearest moves a value by at most U = eps / 2 of its
magnitude: U = 2**-8 for bfloat16 (8 significant bits), 2**-11 for float16.
The inputs are exact in x's dtype, the weights' dequantized values exact in
float32, and a layer computes in float32, rounding to x's dtype at known
points (a product's output, then the bias add; a cell's every elementwise
step). Where the reference has the values rounded, the bound is elementwise:
U times the sum of their magnitudes (``rounded``); through an MLP, each
layer's bound carried through the next layers' weights (their largest
absolute row sum: relu does not widen it). For the recurrent cells and
attention it is ``roundings * U * M`` (``assert_path``): the count of
roundings that reach an output (stated per test) times M, a bound on the
values rounded and on the factors that later multiply one (gates, tanh and
softmax values are below 1; the inputs are scaled to keep the rest below
M): every rounding's error reaching the output undamped, a worst case (the
errors seen are 1-2 U). On top, float32's own sums and FFTs: 1e-4 of the
output's largest value (~1e-6 on a CPU; a TPU's float32 FFT is coarser).
On a TPU the suite runs at ``jax_default_matmul_precision="highest"``
(tests/conftest.py), where the float32 sums are float32's.

Covers: qarray/nn/_linear.py, qarray/nn/_conv.py, qarray/nn/_embedding.py,
qarray/nn/_spectral.py, qarray/nn/_lora.py, qarray/nn/_config.py,
qarray/nn/_quantize.py, qarray/nn/_kinds.py, qarray/nn/_product.py
"""

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import qarray
import qarray.nn as qnn
from support import reference as ref
from tests.qarray.test_nn_layers import (
    conv_transpose,
    numpy_attention,
    numpy_gru,
    numpy_lstm,
)

pytestmark = pytest.mark.formulations

BF16, F16 = jnp.bfloat16, jnp.float16
FLOAT32_SLACK = 1e-4  # of the output's largest value: float32 sums, FFTs


def unit(dtype) -> float:
    """U, the most round to nearest moves a value, relative to it."""
    return float(jnp.finfo(dtype).eps) / 2


def f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


@eqx.filter_jit
def cast(model, dtype=BF16):
    """Every float leaf of ``model`` in ``dtype`` (how a user casts one;
    jitted: one compile per model rather than one per leaf)."""
    return jax.tree.map(
        lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model
    )


def narrow(rng, dtype, *shape, scale=1.0):
    """Normal values (times ``scale``), exact in ``dtype``: rounded by NumPy
    and put on the device as they are (``jnp.asarray`` of a NumPy array
    compiles a program per shape)."""
    return jax.device_put(np.asarray(rng.standard_normal(shape) * scale, dtype))


# The layers under test run through these module-level jitted helpers: each
# compiles once per model structure and shapes, cached across tests (run
# eagerly, every jnp op of a layer, and of its backward pass, is an XLA
# compile of its own, ~0.1-0.2 s each on a TPU, where the suite runs in one
# process). Kept eager on purpose, a bfloat16 x through: a Linear and a Conv
# (test_float32_layers_answer_in_x_dtype), an Embedding's and a GRUCell's
# adapters (test_lora_embedding_and_cell), a frozen Linear
# (test_lora_linear_against_numpy), merged and frozen Linear, Conv,
# ConvTranspose and SpectralConv (test_lora_answers_in_x_dtype[*-bf16]).
# tests/qarray/test_lora.py calls every kind with its adapter eagerly too.


def apply(m, *args):
    """A layer on its inputs (module level, as the functions below: a static
    argument of the jitted helpers, the same one in every test)."""
    return m(*args)


call = eqx.filter_jit(apply)


def lookups(m, index):
    """An embedding's rows at ``index``."""
    return jax.vmap(m)(index)


def batched(m, x):
    """A model on each row of x."""
    return jax.vmap(m)(x)


call_lookups, call_batched = eqx.filter_jit(lookups), eqx.filter_jit(batched)


def combined(adapters, base, x):
    """The model of its two partitions, on x."""
    return eqx.combine(adapters, base)(x)


@eqx.filter_jit
def loss_grads(run, model, x, g):
    """The gradients of ``loss_of(run, g)`` w.r.t. the model's and x's float
    arrays (None for an integer x)."""
    return eqx.filter_grad(lambda mx: loss_of(run, g)(*mx))((model, x))


@eqx.filter_jit
def sum_grads(run, power, model, *x):
    """The gradients of ``sum(run(model, *x) ** power)`` (in float32) w.r.t.
    the model's float arrays."""

    def loss(m):
        y = run(m, *x).astype(jnp.float32)
        return jnp.sum(y if power == 1 else y**power)

    return eqx.filter_grad(loss)(model)


def dequantized(layer, rows) -> np.ndarray:
    """The rows (float64) a quantized layer multiplies by (a trainable one's
    as it quantizes them), once they are NumPy's rounding of ``rows``, its
    float weights as quantized rows: scales within 1 ulp, levels one step
    apart only where an entry sits on a tie (module doc)."""
    qvalue, scale = (np.asarray(a) for a in qarray.unpack(layer.quantized()))
    rows = np.asarray(rows, np.float32)
    want_q, want_s = ref.quantize(rows)
    np.testing.assert_array_max_ulp(scale, want_s, maxulp=1)
    quotient = f64(rows) / f64(want_s)[..., None]
    tie = np.abs(np.abs(quotient - np.trunc(quotient)) - 0.5) < 1e-4
    step = np.abs(qvalue.astype(np.int16) - want_q)
    assert np.all(step <= 1) and np.all(tie[step > 0]), "not the rounding of w"
    return f64(ref.dequantize(qvalue, scale))


def assert_rounded(got, want, dtype, *rounded):
    """``got`` in ``dtype`` within one rounding to it of each float64 value
    in ``rounded`` (arrays, or a scalar bound on magnitudes) of ``want``."""
    assert got.dtype == dtype, f"answered in {got.dtype}, not {np.dtype(dtype)}"
    want = f64(want)
    bound = unit(dtype) * sum(np.abs(f64(r)) for r in rounded)
    bound = bound + FLOAT32_SLACK * np.abs(want).max()
    err = np.abs(f64(got) - want)
    assert np.all(err <= bound), f"max error {err.max():.3g}, bound {bound.max():.3g}"


def assert_path(got, want, dtype, roundings: int, magnitude: float):
    """``got`` within ``roundings`` roundings of values up to ``magnitude``
    (module doc)."""
    assert_rounded(got, want, dtype, roundings * magnitude)


def grad_dtypes_match(model, grads) -> None:
    """Every array leaf's gradient in that leaf's dtype."""
    for leaf, g in zip(
        jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)),
        jax.tree.leaves(grads),
        strict=True,
    ):
        assert g.dtype == leaf.dtype, (g.dtype, leaf.dtype, leaf.shape)


def loss_of(call, g):
    """A float32 loss of a layer's output against ``g``."""
    return lambda m, *x: jnp.sum(call(m, *x).astype(jnp.float32) * g)


# ---------------------------------------------------------------- Linear


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("trainable", [False, True], ids=["stored", "trainable"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_linear(rng, dtype, trainable, layout):
    """Quantized from the weights' own values (scales float32), answered in
    x's dtype: the product rounded, then the bias added (two roundings);
    x's cotangent in its dtype: ``g W^T`` rounded once."""
    k, n = 24, 8
    w = narrow(rng, dtype, *((n, k) if layout == "nk" else (k, n)))
    bias, x = narrow(rng, dtype, n), narrow(rng, dtype, 3, k)
    layer = qnn.Linear.from_float(w, bias, layout=layout, trainable=trainable)
    assert layer.bias.dtype == dtype
    if trainable:
        assert layer.weight.dtype == dtype
    else:
        assert layer.scale.dtype == np.float32
    dense = dequantized(layer, w)
    dense = dense.T if layout == "nk" else dense  # (K, N)
    product = f64(x) @ dense
    want = product + f64(bias)
    got = call(layer, x)
    assert_rounded(got, want, dtype, product, want)

    g = narrow(rng, dtype, 3, n)
    grads, gx = loss_grads(apply, layer, x, g)
    gx_want = f64(g) @ dense.T
    assert_rounded(gx, gx_want, dtype, gx_want)
    grad_dtypes_match(layer, grads)
    if trainable:  # straight-through: x^T g, laid out like the weights
        gw = f64(x).T @ f64(g)
        gw = gw.T if layout == "nk" else gw
        assert_rounded(grads.weight, gw, dtype, gw)


@pytest.mark.parametrize("precision", ["int8", "float32"])
def test_float32_layers_answer_in_x_dtype(rng, precision):
    """A float32 model's layers (weights and biases float32) called with a
    bfloat16 x answer bfloat16, not promoted to float32: the product, the
    bias (rounded to x's dtype) and their sum each rounded once. A float
    layer of a mixed model (``precision="float32"``) too."""
    w, bias = narrow(rng, jnp.float32, 4, 6), narrow(rng, jnp.float32, 4)
    layer = qnn.Linear.from_float(w, bias, precision=precision)
    x = narrow(rng, BF16, 2, 6)
    dense = f64(w) if precision == "float32" else dequantized(layer, w)
    product = f64(x) @ dense.T
    want = product + f64(bias)
    # eager, on purpose (as the Conv below): the module doc's eager calls
    assert_rounded(layer(x), want, BF16, product, bias, want)
    conv = qnn.quantize(eqx.nn.Conv1d(2, 3, 3, key=jax.random.key(0)))
    assert conv.bias.dtype == np.float32
    assert conv(narrow(rng, BF16, 2, 5)).dtype == BF16


# ------------------------------------------------------------ convolutions


@pytest.mark.parametrize("trainable", [False, True], ids=["stored", "trainable"])
def test_conv(rng, trainable):
    layer = eqx.nn.Conv2d(3, 4, 3, padding=1, dilation=(1, 2), key=jax.random.key(0))
    layer = cast(layer)
    quantized = qnn.quantize(layer, trainable=trainable)
    assert isinstance(quantized, qnn.Conv)
    assert quantized.bias.dtype == BF16
    w = np.asarray(layer.weight)
    dense = dequantized(quantized, w.reshape(4, -1)).reshape(w.shape)
    x = narrow(rng, BF16, 3, 6, 7)
    product = ref.conv(x, dense, (1, 1), [(1, 1), (1, 1)], (1, 2))
    want = product + f64(layer.bias).reshape(-1, 1, 1)
    got = call(quantized, x)
    assert_rounded(got, want, BF16, product, want)
    g = narrow(rng, BF16, *want.shape)
    grads, gx = loss_grads(apply, quantized, x, g)
    gx_want, _ = ref.conv_vjp(x, dense, g, (1, 1), [(1, 1), (1, 1)], (1, 2))
    assert_rounded(gx, gx_want, BF16, gx_want)
    grad_dtypes_match(quantized, grads)


def test_conv_transpose(rng):
    layer = cast(
        eqx.nn.ConvTranspose2d(
            4, 3, 3, stride=2, padding=1, output_padding=1, key=jax.random.key(1)
        )
    )
    quantized = qnn.quantize(layer)
    assert isinstance(quantized, qnn.ConvTranspose)
    w = np.asarray(layer.weight)
    dense = dequantized(quantized, w.reshape(3, -1)).reshape(w.shape)
    x = narrow(rng, BF16, 4, 4, 5)
    product = conv_transpose(x, dense, (2, 2), [(1, 1), (1, 1)], (1, 1), (1, 1))
    want = product + f64(layer.bias).reshape(-1, 1, 1)
    got = call(quantized, x)
    assert_rounded(got, want, BF16, product, want)


# -------------------------------------------------------------- Embedding


@pytest.mark.parametrize("trainable", [False, True], ids=["stored", "trainable"])
def test_embedding_answers_in_its_table_dtype(rng, trainable):
    """A bfloat16 table's lookups are bfloat16, stored or trainable: the
    dequantized row rounded once."""
    layer = eqx.nn.Embedding(10, 6, key=jax.random.key(2), dtype=BF16)
    quantized = qnn.quantize(layer, trainable=trainable)
    assert quantized.dtype == "bfloat16"
    index = np.asarray([3, 0, 3])
    rows = dequantized(quantized, layer.weight)[index]
    got = call_lookups(quantized, index)
    assert_rounded(got, rows, BF16, rows)
    assert qnn.freeze(quantized).dtype == "bfloat16"
    g = narrow(rng, BF16, 3, 6)
    grads, _ = loss_grads(lookups, quantized, index, g)
    grad_dtypes_match(quantized, grads)


# --------------------------------------------------- cells and attention


@pytest.mark.parametrize("trainable", [False, True], ids=["stored", "trainable"])
def test_recurrent_cells(rng, trainable):
    """At most 14 roundings reach a GRU output (2 products, the bias, 2
    gates' sums and sigmoids, the candidate's bias sum, product, sum and
    tanh, the blend's difference, product and sum), 13 an LSTM's (2
    products, their sum, the bias, the 4 gates' nonlinearities, the cell's
    2 products and sum, its tanh, the output product); with inputs and
    states of half a normal's scale, pre-activations and states stay below
    2.5."""
    k1, k2 = jax.random.split(jax.random.key(3))
    gru = eqx.nn.GRUCell(6, 8, key=k1, dtype=BF16)
    lstm = eqx.nn.LSTMCell(6, 8, key=k2, dtype=BF16)
    qgru = qnn.quantize(gru, trainable=trainable)
    qlstm = qnn.quantize(lstm, trainable=trainable)
    assert qgru.bias.dtype == BF16 and isinstance(qgru.weight_ih, qnn.Linear)
    x, h, c = (narrow(rng, BF16, n, scale=0.5) for n in (6, 8, 8))
    got = call(qgru, x, h)
    assert_path(got, numpy_gru(gru, f64(x), f64(h)), BF16, 14, 2.5)
    got_h, got_c = call(qlstm, x, (h, c))
    want_h, want_c = numpy_lstm(lstm, f64(x), f64(h), f64(c))
    assert_path(got_h, want_h, BF16, 13, 2.5)
    assert_path(got_c, want_c, BF16, 13, 2.5)
    grads = sum_grads(apply, 1, qgru, x, h)
    grad_dtypes_match(qgru, grads)


def test_multihead_attention_through_its_linears(rng):
    """At most 8 roundings reach an output of attention (the query, key and
    value projections, the query's scaling, a logit, a softmax weight (the
    softmax runs in float32: equinox's choice), the weighted sum, the
    output projection); inputs of half a normal's scale keep the
    projections below 2."""
    mha = eqx.nn.MultiheadAttention(2, 16, key=jax.random.key(4), dtype=BF16)
    quantized = qnn.quantize(mha)
    assert isinstance(quantized.query_proj, qnn.Linear)
    x = narrow(rng, BF16, 5, 16, scale=0.5)
    got = call(quantized, x, x, x)
    assert_path(got, numpy_attention(mha, f64(x)), BF16, 8, 2.0)


# ----------------------------------------------------------- SpectralConv


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_spectral_conv(rng, precision):
    """The FFTs and the mixing run in float32 (complex64), the output rounded
    once to x's dtype."""
    layer = qnn.SpectralConv(3, 4, (4, 3), key=jax.random.key(5), dtype=BF16)
    assert layer.weight.dtype == BF16
    quantized = qnn.quantize(layer, precision=precision)
    parts = f64(layer.weight)
    if precision != "float32":
        # rows (out * prod(modes), 2 in): a mode's real and imaginary parts
        moved = np.moveaxis(parts, 0, -2)  # (out, *modes, in, 2)
        rows = dequantized(quantized, moved.reshape(-1, 2 * 3))
        parts = np.moveaxis(rows.reshape(moved.shape), -2, 0)
    w = parts[..., 0] + 1j * parts[..., 1]
    x = narrow(rng, BF16, 3, 8, 6)
    want = ref.spectral_conv(f64(x), w, (4, 3))
    got = call(quantized, x)
    assert_rounded(got, want, BF16, want)
    trainable = qnn.quantize(layer, precision="int8", trainable=True)
    grads = sum_grads(apply, 1, trainable, x)
    grad_dtypes_match(trainable, grads)


# ------------------------------------------------------------------- LoRA

ADAPTED = {  # a float bfloat16 layer, its input
    "linear": (lambda k: eqx.nn.Linear(8, 4, key=k, dtype=BF16), (8,)),
    "conv": (lambda k: eqx.nn.Conv1d(3, 4, 3, key=k, dtype=BF16), (3, 7)),
    "conv_transpose": (
        lambda k: eqx.nn.ConvTranspose1d(3, 4, 3, stride=2, key=k, dtype=BF16),
        (3, 5),
    ),
    "spectral": (lambda k: qnn.SpectralConv(3, 4, (3,), key=k, dtype=BF16), (3, 8)),
}


@pytest.mark.parametrize("adapter_dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind", list(ADAPTED))
def test_lora_answers_in_x_dtype(rng, kind, adapter_dtype):
    """Adapters of either dtype on a bfloat16 model: the output in x's dtype,
    a and b's gradients in theirs; merged and frozen, still x's dtype."""
    make, shape = ADAPTED[kind]
    base = qnn.quantize(make(jax.random.key(6)))
    model = qnn.lora(base, 2, key=jax.random.key(7), dtype=adapter_dtype)
    assert model.a.dtype == adapter_dtype
    x = narrow(rng, BF16, *shape)
    assert call(model, x).dtype == BF16
    adapters, base = eqx.partition(model, qnn.lora_spec(model))
    grads = sum_grads(combined, 1, adapters, base, x)
    assert grads.a.dtype == grads.b.dtype == adapter_dtype
    # eager with bfloat16 adapters, on purpose (the module doc's eager calls)
    run = apply if adapter_dtype == BF16 else call
    assert run(qnn.freeze(qnn.merge(model)), x).dtype == BF16


def test_lora_embedding_and_cell(rng):
    """An embedding's adapter answers in its table's dtype; a cell's
    matrices' adapters keep its state's."""
    emb = eqx.nn.Embedding(10, 6, key=jax.random.key(8), dtype=BF16)
    adapted = qnn.lora(qnn.quantize(emb), 2, key=jax.random.key(9))
    assert adapted(jnp.asarray(4)).dtype == BF16
    cell = eqx.nn.GRUCell(6, 8, key=jax.random.key(10), dtype=BF16)
    adapted = qnn.lora(qnn.quantize(cell), 2, key=jax.random.key(11))
    assert isinstance(adapted.weight_ih, qnn.LoRA)
    assert adapted(narrow(rng, BF16, 6), narrow(rng, BF16, 8)).dtype == BF16


def test_lora_linear_against_numpy(rng):
    """``base(x) + (alpha / rank) (x a^T) b^T``: the base's product and bias
    each rounded (two roundings), then the sum with the float32 adapter's
    term (one more); merged: ``W + (alpha / rank) b a``."""
    layer = eqx.nn.Linear(8, 4, key=jax.random.key(12), dtype=BF16)
    model = qnn.lora(qnn.quantize(layer), 2, alpha=3.0, key=jax.random.key(13))
    b = np.asarray(rng.standard_normal((4, 2)), np.float32)
    model = eqx.tree_at(lambda m: m.b, model, jax.device_put(b))
    x = narrow(rng, BF16, 3, 8)
    dense = dequantized(model.base, layer.weight)
    product = f64(x) @ dense.T
    base = product + f64(layer.bias)
    delta = 1.5 * f64(model.b) @ f64(model.a)
    want = base + f64(x) @ delta.T
    got = call(model, x)
    assert_rounded(got, want, BF16, product, base, want)
    merged = qnn.merge(model)
    np.testing.assert_allclose(merged.weight, dense + delta, rtol=1e-6, atol=1e-6)
    assert merged.bias.dtype == BF16
    frozen = qnn.freeze(merged)
    dense = dequantized(frozen, merged.weight)
    product = f64(x) @ dense.T
    want = product + f64(layer.bias)
    assert_rounded(frozen(x), want, BF16, product, want)  # eager, on purpose


# ------------------------------------------------ a bfloat16 model, QAT


def test_quantize_a_bfloat16_model(rng):
    """An MLP built in bfloat16 and one cast to it quantize alike: int8
    weights from the bfloat16 values, float32 scales, bfloat16 biases;
    trainable: bfloat16 weights, gradients in bfloat16, and ``freeze``
    exports the stored model's weights."""
    built = eqx.nn.MLP(8, 3, 16, 2, key=jax.random.key(14), dtype=BF16)
    casted = cast(eqx.nn.MLP(8, 3, 16, 2, key=jax.random.key(14)))
    x = narrow(rng, BF16, 4, 8)
    run = call_batched
    for model in (built, casted):
        stored = qnn.quantize(model)
        # the magnitudes rounded: each layer's product and bias sum
        # (``test_linear``), the earlier layers' carried through its weights
        h, rounded = f64(x), 0.0
        for i, (float_layer, layer) in enumerate(
            zip(model.layers, stored.layers, strict=True)
        ):
            assert layer.scale.dtype == np.float32 and layer.bias.dtype == BF16
            dense = dequantized(layer, float_layer.weight)
            product = h @ dense.T
            h = product + f64(layer.bias)
            rounded = rounded * np.abs(dense).sum(1).max()
            rounded += np.abs(product).max() + np.abs(h).max()
            h = h if i == len(model.layers) - 1 else np.maximum(h, 0)
        assert_rounded(run(stored, x), h, BF16, rounded)

        qat = qnn.quantize(model, trainable=True)
        assert all(layer.weight.dtype == BF16 for layer in qat.layers)
        grads = sum_grads(batched, 2, qat, x)
        grad_dtypes_match(qat, grads)
        assert all(np.all(np.isfinite(f64(g))) for g in jax.tree.leaves(grads))
        assert_rounded(run(qat, x), h, BF16, rounded)
        exported = qnn.freeze(qat)
        assert exported.layers[0].weight is None
        np.testing.assert_array_equal(
            exported.layers[0].qvalue, stored.layers[0].qvalue
        )
        assert_rounded(run(exported, x), h, BF16, rounded)


# -------------------------------------------------------- matmul_precision


def _precisions(jaxpr) -> dict[str, set]:
    """{primitive name: the precisions its equations carry}, inner jaxprs
    included (a hi primitive's own params, a dot's ``precision``)."""
    found: dict[str, set] = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            prim = eqn.params.get("_prim")
            params = prim.params if prim is not None else eqn.params
            name = type(prim).__name__ if prim is not None else eqn.primitive.name
            if "precision" in params:
                found.setdefault(name, set()).add(params["precision"])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return found


class Mixed(eqx.Module):
    """One of each product: a Linear, a convolution, a spectral layer."""

    conv: eqx.nn.Conv1d
    spectral: qnn.SpectralConv
    linear: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv1d(2, 3, 3, padding=1, key=k1)
        self.spectral = qnn.SpectralConv(3, 3, (3,), key=k2)
        self.linear = eqx.nn.Linear(8, 4, key=k3)

    def __call__(self, x):
        h = self.spectral(self.conv(x))
        return jax.vmap(self.linear)(h)


@pytest.mark.parametrize("trainable", [False, True], ids=["stored", "trainable"])
def test_matmul_precision_reaches_the_primitives(rng, trainable):
    model = Mixed(jax.random.key(15))
    x = narrow(rng, BF16, 2, 8)
    config = qnn.QuantConfig(matmul_precision="highest")
    quantized = qnn.quantize(model, config, trainable=trainable)
    for layer in (quantized.conv, quantized.spectral, quantized.linear):
        assert layer.matmul_precision == "highest"
    hash(jax.tree.structure(quantized))  # static fields hash
    jaxpr = jax.make_jaxpr(lambda m, x: m(x))(quantized, x)
    found = _precisions(jaxpr)
    highest = jax.lax.Precision.HIGHEST
    assert found["LinearQ"] == {highest} and found["ConvQ"] == {highest}
    assert found["dot_general"] == {(highest, highest)}  # the spectral mixing
    assert "LinearQ[activations=float32 precision=HIGHEST]" in str(jaxpr)
    # the default: JAX's default_matmul_precision, whatever it is
    default = _precisions(jax.make_jaxpr(lambda m, x: m(x))(qnn.quantize(model), x))
    assert default["LinearQ"] == {None} and default["ConvQ"] == {None}
    # merged adapters keep it
    adapted = qnn.merge(qnn.lora(qnn.quantize(model, config), 1, key=jax.random.key(0)))
    assert adapted.linear.matmul_precision == "highest"


@pytest.mark.parametrize("bad", ["fast", 3, ("high",)])
def test_matmul_precision_is_checked(bad):
    with pytest.raises(ValueError, match="QuantConfig: matmul_precision requires"):
        qnn.QuantConfig(matmul_precision=bad)
    with pytest.raises(ValueError, match="matmul_precision"):
        qnn.quantize(eqx.nn.Linear(2, 2, key=jax.random.key(0)), matmul_precision=bad)
    with pytest.raises(ValueError, match="Linear: matmul_precision"):
        qnn.Linear(jnp.ones((2, 2)), matmul_precision=bad)


def test_matmul_precision_values_kept_as_given():
    """As jnp.dot takes them; a list becomes a tuple (the config is frozen
    and hashed, the layers' field is static)."""
    highest = jax.lax.Precision.HIGHEST
    for value in (None, "default", "high", highest, ("high", "highest")):
        assert qnn.QuantConfig(matmul_precision=value).matmul_precision == value
    config = qnn.QuantConfig(matmul_precision=["high", highest])
    assert config.matmul_precision == ("high", highest)
    hash(config)
    layer = qnn.Linear.from_float(jnp.ones((2, 3)), matmul_precision=["high", "high"])
    assert layer.matmul_precision == ("high", "high")


def test_every_quantized_layer_carries_matmul_precision(rng):
    """Calibrated layers (AWQ: a channel scale), a cell's matrices and an
    embedding take it from the config too."""
    config = qnn.QuantConfig(method="awq", matmul_precision="high")
    mlp = eqx.nn.MLP(8, 3, 16, 1, key=jax.random.key(16))
    data = jax.device_put(np.asarray(rng.standard_normal((32, 8)), np.float32))
    calibrated = qnn.quantize(mlp, config, data=data)
    assert all(layer.channel_scale is not None for layer in calibrated.layers)
    assert {layer.matmul_precision for layer in calibrated.layers} == {"high"}
    cell = eqx.nn.GRUCell(4, 6, key=jax.random.key(17))
    cell = qnn.quantize(cell, matmul_precision="high")
    assert cell.weight_ih.matmul_precision == cell.weight_hh.matmul_precision == "high"
    table = eqx.nn.Embedding(5, 4, key=jax.random.key(18))
    assert qnn.quantize(table, matmul_precision="high").matmul_precision == "high"
