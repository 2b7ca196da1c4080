"""qarray.jit: QArrays cross the jit boundary as their parts, values and
transformations unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray as qa
from support import reference as ref


def normal(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def test_int8_and_int4_arguments_in_a_pytree(rng):
    x, w = normal(rng, (3, 64)), normal(rng, (16, 64))
    weights = {"int8": qa.quantize(w), "int4": qa.quantize(w, bits=4, group_size=32)}

    @qa.jit
    def both(x, weights):
        return {k: qa.linear_q(x, q) for k, q in weights.items()}

    out = both(x, weights)
    qvalue, scale = ref.quantize(np.asarray(w))
    np.testing.assert_allclose(
        out["int8"], ref.linear_q(x, qvalue, scale), rtol=1e-5, atol=1e-5
    )
    w4 = ref.roundtrip4(np.asarray(w), 32)
    np.testing.assert_allclose(out["int4"], np.asarray(x) @ w4.T, rtol=1e-5, atol=1e-4)


def test_quantized_results_come_back_as_qarrays(rng):
    w = normal(rng, (8, 64))
    q8, q4 = qa.jit(lambda w: (qa.quantize(w), qa.quantize(w, bits=4, group_size=16)))(
        w
    )
    assert isinstance(q8, qa.QArray) and isinstance(q4, qa.QArray)
    qvalue, scale = ref.quantize(np.asarray(w))
    np.testing.assert_array_equal(q8.qvalue, qvalue)
    np.testing.assert_allclose(q8.scale, scale, rtol=1e-6)
    assert jax.typeof(q4) == jax.typeof(qa.quantize(w, bits=4, group_size=16))
    np.testing.assert_allclose(
        qa.dequantize(q4), ref.roundtrip4(np.asarray(w), 16), atol=1e-6
    )


def test_static_arguments_and_outer_transformations(rng):
    x, w = normal(rng, (4, 32)), normal(rng, (32, 8))
    qw = qa.quantize(w)
    product = qa.jit(qa.matmul_q, static_argnums=2)
    np.testing.assert_allclose(
        product(x, qw, "int8"), jax.jit(qa.matmul_q, static_argnums=2)(x, qw, "int8")
    )
    # grad w.r.t. x, and w.r.t. the QArray (a dense cotangent), through qa.jit
    g = jax.grad(lambda x, q: product(x, q, "float32").sum(), (0, 1))(x, qw)
    ones = np.ones((4, 8))
    dx, dw = ref.dense_vjp(np.asarray(x), ref.roundtrip(np.asarray(w)), ones)
    np.testing.assert_allclose(g[0], dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g[1], dw, rtol=1e-5, atol=1e-5)
    # vmap over a stacked QArray: a tracer crosses as jax.jit passes it
    stacked = qa.quantize(jnp.stack([w, 2 * w]))
    vmapped = jax.vmap(product, in_axes=(None, qa.QArraySpec(), None), axis_size=2)
    out = vmapped(x, stacked, "float32")
    np.testing.assert_allclose(out[1], 2 * out[0], rtol=1e-5, atol=1e-5)


def test_shapes_are_still_checked_at_trace_time(rng):
    with pytest.raises(TypeError):
        qa.jit(qa.matmul_q)(normal(rng, (2, 5)), qa.quantize(normal(rng, (6, 3))))


def _lowerings(events):
    """A listener that appends each XLA program lowered (compiled, or read
    from the persistent cache) to ``events``."""

    def listen(event, duration, **_):
        if "jaxpr_to_mlir_module" in event:
            events.append(event)

    return listen


@pytest.mark.parametrize(
    "bits", [8, pytest.param(4, marks=pytest.mark.cpu_breadth("the rule: bits=8's"))]
)
def test_an_eager_primitive_is_one_program(rng, bits):
    """Outside a trace each primitive runs as one compiled program per
    operand types (``_ops.CompiledWhenEager``), where op by op each of its
    lojax operations would be lowered and compiled apart (a few tenths of a
    second each on a TPU); the same call again lowers nothing; under
    jax.disable_jit it still runs, op by op."""
    w = rng.standard_normal((6, 46)).astype(np.float32)  # shapes no other test uses
    x = rng.standard_normal((3, 46)).astype(np.float32)
    group = 2 if bits == 4 else None
    events = []
    listener = _lowerings(events)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        rounds = []
        for _ in range(2):
            events.clear()
            qw = qa.quantize(w, bits, group)
            y = qa.linear_q(x, qw)
            dense = qa.dequantize(qw)
            rounds.append(len(events))
        assert rounds[1] == 0  # the second round: every program cached
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    events.clear()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        qa.dequantize(qa.quantize(w[:5], bits, group))  # a new shape: one each
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(events) == 2, events
    want = ref.roundtrip4(w, 2) if bits == 4 else ref.roundtrip(w)
    np.testing.assert_allclose(dense, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, x @ want.T, rtol=1e-5, atol=1e-5)
    with jax.disable_jit():  # op by op: each op compiles (int4's 40-odd)
        np.testing.assert_allclose(
            qa.dequantize(qa.quantize(w, bits, group)), want, rtol=1e-6, atol=1e-6
        )
