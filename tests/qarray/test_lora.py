"""qnn.lora (QLoRA adapters on quantized layers) and qnn.merge against NumPy:
values and gradients w.r.t. a, b and x, int8 and int4, with and without jit."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qarray.nn as qnn
from support import reference as ref


def normal(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


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
        jnp.asarray(w), jnp.asarray(bias), layout=layout, precision=precision,
        group_size=16 if precision == "int4" else None,
    )  # fmt: skip
    adapted = qnn.lora(base, rank, alpha=alpha, key=jax.random.key(0))
    assert isinstance(adapted, qnn.LoRA) and adapted.a.shape == (rank, k)
    x = normal(rng, (5, k))
    # b starts at zero: the adapted layer is the base
    np.testing.assert_array_equal(adapted(x), base(x))
    adapted = eqx.tree_at(lambda m: m.b, adapted, jnp.asarray(normal(rng, (n, rank))))
    a, b = np.asarray(adapted.a, np.float64), np.asarray(adapted.b, np.float64)
    wd = dense(w, precision, layout).astype(np.float64)
    scale = alpha / rank
    u = x @ a.T
    want = x @ wd.T + bias + scale * u @ b.T
    call = eqx.filter_jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    np.testing.assert_allclose(call(adapted, x), want, rtol=1e-5, atol=1e-5)
    g = normal(rng, (5, n))

    def loss(pair):
        m, x = pair
        return jnp.sum(m(x) * g)

    grad = eqx.filter_grad(loss)
    gm, gx = (eqx.filter_jit(grad) if jit else grad)((adapted, jnp.asarray(x)))
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
    adapted = eqx.tree_at(lambda m: m.b, adapted, jnp.asarray(normal(rng, (6, 2))))
    x = normal(rng, (3, 9, 9))
    geometry = ((2, 2), ((1, 1), (1, 1)), (1, 1))
    low = ref.conv(x, np.asarray(adapted.a), *geometry)
    update = np.einsum("nr,r...->n...", np.asarray(adapted.b, np.float64), low)
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
    ya, ym = jax.vmap(trained)(x), jax.vmap(merged)(x)
    assert float(jnp.linalg.norm(ya - ym) / jnp.linalg.norm(ya)) < 0.15
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
