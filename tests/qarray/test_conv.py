"""conv_q beyond the transform table (tests/qarray/test_transforms.py holds
its jit, grad, vjp, jvp, linearize, jacobian, hessian and checkpoint cases):
realistic shapes, the formulations, vmap, scan, sharding and errors, against
the float64 references in support/reference.py.

Covers: qarray/_conv.py"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray as qa
from qarray import _ffi
from qarray._conv import CONV_STRATEGIES, ConvQ
from support import accuracy
from support import reference as ref
from support.breadth import breadth_param

# rerun on XLA's formulations alone where the kernels ran (make test)
pytestmark = pytest.mark.formulations

RTOL = ATOL = 2e-4
P = jax.P


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def quantized(rng, out, per_out):
    w = normal(rng, (out, per_out)) * 0.2
    return w, qa.quantize(jnp.asarray(w))


GEOMETRIES = [
    ((4, 16, 32, 32), 32, (3, 3), {"padding": "SAME"}, ((1, 1), (1, 1))),
    (
        (2, 8, 33, 31),
        16,
        (5, 3),
        {"padding": ((2, 2), (0, 1)), "window_strides": (2, 3)},
        ((2, 2), (0, 1)),
    ),
    (
        (3, 12, 64),
        12,
        (3,),
        {"padding": "VALID", "rhs_dilation": (2,), "feature_group_count": 3},
        ((0, 0),),
    ),
    ((2, 4, 8, 8, 8), 6, (3, 3, 3), {"padding": 1}, ((1, 1),) * 3),
    # more than 16 channels in and 32 out, neither a multiple of 8 (the CPU
    # kernel's blocks of 16 channels and 8 x 8 output transposes)
    ((2, 20, 11, 21), 44, (3, 3), {"padding": "SAME"}, ((1, 1), (1, 1))),
]
GEOMETRY_IDS = ["2d-same", "2d-strided", "1d-grouped-dilated", "3d", "2d-wide"]


# on a TPU a 3-D convolution compiles for seconds: its int8 case stands for
# both there; 2d-wide sizes the CPU kernel's blocks
_BREADTH = {
    "3d-float32": "3d-int8's geometry",
    "2d-wide-float32": "the CPU kernel's blocks",
    "2d-wide-int8": "the CPU kernel's blocks",
}


@pytest.mark.parametrize(
    "x_shape, out, kernel, conv, pads, activations",
    [
        breadth_param(
            *geometry,
            activations,
            id=f"{name}-{activations}",
            reason=_BREADTH.get(f"{name}-{activations}"),
        )
        for activations in ("float32", "int8")
        for geometry, name in zip(GEOMETRIES, GEOMETRY_IDS, strict=True)
    ],
)
def test_matches_the_reference(rng, x_shape, out, kernel, conv, pads, activations):
    groups = conv.get("feature_group_count", 1)
    x = normal(rng, x_shape)
    w, qw = quantized(rng, out, x_shape[1] // groups * int(np.prod(kernel)))
    geometry = (
        conv.get("window_strides", (1,) * len(kernel)),
        pads,
        conv.get("rhs_dilation", (1,) * len(kernel)),
        groups,
    )
    want = ref.conv_q(x, *ref.quantize(w), kernel, *geometry, activations)
    f = jax.jit(lambda x: qa.conv_q(x, qw, kernel, activations=activations, **conv))
    np.testing.assert_allclose(f(x), want, rtol=RTOL, atol=ATOL)
    # an unbatched example is the batched one's row
    np.testing.assert_allclose(f(x[1]), want[1], rtol=RTOL, atol=ATOL)


TRANSPOSED = [  # (x shape, out, kernel, lhs_dilation, pads, groups)
    ((2, 6, 7), 4, (3,), (2,), ((2, 3),), 1),
    ((2, 4, 5, 6), 6, (3, 2), (2, 3), ((1, 2), (1, 1)), 2),
]


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("x_shape, out, kernel, lhs, pads, groups", TRANSPOSED)
def test_lhs_dilation_matches_the_reference(
    rng, x_shape, out, kernel, lhs, pads, groups, activations
):
    """lhs_dilation (a transposed convolution's stride): the convolution of
    the input spread out with zeros, values and gradients w.r.t. x."""
    x = normal(rng, x_shape)
    w, qw = quantized(rng, out, x_shape[1] // groups * int(np.prod(kernel)))
    conv = {
        "padding": pads,
        "lhs_dilation": lhs,
        "feature_group_count": groups,
        "activations": activations,
    }
    spread = ref.lhs_dilate(x, lhs)
    ones = (1,) * len(kernel)
    want = ref.conv_q(
        spread, *ref.quantize(w), kernel, ones, pads, ones, groups, activations
    )
    f = jax.jit(lambda x: qa.conv_q(x, qw, kernel, **conv))
    np.testing.assert_allclose(f(x), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(f(x[0]), want[0], rtol=RTOL, atol=ATOL)
    g = normal(rng, want.shape)
    dense = ref.dequantize(*ref.quantize(w)).reshape(out, -1, *kernel)
    gx, gw = ref.conv_vjp(spread, dense, g, ones, pads, ones, groups)
    got_x, got_w = jax.jit(
        jax.grad(lambda x, q: jnp.sum(qa.conv_q(x, q, kernel, **conv) * g), (0, 1))
    )(x, qw)
    np.testing.assert_allclose(
        got_x,
        gx[(Ellipsis, *(slice(None, None, step) for step in lhs))],
        rtol=RTOL,
        atol=ATOL,
    )
    np.testing.assert_allclose(got_w, gw.reshape(out, -1), rtol=RTOL, atol=ATOL)


def test_weight_only_is_the_dense_convolution_of_the_dequantized_weights(rng):
    """The DESIGN.md definition, with lax as the second reference."""
    x = normal(rng, (2, 3, 10, 10))
    _, qw = quantized(rng, 5, 3 * 9)
    dense = qa.dequantize(qw).reshape(5, 3, 3, 3)
    want = jax.lax.conv_general_dilated(
        x, dense, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )
    got = qa.conv_q(x, qw, (3, 3), padding="SAME")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(s, marks=pytest.mark.cpu_only("qarray's C++ kernels"))
        if s == "kernel"
        else s
        for s in CONV_STRATEGIES
    ],
)
def test_int8_formulations_agree(rng, strategy):
    if strategy == "kernel" and not _ffi.available():
        pytest.skip(f"CPU kernels: {_ffi.status()}")
    x = normal(rng, (2, 6, 9, 9))
    w, qw = quantized(rng, 4, 6 * 9)
    prim = ConvQ(jax.typeof(x), jax.typeof(qw), (3, 3), activations="int8")
    got = jax.jit(lambda x, q, s: prim.forward(x, q, s, strategy))(
        x, qw.qvalue, qw.scale
    )
    want = ref.conv_q(
        x, *ref.quantize(w), (3, 3), (1, 1), ((0, 0),) * 2, (1, 1), 1, "int8"
    )
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_int8_activations_are_quantized_per_example(rng):
    """Scaling one example changes only that example's result."""
    x = normal(rng, (2, 3, 6, 6))
    _, qw = quantized(rng, 4, 27)
    f = jax.jit(lambda x: qa.conv_q(x, qw, (3, 3), activations="int8"))
    base = f(x)
    scaled = f(x * np.array([1.0, 100.0], np.float32)[:, None, None, None])
    np.testing.assert_allclose(scaled[0], base[0], rtol=1e-6)
    np.testing.assert_allclose(scaled[1], 100 * base[1], rtol=1e-5)


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("x_batched", [False, True])
def test_vmap_over_examples(rng, activations, x_batched):
    """vmap over unbatched examples (eqx.nn.Conv's convention) and over a
    batch of batches: both are the batched convolution."""
    x = normal(rng, (3, 2, 4, 7, 7) if x_batched else (3, 4, 7, 7))
    w, qw = quantized(rng, 5, 4 * 9)
    f = jax.jit(jax.vmap(lambda x: qa.conv_q(x, qw, (3, 3), activations=activations)))
    flat = x.reshape(-1, *x.shape[-3:])
    geometry = ((1, 1), ((0, 0),) * 2, (1, 1), 1)
    want = ref.conv_q(flat, *ref.quantize(w), (3, 3), *geometry, activations)
    np.testing.assert_allclose(
        f(x), want.reshape(*x.shape[:-3], *want.shape[1:]), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("x_batched", [False, True])
def test_vmap_over_stacked_weights(rng, x_batched):
    ws = normal(rng, (3, 5, 2 * 9))
    qws = jax.vmap(qa.quantize, out_axes=qa.QArraySpec())(jnp.asarray(ws))
    x = normal(rng, (3, 2, 6, 6) if x_batched else (2, 6, 6))
    in_x = 0 if x_batched else None
    got = jax.vmap(
        lambda x, q: qa.conv_q(x, q, (3, 3)),
        in_axes=(in_x, qa.QArraySpec()),
        axis_size=3,
    )(x, qws)
    geometry = ((1, 1), ((0, 0),) * 2, (1, 1), 1)
    want = [
        ref.conv_q(x[i] if x_batched else x, *ref.quantize(ws[i]), (3, 3), *geometry)
        for i in range(3)
    ]
    np.testing.assert_allclose(got, np.stack(want), rtol=RTOL, atol=ATOL)


def test_vmap_of_grad(rng):
    x = normal(rng, (4, 2, 6, 6))
    w = normal(rng, (3, 2 * 9)) * 0.2
    geometry = ((1, 1), ((1, 1),) * 2, (1, 1), 1)
    dense = ref.roundtrip(w).reshape(3, 2, 3, 3)

    def loss(x, w):
        return jnp.sum(jnp.sin(qa.conv_q(x, qa.quantize(w), (3, 3), padding="SAME")))

    gxs, gws = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None))(x, w)
    for xi, gx, gw in zip(x, gxs, gws, strict=True):
        g = np.cos(ref.conv(xi, dense, *geometry))
        want_gx, want_gw = ref.conv_vjp(xi, dense, g, *geometry)
        np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(gw, want_gw.reshape(w.shape), rtol=RTOL, atol=ATOL)


def scanned_conv_loss(x, ws):
    """sum(h**2) after three same-shape tanh conv layers, the stacked
    weights ``ws (3, out, C * 9)`` quantized as one QArray and scanned."""
    qws = jax.vmap(qa.quantize, out_axes=qa.QArraySpec())(ws)

    def layer(h, q):
        return jnp.tanh(qa.conv_q(h, q, (3, 3), padding="SAME")), None

    h, _ = jax.lax.scan(layer, x, qws, length=3)
    return jnp.sum(h**2)


@pytest.mark.parametrize("jit", [False, True])
def test_grad_through_scan_over_stacked_conv_layers(rng, jit):
    """Three same-shape conv layers as one stacked QArray, scanned."""
    ws = normal(rng, (3, 4, 4 * 9)) * 0.3
    x = normal(rng, (2, 4, 6, 6))
    geometry = ((1, 1), ((1, 1),) * 2, (1, 1), 1)
    loss = scanned_conv_loss

    fn = jax.grad(loss, (0, 1))
    gx, gws = (jax.jit(fn) if jit else fn)(x, ws)

    # float64 reference: forward, then backward by hand
    dense = [ref.roundtrip(w).reshape(4, 4, 3, 3) for w in ws]
    hs = [x.astype(np.float64)]
    for w in dense:
        hs.append(np.tanh(ref.conv(hs[-1], w, *geometry)))
    g = 2 * hs[-1]
    want_gws = []
    for i in reversed(range(3)):
        g = g * (1 - hs[i + 1] ** 2)
        g, gw = ref.conv_vjp(hs[i], dense[i], g, *geometry)
        want_gws.insert(0, gw.reshape(4, -1))
    tol = accuracy.through_tanh(RTOL)  # the layers' tanh
    np.testing.assert_allclose(gx, g, rtol=tol, atol=tol)
    np.testing.assert_allclose(gws, np.stack(want_gws), rtol=tol, atol=tol)


def test_the_default_precision_in_force_reaches_a_scanned_conv_q():
    """The jax.default_matmul_precision in force reaches the convolutions of
    a scanned conv_q's forward and backward (a body hijax lowers apart)."""
    x, ws = jnp.ones((2, 4, 6, 6)), jnp.ones((3, 4, 36))
    with jax.default_matmul_precision("highest"):
        hlo = jax.jit(jax.grad(scanned_conv_loss, (0, 1))).lower(x, ws).as_text()
    convolutions = [line for line in hlo.splitlines() if "convolution" in line]
    assert len(convolutions) == 3
    for line in convolutions:
        assert "precision HIGHEST" in line, line


def test_linear_transpose_of_the_linearized_conv(rng):
    x = normal(rng, (2, 3, 5, 5))
    w, qw = quantized(rng, 4, 27)
    dense = ref.roundtrip(w).reshape(4, 3, 3, 3)
    geometry = ((1, 1), ((1, 1),) * 2, (1, 1), 1)
    g = normal(rng, (2, 4, 5, 5))
    want, _ = ref.conv_vjp(x, dense, g, *geometry)
    for activations in ("float32", "int8"):
        _, f_lin = jax.linearize(
            lambda x, a=activations: qa.conv_q(
                x, qw, (3, 3), padding="SAME", activations=a
            ),
            x,
        )
        (ct,) = jax.linear_transpose(f_lin, x)(g)
        np.testing.assert_allclose(ct, want, rtol=RTOL, atol=ATOL)
    with pytest.raises(TypeError, match="is not linear in x"):
        jax.linear_transpose(
            lambda x: qa.conv_q(x, qw, (3, 3), padding="SAME", activations="int8"), x
        )(g)


def test_explicit_sharding_of_the_batch_axis(mesh, rng):
    x = normal(rng, (8, 3, 6, 6))
    w, qw = quantized(rng, 4, 27)
    xs = jax.device_put(jnp.asarray(x), P("i"))
    geometry = ((1, 1), ((1, 1),) * 2, (1, 1), 1)
    for activations in ("float32", "int8"):
        y = jax.jit(
            lambda x, a=activations: qa.conv_q(
                x, qw, (3, 3), padding="SAME", activations=a
            )
        )(xs)
        assert str(jax.typeof(y)) == "float32[8@i,4,6,6]"
        want = ref.conv_q(x, *ref.quantize(w), (3, 3), *geometry, activations)
        np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)

    def loss(x, w):
        return jnp.sum(jnp.sin(qa.conv_q(x, qa.quantize(w), (3, 3), padding="SAME")))

    gx, gw = jax.jit(jax.grad(loss, (0, 1)))(xs, jnp.asarray(w))
    assert jax.typeof(gx).sharding.spec == P("i", None, None, None)
    dense = ref.roundtrip(w).reshape(4, 3, 3, 3)
    want_gx, want_gw = ref.conv_vjp(
        x, dense, np.cos(ref.conv(x, dense, *geometry)), *geometry
    )
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(gw, want_gw.reshape(4, -1), rtol=RTOL, atol=ATOL)


def test_sharded_channels_are_a_type_error(mesh, rng):
    x = jax.device_put(jnp.asarray(normal(rng, (2, 8, 6, 6))), P(None, "i"))
    _, qw = quantized(rng, 4, 72)
    with pytest.raises(
        TypeError, match=r"shards only x's batch axis.*f32\[2,8@i,6,6\]"
    ):
        qa.conv_q(x, qw, (3, 3))


def test_inside_shard_map(mesh, rng):
    x = normal(rng, (8, 3, 6, 6))
    w, qw = quantized(rng, 4, 27)

    @jax.jit
    @jax.shard_map(in_specs=P("i"), out_specs=P("i"))
    def f(x):
        return qa.conv_q(x, qw, (3, 3), padding="SAME")

    want = ref.conv_q(x, *ref.quantize(w), (3, 3), (1, 1), ((1, 1),) * 2, (1, 1), 1)
    np.testing.assert_allclose(f(jax.device_put(x, P("i"))), want, rtol=RTOL, atol=ATOL)

    def loss(x, w):
        @jax.shard_map(in_specs=(P("i"), P()), out_specs=P())
        def inner(x, w):
            y = qa.conv_q(x, qa.quantize(w), (3, 3), padding="SAME")
            return jax.lax.psum(jnp.sum(jnp.sin(y)), "i")

        return inner(x, w)

    gx, gw = jax.jit(jax.grad(loss, (0, 1)))(jax.device_put(x, P("i")), jnp.asarray(w))
    dense = ref.roundtrip(w).reshape(4, 3, 3, 3)
    geometry = ((1, 1), ((1, 1),) * 2, (1, 1), 1)
    want_gx, want_gw = ref.conv_vjp(
        x, dense, np.cos(ref.conv(x, dense, *geometry)), *geometry
    )
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(gw, want_gw.reshape(4, -1), rtol=RTOL, atol=ATOL)


# --- errors at trace time: TypeError for operands, ValueError for parameters


@pytest.mark.parametrize(
    "x_shape, qw_shape, kernel, conv, match",
    [
        ((2, 3, 8, 8), (4, 26), (3, 3), {}, r"qw of shape \(out, C / groups \* prod"),
        ((2, 3, 8), (4, 27), (3, 3, 3), {}, r"rank 4 or 5, got x: f32\[2,3,8\]"),
        (
            (3, 8, 8),
            (4, 12),
            (2, 2),
            {"feature_group_count": 2},
            r"\(out, 3 / 2 \* 4\)",
        ),
        ((2, 4, 8, 8), (3, 8), (2, 2), {"feature_group_count": 2}, "out divisible"),
        ((1, 3, 2, 2), (4, 27), (3, 3), {}, r"kernel \(3, 3\) is larger"),
    ],
)
def test_operand_errors_name_the_shapes(rng, x_shape, qw_shape, kernel, conv, match):
    x = jnp.zeros(x_shape, jnp.float32)
    qw = qa.quantize(jnp.ones(qw_shape, jnp.float32))
    with pytest.raises(TypeError, match=match):
        jax.jit(lambda x: qa.conv_q(x, qw, kernel, **conv)).trace(x)


def test_operand_type_errors(rng):
    qw = qa.quantize(jnp.ones((4, 27), jnp.float32))
    with pytest.raises(TypeError, match="x to be a float32, bfloat16 or float16 array"):
        qa.conv_q(jnp.zeros((3, 8, 8), jnp.int32), qw, (3, 3))
    with pytest.raises(TypeError, match="qw to be a QArray"):
        qa.conv_q(jnp.zeros((3, 8, 8)), jnp.ones((4, 27)), (3, 3))


@pytest.mark.parametrize(
    "kernel, conv, match",
    [
        ((3, 3, 3, 3), {}, "1 to 3 spatial axes"),
        ((3, 0), {}, "kernel_size to be 2 positive"),
        ((3, 3), {"window_strides": (1,)}, "window_strides to be 2 positive"),
        ((3, 3), {"rhs_dilation": 0}, "rhs_dilation"),
        ((3, 3), {"padding": "FULL"}, "padding in"),
        ((3, 3), {"padding": ((1, 1),)}, r"padding to be 2 \(low, high\)"),
        ((3, 3), {"padding": -1}, "non-negative"),
        ((3, 3), {"feature_group_count": 0}, "feature_group_count"),
        ((3, 3), {"activations": "int4"}, "activations in"),
    ],
)
def test_parameter_errors(kernel, conv, match):
    qw = qa.quantize(jnp.ones((4, 27), jnp.float32))
    with pytest.raises(ValueError, match=match):
        qa.conv_q(jnp.zeros((3, 8, 8)), qw, kernel, **conv)


@pytest.mark.parametrize("jit", [False, True])
def test_int4_weights_are_the_convolution_of_their_groups(rng, jit):
    """int4 weights (a scale per group of 12 of each row) against the NumPy
    convolution of the grouped dequantized weights: values, both gradients
    (straight-through) and a second derivative."""
    w, x = normal(rng, (6, 4, 3, 3)), normal(rng, (4, 7, 7))
    qw = qa.quantize(jnp.asarray(w.reshape(6, -1)), bits=4, group_size=12)
    assert str(jax.typeof(qw)) == "q4[6,36]"
    dense = ref.roundtrip4(w.reshape(6, -1), 12).reshape(w.shape)
    geometry = ((2, 1), ((1, 1), (0, 2)), (1, 2), 1)
    conv = {"window_strides": (2, 1), "padding": ((1, 1), (0, 2))}
    conv["rhs_dilation"] = (1, 2)

    def f(x, qw):
        return qa.conv_q(x, qw, (3, 3), **conv)

    f = jax.jit(f) if jit else f
    y = ref.conv(x, dense, *geometry)
    np.testing.assert_allclose(f(x, qw), y, rtol=RTOL, atol=ATOL)
    g = normal(rng, y.shape)
    gx, gw = jax.grad(lambda x, qw: jnp.sum(f(x, qw) * g), (0, 1))(x, qw)
    want_gx, want_gw = ref.conv_vjp(x, dense, g, *geometry)
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(gw, want_gw.reshape(6, -1), rtol=RTOL, atol=ATOL)
    # d/dx of sum(f(x)^2): 2 conv^T(conv(x)); its directional derivative in x
    t = normal(rng, x.shape)
    _, hvp = jax.jvp(jax.grad(lambda x: jnp.sum(f(x, qw) ** 2)), (x,), (t,))
    want_hvp, _ = ref.conv_vjp(x, dense, 2 * ref.conv(t, dense, *geometry), *geometry)
    np.testing.assert_allclose(hvp, want_hvp, rtol=RTOL, atol=ATOL)


def test_int4_weights_are_weight_only(rng):
    qw = qa.quantize(jnp.asarray(normal(rng, (4, 18))), bits=4, group_size=6)
    with pytest.raises(TypeError, match=r"int4 weights is weight-only.*q4\[4,18\]"):
        qa.conv_q(normal(rng, (2, 5, 5)), qw, (3, 3), activations="int8")
