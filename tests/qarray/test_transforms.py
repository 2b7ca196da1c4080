"""Every JAX transformation on every primitive, against NumPy references.

Each case is a vector-valued function F of float32 inputs that goes through
qarray primitives, with an independent reference for F and for its
vector-Jacobian product (straight-through: quantization is the identity for
derivatives). The Jacobian reference is assembled from the reference VJP, and
every transformation is checked against it.

Covers: qarray/_primitives.py, qarray/_conv.py, qarray/_ops.py
"""

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qarray as qa
from qarray.doc_types import TupSpec
from support import reference as ref
from support.breadth import breadth_param

# rerun on XLA's formulations alone where the kernels ran (make test)
pytestmark = pytest.mark.formulations

RTOL = ATOL = 2e-4


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


@dataclass(frozen=True)
class Case:
    name: str
    F: Callable  # jax: (*args) -> f32 array
    ref_F: Callable  # numpy: (*args) -> array
    ref_vjp: Callable  # numpy: (args, g) -> tuple of cotangents, one per arg
    ref_hessian: Callable  # numpy: args -> Hessian of sum(F) w.r.t. args[0]
    shapes: tuple

    def args(self, rng):
        return tuple(normal(rng, s) for s in self.shapes)

    def ref_jacobian(self, args, argnum):
        """d F / d args[argnum] as an array of shape out.shape + arg.shape."""
        out_shape = np.shape(self.ref_F(*args))
        rows = []
        for i in range(int(np.prod(out_shape))):
            g = np.zeros(int(np.prod(out_shape)))
            g[i] = 1
            rows.append(self.ref_vjp(args, g.reshape(out_shape))[argnum])
        return np.stack(rows).reshape(out_shape + args[argnum].shape)

    def ref_jvp(self, args, tangents):
        out = 0
        for argnum, t in enumerate(tangents):
            jac = self.ref_jacobian(args, argnum)
            out = out + np.tensordot(jac, t, axes=t.ndim)
        return out


# --- quantize (and dequantize): F(x) = sin(2 * dequantize(quantize(x)))


def _q_ref_vjp(args, g):
    (x,) = args
    return (g * 2 * np.cos(2 * ref.roundtrip(x)),)


QUANTIZE = Case(
    "quantize",
    lambda x: jnp.sin(2 * qa.dequantize(qa.quantize(x))),
    lambda x: np.sin(2 * ref.roundtrip(x)),
    _q_ref_vjp,
    lambda args: np.diag(-4 * np.sin(2 * ref.roundtrip(args[0])).ravel()).reshape(
        args[0].shape * 2
    ),
    ((3, 4),),
)


# --- matmul_q and linear_q: F(x, w) = sin(product(x, quantize(w)))
#
# matmul_q stores w as (k, n), linear_q as (n, k) (torch's (out, in)); both
# compute x @ W for the dense (k, n) matrix W, which is what the references use.

PRODUCTS = {
    "matmul_q": (qa.matmul_q, ref.matmul_q, lambda k, n: (k, n)),
    "linear_q": (qa.linear_q, ref.linear_q, lambda k, n: (n, k)),
}


def dense_kn(product, w):
    """The dense (k, n) weights that product(x, quantize(w)) multiplies x by."""
    wq = ref.roundtrip(w)
    return wq if product == "matmul_q" else wq.T


def cotangent_w(product, ct_kn):
    """A (k, n) weight cotangent laid out like the stored weights."""
    return ct_kn if product == "matmul_q" else ct_kn.T


def _sin_product_hessian(x, w_kn, y):
    """d2/dx2 sum(sin(x @ W)) for W (k, n) and y = x @ W: -sum_n sin(y_in)
    W_an W_bn, block-diagonal in rows."""
    wq = np.asarray(w_kn, np.float64)
    s = np.sin(y).reshape(-1, wq.shape[1])
    m, k = s.shape[0], wq.shape[0]
    hess = np.zeros((m, k, m, k))
    for i in range(m):
        hess[i, :, i, :] = -(wq * s[i]) @ wq.T
    return hess.reshape(x.shape * 2)


def _mm_case(name, x_shape, activations, product="matmul_q"):
    fn, ref_fn, w_shape = PRODUCTS[product]

    def F(x, w):
        return jnp.sin(fn(x, qa.quantize(w), activations))

    def y(x, w):
        return ref_fn(x, *ref.quantize(w), activations=activations)

    def ref_vjp(args, g):
        x, w = args
        gx, gw = ref.dense_vjp(x, dense_kn(product, w), g * np.cos(y(x, w)))
        return gx, cotangent_w(product, gw)

    def ref_hessian(args):
        x, w = args
        return _sin_product_hessian(x, dense_kn(product, w), y(x, w))

    return Case(
        name,
        F,
        lambda x, w: np.sin(y(x, w)),
        ref_vjp,
        ref_hessian,
        (x_shape, w_shape(x_shape[-1], 5)),
    )


# --- conv_q: F(x, w) = sin(conv_q(x, quantize(w), ...)), w (out, C/g * prod(k))
#
# ``conv`` holds the convolution's parameters with explicit (low, high) pads,
# which is what the reference takes; conv_q gets ``padding`` as written.


def _conv_case(
    name, x_shape, out, kernel, padding, pads, activations="float32", **conv
):
    strides = conv.get("window_strides") or (1,) * len(kernel)
    dilation = conv.get("rhs_dilation") or (1,) * len(kernel)
    groups = conv.get("feature_group_count", 1)
    per_out = x_shape[-len(kernel) - 1] // groups * int(np.prod(kernel))
    geometry = (strides, pads, dilation, groups)

    def dense(w):
        return ref.roundtrip(w).reshape(out, -1, *kernel)

    def F(x, w):
        y = qa.conv_q(
            x, qa.quantize(w), kernel, padding=padding, activations=activations, **conv
        )
        return jnp.sin(y)

    def y(x, w):
        return ref.conv_q(x, *ref.quantize(w), kernel, *geometry, activations)

    def ref_vjp(args, g):
        x, w = args
        gx, gw = ref.conv_vjp(x, dense(w), g * np.cos(y(x, w)), *geometry)
        return gx, gw.reshape(w.shape)

    def ref_hessian(args):
        # sum(sin(J x)) has Hessian J^T diag(-sin(J x)) J, J the dense conv in x
        x, w = args
        basis = np.eye(x.size).reshape(x.size, *x.shape)
        jac = np.stack([ref.conv(e, dense(w), *geometry).ravel() for e in basis], 1)
        hess = jac.T @ (-np.sin(y(x, w)).ravel()[:, None] * jac)
        return hess.reshape(x.shape * 2)

    return Case(
        name,
        F,
        lambda x, w: np.sin(y(x, w)),
        ref_vjp,
        ref_hessian,
        (x_shape, (out, per_out)),
    )


CONV_CASES = [
    _conv_case("conv_q-2d", (2, 3, 5, 5), 4, (3, 3), "SAME", ((1, 1), (1, 1))),
    _conv_case(
        "conv_q-1d-unbatched-strided-dilated",
        (3, 9),
        2,
        (3,),
        1,
        ((1, 1),),
        window_strides=(2,),
        rhs_dilation=(2,),
    ),
    _conv_case(
        "conv_q-2d-groups-int8",
        (2, 4, 4, 4),
        4,
        (2, 2),
        "VALID",
        ((0, 0), (0, 0)),
        "int8",
        feature_group_count=2,
    ),
    _conv_case(
        "conv_q-3d-unbatched",
        (2, 3, 3, 4),
        2,
        (2, 2, 2),
        ((1, 0), (0, 0), (0, 1)),
        ((1, 0), (0, 0), (0, 1)),
    ),
]

# --- int4: F(x, w) = sin(linear_q(x, quantize(w, bits=4, group_size=4)))


def _int4_case(name, x_shape):
    def F(x, w):
        return jnp.sin(qa.linear_q(x, qa.quantize(w, bits=4, group_size=4)))

    def dense(w):  # the (k, n) matrix x is multiplied by
        return ref.roundtrip4(w, 4).T.astype(np.float64)

    def y(x, w):
        return np.asarray(x, np.float64) @ dense(w)

    def ref_vjp(args, g):
        x, w = args
        gx, gw = ref.dense_vjp(x, dense(w), g * np.cos(y(x, w)))
        return gx, gw.T

    def ref_hessian(args):
        x, w = args
        return _sin_product_hessian(x, dense(w), y(x, w))

    return Case(
        name,
        F,
        lambda x, w: np.sin(y(x, w)),
        ref_vjp,
        ref_hessian,
        (x_shape, (5, x_shape[-1])),
    )


# --- qarray.nn.SpectralConv: F(x, w) = sin(SpectralConv(weight=w)(x)), its
# weights (in, out, *modes, 2) quantized on every call (straight-through);
# the layer is linear in x and in the dequantized weights, so the references
# are the Jacobians of the NumPy FFT layer


def _spectral_case(name, x_shape, c_out, modes):
    from qarray import nn as qnn

    c_in = x_shape[-len(modes) - 1]

    def F(x, w):
        layer = qnn.SpectralConv(c_in, c_out, modes, weight=w, precision="int8")
        return jnp.sin(layer(x))

    def y(x, w):
        return ref.spectral_conv(x, ref.spectral_roundtrip(w), modes)

    def jacobians(x, w):
        quantized = ref.spectral_roundtrip(w)
        jx = ref.linear_jacobian(lambda v: ref.spectral_conv(v, quantized, modes), x)
        as_complex = lambda p: p[..., 0] + 1j * p[..., 1]  # noqa: E731
        jw = ref.linear_jacobian(
            lambda p: ref.spectral_conv(x, as_complex(p), modes), w
        )
        return jx, jw

    def ref_vjp(args, g):
        x, w = args
        jx, jw = jacobians(x, w)
        weighted = g * np.cos(y(x, w))
        return tuple(np.tensordot(weighted, j, weighted.ndim) for j in (jx, jw))

    def ref_hessian(args):
        x, w = args
        jx = jacobians(x, w)[0].reshape(-1, x.size)
        hess = jx.T @ (-np.sin(y(x, w)).ravel()[:, None] * jx)
        return hess.reshape(x.shape * 2)

    return Case(
        name,
        F,
        lambda x, w: np.sin(y(x, w)),
        ref_vjp,
        ref_hessian,
        (x_shape, (c_in, c_out, *modes, 2)),
    )


CASES = [
    QUANTIZE,
    _spectral_case("spectral_conv-1d", (2, 8), 2, (3,)),
    _spectral_case("spectral_conv-2d-batched", (2, 2, 4, 4), 2, (3, 2)),
    *CONV_CASES,
    _int4_case("linear_q-int4", (3, 8)),
    _int4_case("linear_q-int4-vector-x", (8,)),
    _mm_case("matmul_q", (3, 4), "float32"),
    _mm_case("matmul_q-vector-x", (4,), "float32"),
    _mm_case("matmul_q-rank3-x", (2, 2, 4), "float32"),
    _mm_case("matmul_q-int8", (3, 4), "int8"),
    _mm_case("linear_q", (3, 4), "float32", "linear_q"),
    _mm_case("linear_q-vector-x", (4,), "float32", "linear_q"),
    _mm_case("linear_q-rank3-x", (2, 2, 4), "float32", "linear_q"),
    _mm_case("linear_q-int8", (3, 4), "int8", "linear_q"),
]


# cases whose sibling reaches the same code (cpu_breadth)
BREADTH = {
    "spectral_conv-1d": "spectral_conv-2d-batched's",
}


@pytest.fixture(
    params=[breadth_param(c, reason=BREADTH.get(c.name)) for c in CASES],
    ids=lambda c: c.name,
)
def case(request):
    return request.param


def argnums(case):
    return tuple(range(len(case.shapes)))


# A transform applied outside jit runs every op on its own: one XLA compile
# per op and shape (0.1-0.2 s each on a TPU, where the suite runs in one
# process). test_eager_and_jit runs every case's F eagerly; each transform
# below runs eagerly on the cases in EAGER (so the eager path of the hijax
# primitives under that transform stays covered) and on every other case
# under jit: jax.jit around the transform, or the transform of jax.jit(F).
EAGER = ("matmul_q",)


def eager(case):
    return case.name in EAGER


def sum_F(case):
    return lambda *a: jnp.sum(case.F(*a))


# setting up a test's QArrays (not what it tests: test_eager_and_jit runs
# quantize eagerly): one compile per shape
quantize = jax.jit(qa.quantize)
quantize_stack = jax.jit(jax.vmap(qa.quantize, out_axes=qa.QArraySpec()))
dequantize = jax.jit(qa.dequantize)


def test_eager_and_jit(case, rng):
    args = case.args(rng)
    for F in (case.F, jax.jit(case.F)):
        np.testing.assert_allclose(F(*args), case.ref_F(*args), rtol=RTOL, atol=ATOL)


def test_grad(case, rng):
    args = case.args(rng)
    # eager, or the gradient of the jitted function (jit of grad: below)
    f = sum_F(case) if eager(case) else jax.jit(sum_F(case))
    grads = jax.grad(f, argnums(case))(*args)
    want = case.ref_vjp(args, np.ones(np.shape(case.ref_F(*args))))
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_jit_of_grad(case, rng):
    args = case.args(rng)
    grads = jax.jit(jax.grad(sum_F(case), argnums(case)))(*args)
    want = case.ref_vjp(args, np.ones(np.shape(case.ref_F(*args))))
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_vjp(case, rng):
    args = case.args(rng)
    out, pullback = jax.vjp(case.F if eager(case) else jax.jit(case.F), *args)
    g = normal(rng, out.shape)
    for got, expected in zip(pullback(g), case.ref_vjp(args, g), strict=True):
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_jvp(case, rng):
    args = case.args(rng)
    tangents = case.args(rng)
    jvp = jax.jvp if eager(case) else jax.jit(jax.jvp, static_argnums=0)
    out, tangent_out = jvp(case.F, args, tangents)
    np.testing.assert_allclose(out, case.ref_F(*args), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        tangent_out, case.ref_jvp(args, tangents), rtol=RTOL, atol=ATOL
    )


def test_linearize(case, rng):
    args = case.args(rng)
    out, f_lin = jax.linearize(case.F if eager(case) else jax.jit(case.F), *args)
    np.testing.assert_allclose(out, case.ref_F(*args), rtol=RTOL, atol=ATOL)
    for _ in range(2):  # the linear map is reusable
        tangents = case.args(rng)
        np.testing.assert_allclose(
            f_lin(*tangents), case.ref_jvp(args, tangents), rtol=RTOL, atol=ATOL
        )


def _on_cpu_for_breadth(c, why):
    """``c`` as a parameter, cpu_breadth unless it is an EAGER case."""
    return breadth_param(c, reason=None if eager(c) else why)


# jacfwd is vmap of the jvp each case runs under test_jvp and test_linearize
# everywhere; jacrev's vmap of the transpose runs everywhere
@pytest.mark.parametrize(
    "case, jacobian",
    [
        breadth_param(
            c,
            jacobian,
            id=f"{c.name}-{jacobian.__name__}",
            reason=BREADTH.get(c.name, "jacfwd: the jvp tests' ops")
            if (c.name in BREADTH or jacobian is jax.jacfwd) and not eager(c)
            else None,
        )
        for c in CASES
        for jacobian in (jax.jacfwd, jax.jacrev)
    ],
)
def test_jacobians(case, rng, jacobian):
    args = case.args(rng)
    jacs = jax.jit(jacobian(case.F, argnums(case)))(*args)
    for argnum, got in enumerate(jacs):
        np.testing.assert_allclose(
            got, case.ref_jacobian(args, argnum), rtol=RTOL, atol=ATOL
        )


# forward over reverse: on an accelerator the EAGER case's; every other
# case's second derivative is its jvp's ops on its vjp's, which run there
@pytest.mark.parametrize(
    "case",
    [_on_cpu_for_breadth(c, "the jvp and vjp tests' ops") for c in CASES],
    ids=lambda c: c.name,
)
def test_hessian(case, rng):
    args = case.args(rng)
    hessian = jax.hessian(lambda x, *rest: jnp.sum(case.F(x, *rest)))
    hess = (hessian if eager(case) else jax.jit(hessian))(*args)
    np.testing.assert_allclose(hess, case.ref_hessian(args), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable])
def test_checkpoint_under_grad(case, rng, policy):
    args = case.args(rng)
    f = jax.checkpoint(sum_F(case), policy=policy)
    want = case.ref_vjp(args, np.ones(np.shape(case.ref_F(*args))))
    grad_fns = (jax.grad(f, argnums(case)), jax.jit(jax.grad(f, argnums(case))))
    # both eagerly (EAGER), jit of grad alone on the other cases
    for grad_fn in grad_fns if eager(case) else grad_fns[1:]:
        for got, expected in zip(grad_fn(*args), want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


# --- differentiating with respect to a QArray argument: tangents are float32


def test_grad_vjp_jvp_wrt_qarray_argument(rng):
    x, w = normal(rng, (3, 4)), normal(rng, (4, 5))
    qw = quantize(w)
    wq = ref.dequantize(np.asarray(qw.qvalue), np.asarray(qw.scale))
    y = x.astype(np.float64) @ wq

    def loss(x, qw):
        return jnp.sum(jnp.sin(qa.matmul_q(x, qw)))

    gx, gqw = jax.jit(jax.grad(loss, (0, 1)))(x, qw)
    assert jax.typeof(gqw) == jax.typeof(jnp.zeros((4, 5), jnp.float32))
    want_gx, want_gw = ref.dense_vjp(x, wq, np.cos(y))
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(gqw, want_gw, rtol=RTOL, atol=ATOL)
    _check_derivatives_wrt_qarray(rng, qw, wq, jit=False)


def test_linear_q_derivatives_wrt_qarray_argument(rng):
    x, w = normal(rng, (3, 4)), normal(rng, (5, 4))  # (out, in)
    qw = quantize(w)
    wq = ref.dequantize(np.asarray(qw.qvalue), np.asarray(qw.scale))
    y = x.astype(np.float64) @ wq.T

    def loss(x, qw):
        return jnp.sum(jnp.sin(qa.linear_q(x, qw)))

    gx, gqw = jax.jit(jax.grad(loss, (0, 1)))(x, qw)
    assert jax.typeof(gqw) == jax.typeof(jnp.zeros((5, 4), jnp.float32))
    want_gx, want_gw = ref.dense_vjp(x, wq.T, np.cos(y))
    np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(gqw, want_gw.T, rtol=RTOL, atol=ATOL)
    # jvp and linearize in both arguments: tx @ W^T + x @ tW^T
    tx, tw = normal(rng, (3, 4)), normal(rng, (5, 4))
    want = np.cos(y) * ref.dense_jvp(x, wq.T, tx, tw.T)
    # under jit (test_grad_vjp_jvp_wrt_qarray_argument's run eagerly)
    sin_linear = jax.jit(lambda x, qw: jnp.sin(qa.linear_q(x, qw)))
    tangents = (tx, jnp.asarray(tw))
    _, got = jax.jit(jax.jvp, static_argnums=0)(sin_linear, (x, qw), tangents)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    _, f_lin = jax.linearize(sin_linear, x, qw)
    np.testing.assert_allclose(f_lin(*tangents), want, rtol=RTOL, atol=ATOL)
    _check_derivatives_wrt_qarray(rng, qw, wq, jit=True)


def _check_derivatives_wrt_qarray(rng, qw, wq, jit):
    """Each transform eagerly, or (``jit``) under jax.jit: one compile each
    instead of one per op."""
    wrap = jax.jit if jit else (lambda f: f)

    # dequantize alone: the tangent of a q8[a,b] is an f32[a,b]
    def sum_sin(q):
        return jnp.sum(jnp.sin(qa.dequantize(q)))

    np.testing.assert_allclose(wrap(jax.grad(sum_sin))(qw), np.cos(wq), rtol=RTOL)
    t = normal(rng, wq.shape)
    _, tangent = wrap(lambda q, t: jax.jvp(sum_sin, (q,), (t,)))(qw, jnp.asarray(t))
    np.testing.assert_allclose(tangent, np.sum(np.cos(wq) * t), rtol=RTOL)
    _, f_lin = jax.linearize(wrap(sum_sin), qw)
    np.testing.assert_allclose(f_lin(jnp.asarray(t)), np.sum(np.cos(wq) * t), rtol=RTOL)
    _, pullback = jax.vjp(wrap(qa.dequantize), qw)
    g = normal(rng, wq.shape)
    np.testing.assert_allclose(pullback(g)[0], g)  # straight-through
    # jacobian with respect to a QArray: jax.jacrev reads input dtypes, which
    # a hi type lacks, so map the pullback over the basis instead
    size = wq.size
    basis = np.eye(size, dtype=np.float32).reshape(size, *wq.shape)
    jac = wrap(jax.vmap(lambda e: jax.vjp(qa.dequantize, qw)[1](e)[0]))(basis)
    np.testing.assert_allclose(jac.reshape(size, size), np.eye(size))


@pytest.mark.parametrize("product", PRODUCTS)
def test_linear_transpose_of_the_linearized_product(rng, product):
    """The tangent products are themselves the primitives (weight-only), so
    transposing a linearized product goes through their transpose rule."""
    fn, _, w_shape = PRODUCTS[product]
    x, w = normal(rng, (3, 4)), normal(rng, w_shape(4, 5))
    qw = quantize(w)
    wq = dense_kn(product, w)
    for activations in ("float32", "int8"):
        _, f_lin = jax.linearize(lambda x, a=activations: fn(x, qw, a), x)
        g = normal(rng, (3, 5))
        (ct,) = jax.linear_transpose(f_lin, x)(g)
        np.testing.assert_allclose(ct, g @ wq.T, rtol=RTOL, atol=ATOL)
    # the weight-only product is linear in x: transposable directly
    (ct,) = jax.linear_transpose(lambda x: fn(x, qw), x)(g)
    np.testing.assert_allclose(ct, g @ wq.T, rtol=RTOL, atol=ATOL)
    with pytest.raises(TypeError, match="is not linear in x"):
        jax.linear_transpose(lambda x: fn(x, qw, "int8"), x)(g)


# --- vmap


def test_vmap_quantize_out_and_dequantize_in(rng):
    """vmap applied eagerly (as in test_vmap_of_grad, and for linear_q in
    test_vmap_over_stacked_quantized_weights); the other vmap tests run
    under jit: one compile, not one per op."""
    xs = normal(rng, (4, 2, 3))
    qxs = jax.vmap(qa.quantize, out_axes=qa.QArraySpec())(jnp.asarray(xs))
    assert str(jax.typeof(qxs)) == "q8[4,2,3]"
    assert qxs.qvalue.shape == (4, 2, 3) and qxs.scale.shape == (4, 2)
    want = np.stack([ref.roundtrip(x) for x in xs])
    for dequantize in (qa.dequantize, jax.jit(qa.dequantize)):
        back = jax.vmap(dequantize, in_axes=qa.QArraySpec(), axis_size=4)(qxs)
        np.testing.assert_allclose(back, want, rtol=1e-6)


def test_vmap_quantize_over_a_non_leading_axis(rng):
    x = normal(rng, (3, 5, 4))
    qxs = jax.jit(jax.vmap(qa.quantize, in_axes=2, out_axes=qa.QArraySpec()))(x)
    assert str(jax.typeof(qxs)) == "q8[4,3,5]"
    back = jax.jit(
        jax.vmap(qa.dequantize, in_axes=qa.QArraySpec(), out_axes=2, axis_size=4)
    )(qxs)
    want = np.stack([ref.roundtrip(x[..., i]) for i in range(4)], axis=2)
    np.testing.assert_allclose(back, want, rtol=1e-6)


def test_vmap_of_grad(rng):
    xs = normal(rng, (4, 2, 3))

    def f(x):
        return jnp.sum(jnp.sin(qa.dequantize(qa.quantize(x))))

    got = jax.vmap(jax.grad(f))(xs)
    np.testing.assert_allclose(
        got, np.cos(np.stack([ref.roundtrip(x) for x in xs])), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("in_axis", [0, 1, 2])
def test_vmap_over_a_batch_of_x(rng, product, activations, in_axis):
    fn, ref_fn, w_shape = PRODUCTS[product]
    xs, w = normal(rng, (6, 3, 4)), normal(rng, w_shape(4, 5))
    qw = quantize(w)
    f = jax.jit(jax.vmap(lambda x: fn(x, qw, activations), in_axes=in_axis))
    got = f(np.moveaxis(xs, 0, in_axis))
    want = ref_fn(xs, *ref.quantize(w), activations=activations)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("product", PRODUCTS)
def test_vmap_of_grad_of_the_product(rng, product):
    fn, _, w_shape = PRODUCTS[product]
    xs, w = normal(rng, (6, 3, 4)), normal(rng, w_shape(4, 5))

    def loss(x, w):
        return jnp.sum(jnp.sin(fn(x, qa.quantize(w))))

    gxs, gws = jax.jit(jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None)))(xs, w)
    wq = dense_kn(product, w)
    for x, gx, gw in zip(xs, gxs, gws, strict=True):
        want_gx, want_gw = ref.dense_vjp(x, wq, np.cos(x.astype(np.float64) @ wq))
        np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(
            gw, cotangent_w(product, want_gw), rtol=RTOL, atol=ATOL
        )


@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("x_batched", [True, False])
def test_vmap_over_stacked_quantized_weights(rng, product, x_batched):
    fn, ref_fn, w_shape = PRODUCTS[product]
    xs, ws = normal(rng, (4, 3, 6)), normal(rng, (4, *w_shape(6, 5)))
    qws = quantize_stack(ws)
    # linear_q's eagerly, matmul_q's under jit
    maybe_jit = (lambda f: f) if product == "linear_q" else jax.jit
    for activations in ("float32", "int8"):
        prod = lambda x, q, a=activations: fn(x, q, a)  # noqa: E731
        if x_batched:
            got = maybe_jit(jax.vmap(prod, in_axes=(0, qa.QArraySpec())))(xs, qws)
            want = np.stack(
                [
                    ref_fn(x, *ref.quantize(w), activations=activations)
                    for x, w in zip(xs, ws, strict=True)
                ]
            )
        else:
            got = maybe_jit(
                jax.vmap(prod, in_axes=(None, qa.QArraySpec()), axis_size=4)
            )(xs[0], qws)
            want = np.stack(
                [ref_fn(xs[0], *ref.quantize(w), activations=activations) for w in ws]
            )
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("product", PRODUCTS)
def test_vmap_of_grad_over_stacked_weights(rng, product):
    """Per-example weights under vmap of grad: the backward products batch
    over a stack of QArrays too."""
    fn, _, w_shape = PRODUCTS[product]
    xs, ws = normal(rng, (4, 3, 6)), normal(rng, (4, *w_shape(6, 5)))
    qws = quantize_stack(ws)

    def loss(x, qw):
        return jnp.sum(jnp.sin(fn(x, qw)))

    gxs, gqws = jax.jit(jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, qa.QArraySpec())))(
        xs, qws
    )
    for x, w, gx, gqw in zip(xs, ws, gxs, gqws, strict=True):
        wq = dense_kn(product, w)
        want_gx, want_gw = ref.dense_vjp(x, wq, np.cos(x.astype(np.float64) @ wq))
        np.testing.assert_allclose(gx, want_gx, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(
            gqw, cotangent_w(product, want_gw), rtol=RTOL, atol=ATOL
        )


def test_vmap_requires_a_qarray_spec():
    q = quantize(np.ones((4, 2, 3), np.float32))
    with pytest.raises(ValueError, match="mapping spec"):  # JAX's own check
        jax.vmap(qa.dequantize, in_axes=0, axis_size=4)(q)
    with pytest.raises(TypeError, match=r"mapped with qarray\.QArraySpec\(\)"):
        jax.vmap(qa.dequantize, in_axes=TupSpec((0,)), axis_size=4)(q)
    with pytest.raises(TypeError, match="leading axis of that size"):
        jax.vmap(qa.dequantize, in_axes=qa.QArraySpec(), axis_size=3)(q)


# --- scan


@pytest.mark.parametrize("jit", [False, True])
def test_scan_over_stacked_qarray(rng, jit):
    xs = normal(rng, (4, 2, 3))
    qxs = quantize(xs)  # per-row scales: one q8[4,2,3] stack

    def run(qxs):
        def body(total, qx):
            assert str(jax.typeof(qx)) == "q8[2,3]"
            return total + jnp.sum(qa.dequantize(qx)), jnp.max(qa.dequantize(qx))

        return jax.lax.scan(body, jnp.float32(0), qxs, length=4)

    total, maxes = (jax.jit(run) if jit else run)(qxs)
    rt = np.stack([ref.roundtrip(x) for x in xs])
    np.testing.assert_allclose(total, rt.sum(), rtol=1e-5)
    np.testing.assert_allclose(maxes, rt.reshape(4, -1).max(axis=1), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_scan_with_qarray_carry_and_stacked_outputs(rng, jit):
    xs = normal(rng, (4, 2, 3))

    def step(qtotal, x):
        return qa.quantize(qa.dequantize(qtotal) + x), qa.quantize(2 * x)

    def run(xs):
        qzero = qa.quantize(jnp.zeros((2, 3), jnp.float32))
        return jax.lax.scan(step, qzero, xs)

    qtotal, qys = (jax.jit(run) if jit else run)(jnp.asarray(xs))
    assert str(jax.typeof(qtotal)) == "q8[2,3]" and str(jax.typeof(qys)) == "q8[4,2,3]"
    total = np.zeros((2, 3), np.float32)
    for x in xs:
        total = ref.roundtrip(total + x)
    np.testing.assert_allclose(dequantize(qtotal), total, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        dequantize(qys), np.stack([ref.roundtrip(2 * x) for x in xs]), rtol=1e-6
    )


@pytest.mark.parametrize("product", PRODUCTS)
def test_grad_through_scan_over_quantized_layers(rng, product):
    """A 3-layer quantized MLP as a scan over stacked weights, differentiated."""
    fn, _, _ = PRODUCTS[product]
    x0, ws = normal(rng, (2, 4)), normal(rng, (3, 4, 4)) * 0.5

    def net(x0, ws):
        def layer(x, w):
            return jnp.tanh(fn(x, qa.quantize(w))), None

        return jnp.sum(jax.lax.scan(layer, x0, ws)[0])

    gx, gws = jax.jit(jax.grad(net, (0, 1)))(x0, ws)
    # NumPy forward/backward with straight-through weights
    wqs = [dense_kn(product, w).astype(np.float64) for w in ws]
    acts = [x0.astype(np.float64)]
    for wq in wqs:
        acts.append(np.tanh(acts[-1] @ wq))
    g, want_gws = np.ones_like(acts[-1]), []
    for i in reversed(range(3)):
        g = g * (1 - acts[i + 1] ** 2)
        want_gws.insert(0, cotangent_w(product, acts[i].T @ g))
        g = g @ wqs[i].T
    np.testing.assert_allclose(gx, g, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(gws, np.stack(want_gws), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("jit", [False, True])
def test_scan_over_stacked_qarray_weights(rng, product, jit):
    """Quantized layers as a scan over a stacked QArray (one q8 per layer)."""
    fn, ref_fn, w_shape = PRODUCTS[product]
    x0, ws = normal(rng, (2, 4)), normal(rng, (3, *w_shape(4, 4))) * 0.5
    qws = quantize(ws)  # per-row scales: one q8[3,4,4] stack

    def net(x0, qws):
        def layer(x, qw):
            assert str(jax.typeof(qw)) == "q8[4,4]"
            return jnp.tanh(fn(x, qw)), None

        return jax.lax.scan(layer, x0, qws, length=3)[0]

    got = (jax.jit(net) if jit else net)(x0, qws)
    want = x0.astype(np.float64)
    for w in ws:
        want = np.tanh(ref_fn(want.astype(np.float32), *ref.quantize(w)))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("product", PRODUCTS)
def test_full_hessian_over_x_and_w(rng, product):
    """Second derivatives through the backward rules (each product's backward
    is the other product), mixed terms included, against central differences
    of the float64 straight-through gradient."""
    fn, _, w_shape = PRODUCTS[product]
    x, w = normal(rng, (2, 3)), normal(rng, w_shape(3, 2))

    def f(x, w):
        return jnp.sum(jnp.sin(fn(x, qa.quantize(w))))

    hess = jax.jit(jax.hessian(f, (0, 1)))(x, w)

    def grad_ref(flat):  # STE: the gradient of sum(sin(x @ W)) at W = roundtrip(w)
        xx, ww = flat[:6].reshape(2, 3), flat[6:].reshape(w.shape)
        w_kn = ww if product == "matmul_q" else ww.T
        g = np.cos(xx @ w_kn)
        gw = cotangent_w(product, xx.T @ g)
        return np.concatenate([(g @ w_kn.T).ravel(), gw.ravel()])

    point = np.concatenate([x.ravel(), ref.roundtrip(w).ravel()]).astype(np.float64)
    eps = 1e-6
    numeric = np.stack(
        [
            (grad_ref(point + eps * e) - grad_ref(point - eps * e)) / (2 * eps)
            for e in np.eye(12)
        ],
        axis=1,
    )
    got = np.block(
        [
            [
                np.asarray(hess[0][0]).reshape(6, 6),
                np.asarray(hess[0][1]).reshape(6, 6),
            ],
            [
                np.asarray(hess[1][0]).reshape(6, 6),
                np.asarray(hess[1][1]).reshape(6, 6),
            ],
        ]
    )
    np.testing.assert_allclose(got, numeric, rtol=1e-3, atol=1e-3)
