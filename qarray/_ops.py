"""The QArray primitives: quantize, dequantize and matmul_q.

Each primitive computes its output type (shape, sharding, varying manual axes)
in ``__init__``, which is where operand errors surface: at trace time. The
implementation lives in ``expand``; every other rule is traced code and reaches
QArray contents only through primitives.

Gradients are straight-through: quantize and dequantize are the identity for
tangents and cotangents, and matmul_q differentiates like ``x @ dequantize(qw)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.hijax import (
    HiPrim,
    ShapedArray,
    Zero,
    instantiate_zeros,
    linearize_from_jvp,
)
from jax.sharding import AxisType

from . import _kernels
from ._qarray import FLOAT32, INT8, QArray, QArraySpec, QArrayTy, full_spec, with_spec

ACTIVATIONS = ("float32", "int8")


def type_str(aval) -> str:
    """Short type string for error messages: ``f32[2,3]``, ``q8[4,5]``."""
    if isinstance(aval, QArrayTy):
        return aval.str_short()
    if hasattr(aval, "str_short"):
        return aval.str_short(short_dtypes=True)
    return repr(aval)


def _require_float32(name: str, what: str, aval, min_rank: int) -> None:
    if not isinstance(aval, ShapedArray) or aval.dtype != FLOAT32:
        raise TypeError(
            f"{name} requires {what} to be a float32 array, got {type_str(aval)}."
        )
    if aval.ndim < min_rank:
        raise TypeError(
            f"{name} requires {what} of rank >= {min_rank}, got {type_str(aval)}."
        )


def _require_qarray(name: str, what: str, aval) -> None:
    if not isinstance(aval, QArrayTy):
        raise TypeError(
            f"{name} requires {what} to be a QArray (q8), got {type_str(aval)}."
        )


def _union_mat(a, b):
    """Manual-axis type varying over the axes of both ``a`` and ``b``."""
    if b.varying <= a.varying:
        return a
    return a.update(varying=a.varying | b.varying)


def _explicit_spec(aval):
    """``aval``'s partition spec if its mesh has explicit axes, else None.

    Passed as ``out_sharding`` to contractions whose result sharding explicit
    mode cannot infer; in manual (shard_map) or unsharded code it is not needed.
    """
    mesh = aval.sharding.mesh
    if any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return jax.P(*full_spec(aval.sharding, aval.ndim))
    return None


def _sum_to_type(ct, aval):
    """Sum ``ct`` over the manual axes it varies over but ``aval`` does not.

    In the forward pass JAX broadcast the invariant operand across those axes
    (an implicit ``pvary``); the transpose of that broadcast is a ``psum``.
    """
    extra = jax.typeof(ct).manual_axis_type.varying - aval.manual_axis_type.varying
    if not extra:
        return ct
    mesh_names = aval.sharding.mesh.axis_names
    ordered = tuple(n for n in mesh_names if n in extra) + tuple(
        sorted(n for n in extra if n not in mesh_names)
    )
    return lax.psum(ct, ordered)


def _product_rule(out_aval, *terms):
    """The tangent sum of ``fn(tangent)`` over ``(tangent, fn)`` terms, skipping
    symbolic zeros; a symbolic zero of ``out_aval``'s tangent type if all are."""
    parts = [fn(t) for t, fn in terms if not isinstance(t, Zero)]
    if not parts:
        return Zero(out_aval.to_tangent_aval())
    return sum(parts[1:], parts[0])


def _contract_leading(a, b, target_aval):
    """a[..., k] . b[..., n] over all leading axes -> [k, n] (an outer product
    for vectors), typed and placed like ``target_aval``."""
    lead = tuple(range(a.ndim - 1))
    out = lax.dot_general(
        a, b, ((lead, lead), ((), ())), out_sharding=_explicit_spec(target_aval)
    )
    return _sum_to_type(out, target_aval)


def _same_tangent(tangent, out_aval):
    """A straight-through tangent, re-typed as ``out_aval``'s tangent."""
    if isinstance(tangent, Zero):
        return Zero(out_aval.to_tangent_aval())
    return tangent


class Quantize(HiPrim):
    """f32[..., n] -> q8[..., n]: symmetric per-row absmax int8 quantization."""

    def __init__(self, x_aval):
        _require_float32("quantize", "x", x_aval, min_rank=1)
        self.in_avals = (x_aval,)
        self.out_aval = QArrayTy.like(x_aval)
        self.params = {}
        super().__init__()

    def expand(self, x):
        return QArray(*_kernels.quantize_rows(x))

    # straight-through estimator: the identity for tangents and cotangents
    def jvp(self, primals, tangents):
        (x,), (tx,) = primals, tangents
        return self(x), _same_tangent(tx, self.out_aval)

    lin, linearized = linearize_from_jvp

    def vjp_fwd(self, nzs_in, x):
        return self(x), None

    def vjp_bwd_retval(self, _res, g):
        return (instantiate_zeros(g),)

    def batch(self, axis_data, args, dims):
        (x,), (d,) = args, dims
        if d is None:
            return quantize(x), None
        # per-row quantization acts on the last axis of each element, which
        # stays last once the batch axis is moved to the front
        return quantize(jnp.moveaxis(x, d, 0)), QArraySpec()


class Dequantize(HiPrim):
    """q8[..., n] -> f32[..., n]: ``qvalue * scale[..., None]``."""

    def __init__(self, q_aval):
        _require_qarray("dequantize", "q", q_aval)
        self.in_avals = (q_aval,)
        self.out_aval = q_aval.to_tangent_aval()
        self.params = {}
        super().__init__()

    def expand(self, q):
        return _kernels.dequantize_rows(q.qvalue, q.scale)

    # straight-through estimator: the identity for tangents and cotangents
    def jvp(self, primals, tangents):
        (q,), (tq,) = primals, tangents
        return self(q), _same_tangent(tq, self.out_aval)

    lin, linearized = linearize_from_jvp

    def vjp_fwd(self, nzs_in, q):
        return self(q), None

    def vjp_bwd_retval(self, _res, g):
        return (instantiate_zeros(g),)

    def batch(self, axis_data, args, dims):
        (q,), (d,) = args, dims
        if d is None:
            return dequantize(q), None
        return dequantize(q), 0


class MatmulQ(HiPrim):
    """f32[..., k] @ q8[k, n] -> f32[..., n].

    ``activations="float32"`` (weight-only): the per-row weight scales fold into
    ``x`` and the product runs against the int8 payload. ``activations="int8"``:
    ``x * scale`` is also quantized per row and the product is int8 x int8 with
    int32 accumulation. Either way the derivatives are those of the dense
    product ``x @ dequantize(qw)`` (straight-through).
    """

    def __init__(self, x_aval, qw_aval, activations="float32"):
        if activations not in ACTIVATIONS:
            raise ValueError(
                f"matmul_q requires activations in {ACTIVATIONS}, got {activations!r}."
            )
        _require_float32("matmul_q", "x", x_aval, min_rank=1)
        _require_qarray("matmul_q", "qw", qw_aval)
        operands = f"{type_str(x_aval)} @ {type_str(qw_aval)}"
        if qw_aval.ndim != 2:
            raise TypeError(f"matmul_q requires qw of rank 2, got {operands}.")
        if x_aval.shape[-1] != qw_aval.shape[0]:
            raise TypeError(
                f"matmul_q requires x.shape[-1] == qw.shape[0], got {operands}."
            )
        x_spec = full_spec(x_aval.sharding, x_aval.ndim)
        if x_spec[-1] is not None or qw_aval.spec[0] is not None:
            raise TypeError(
                "matmul_q requires an unsharded contraction axis (x's last, qw's "
                f"first), got {operands}."
            )
        out_spec = (*x_spec[:-1], qw_aval.spec[1])
        named = [
            n
            for p in out_spec
            if p is not None
            for n in (p if isinstance(p, tuple) else (p,))
        ]
        if len(named) != len(set(named)):
            raise TypeError(
                "matmul_q cannot shard x's rows and qw's columns over the same "
                f"mesh axis, got {operands}."
            )
        sharding = (
            x_aval.sharding if x_aval.sharding.mesh.axis_names else (qw_aval.sharding)
        )
        self.in_avals = (x_aval, qw_aval)
        self.out_aval = ShapedArray(
            (*x_aval.shape[:-1], qw_aval.shape[1]),
            FLOAT32,
            sharding=with_spec(sharding, out_spec),
            manual_axis_type=_union_mat(x_aval.manual_axis_type, qw_aval.mat),
        )
        self.params = {"activations": activations}
        super().__init__()

    def expand(self, x, qw):
        return _kernels.matmul(x, qw.qvalue, qw.scale, self.activations)

    # d(x @ W) = dx @ W + x @ dW, with W = dequantize(qw)
    def jvp(self, primals, tangents):
        (x, qw), (tx, tw) = primals, tangents
        return self(x, qw), _product_rule(
            self.out_aval,
            (tx, lambda t: jnp.matmul(t, dequantize(qw))),
            (tw, lambda t: jnp.matmul(x, t)),
        )

    lin, linearized = linearize_from_jvp

    def vjp_fwd(self, nzs_in, x, qw):
        needs_x, needs_qw = nzs_in
        # keep only what the wanted cotangents read: x's needs W, qw's needs x
        return self(x, qw), (x if needs_qw else None, qw if needs_x else None)

    def vjp_bwd_retval(self, res, g):
        x, qw = res
        g = instantiate_zeros(g)
        x_aval, qw_aval = self.in_avals
        ct_x = ct_qw = None
        if qw is not None:
            # g[..., n] . W[k, n] over n -> [..., k]
            if _explicit_spec(x_aval) is None and _explicit_spec(qw_aval) is None:
                ct_x = matmul_qt(g, qw)  # runs on the int8 payload
            else:
                # explicit sharding: the contraction over n may be sharded, and
                # the cotangent lands where x lives
                ct_x = lax.dot_general(
                    g,
                    dequantize(qw),
                    (((g.ndim - 1,), (1,)), ((), ())),
                    out_sharding=_explicit_spec(x_aval),
                )
            ct_x = _sum_to_type(ct_x, x_aval)
        if x is not None:
            # x^T g -> [k, n]. Cotangents live where primals live.
            ct_qw = _contract_leading(x, g, qw_aval.to_tangent_aval())
        return ct_x, ct_qw

    def batch(self, axis_data, args, dims):
        (x, qw), (dx, dq) = args, dims
        if dq is None:
            if dx is None:
                return self(x, qw), None
            # matmul_q takes any number of leading axes on x
            return matmul_q(jnp.moveaxis(x, dx, 0), qw, self.activations), 0
        # one weight matrix per example: loop over the stacked QArray, which
        # keeps each example's exact numerics (and every rule) intact
        if dx is None:
            body = lambda _, q: (None, matmul_q(x, q, self.activations))  # noqa: E731
            xs = qw
        else:
            body = lambda _, xq: (None, matmul_q(*xq, self.activations))  # noqa: E731
            xs = (jnp.moveaxis(x, dx, 0), qw)
        _, ys = lax.scan(body, None, xs, length=axis_data.size)
        return ys, 0


class MatmulQT(HiPrim):
    """f32[..., n] @ q8[k, n]^T -> f32[..., k]: the transposed product.

    What matmul_q's backward rule computes for x's cotangent,
    ``g @ dequantize(qw).T``, as a primitive of its own so that the int8
    payload does the heavy work (``_kernels.matmul_transposed``) while every
    derivative rule stays in terms of primitives (for higher-order AD).
    Internal: unsharded operands only (the rule handles explicit sharding).
    """

    def __init__(self, g_aval, qw_aval):
        _require_float32("matmul_qt", "g", g_aval, min_rank=1)
        _require_qarray("matmul_qt", "qw", qw_aval)
        if qw_aval.ndim != 2 or g_aval.shape[-1] != qw_aval.shape[1]:
            raise TypeError(
                "matmul_qt requires g.shape[-1] == qw.shape[1], got "
                f"{type_str(g_aval)} @ {type_str(qw_aval)}^T."
            )
        self.in_avals = (g_aval, qw_aval)
        self.out_aval = ShapedArray(
            (*g_aval.shape[:-1], qw_aval.shape[0]),
            FLOAT32,
            sharding=g_aval.sharding,
            manual_axis_type=_union_mat(g_aval.manual_axis_type, qw_aval.mat),
        )
        self.params = {}
        super().__init__()

    def expand(self, g, qw):
        return _kernels.matmul_transposed(g, qw.qvalue, qw.scale)

    # d(g @ W^T) = dg @ W^T + g @ dW^T
    def jvp(self, primals, tangents):
        (g, qw), (tg, tw) = primals, tangents
        return self(g, qw), _product_rule(
            self.out_aval,
            (tg, lambda t: matmul_qt(t, qw)),
            (tw, lambda t: jnp.matmul(g, t.T)),
        )

    lin, linearized = linearize_from_jvp

    def vjp_fwd(self, nzs_in, g, qw):
        needs_g, needs_qw = nzs_in
        return self(g, qw), (g if needs_qw else None, qw if needs_g else None)

    def vjp_bwd_retval(self, res, ct):
        g, qw = res
        ct = instantiate_zeros(ct)
        ct_g = None if qw is None else matmul_q(ct, qw)
        ct_qw = None
        if g is not None:  # ct^T g -> [k, n]
            ct_qw = _contract_leading(ct, g, self.in_avals[1].to_tangent_aval())
        return ct_g, ct_qw

    def batch(self, axis_data, args, dims):
        (g, qw), (dg, dq) = args, dims
        if dq is None:
            if dg is None:
                return self(g, qw), None
            return matmul_qt(jnp.moveaxis(g, dg, 0), qw), 0
        # stacked weights (rare: vmap of a gradient over weights): dense product
        g = g if dg is None else jnp.moveaxis(g, dg, 0)
        w_t = jnp.swapaxes(dequantize(qw), -1, -2)
        if dg is None:
            return jnp.einsum("...n,bnk->b...k", g, w_t), 0
        return jnp.einsum("b...n,bnk->b...k", g, w_t), 0


class Pack(HiPrim):
    """(int8[..., n], f32[...]) -> q8[..., n]: a QArray from given parts.

    The caller vouches for the invariants' values (qvalue in [-127, 127],
    scale >= 0); shapes and dtypes are checked here. Differentiable in
    ``scale`` (the represented array ``qvalue * scale`` is linear in it);
    ``qvalue`` is integer and has no tangent.
    """

    def __init__(self, qvalue_aval, scale_aval):
        got_q, got_s = type_str(qvalue_aval), type_str(scale_aval)
        if not isinstance(qvalue_aval, ShapedArray) or qvalue_aval.dtype != INT8:
            raise TypeError(f"pack requires qvalue to be an int8 array, got {got_q}.")
        if qvalue_aval.ndim < 1:
            raise TypeError(f"pack requires qvalue of rank >= 1, got {got_q}.")
        if not isinstance(scale_aval, ShapedArray) or scale_aval.dtype != FLOAT32:
            raise TypeError(f"pack requires scale to be a float32 array, got {got_s}.")
        if scale_aval.shape != qvalue_aval.shape[:-1]:
            raise TypeError(
                "pack requires scale.shape == qvalue.shape[:-1] (one scale per row), "
                f"got {got_q} and {got_s}."
            )
        self.in_avals = (qvalue_aval, scale_aval)
        self.out_aval = QArrayTy.like(qvalue_aval)
        self.params = {}
        super().__init__()

    def expand(self, qvalue, scale):
        return QArray(qvalue, scale)

    def jvp(self, primals, tangents):
        (qvalue, scale), (_, t_scale) = primals, tangents
        out = self(qvalue, scale)
        if isinstance(t_scale, Zero):
            return out, Zero(self.out_aval.to_tangent_aval())
        return out, _kernels.dequantize_rows(qvalue, t_scale)

    lin, linearized = linearize_from_jvp

    def vjp_fwd(self, nzs_in, qvalue, scale):
        return self(qvalue, scale), qvalue

    def vjp_bwd_retval(self, qvalue, g):
        g = instantiate_zeros(g)
        return None, jnp.sum(g * qvalue.astype(jnp.float32), axis=-1)

    def batch(self, axis_data, args, dims):
        (qvalue, scale), (dq, ds) = args, dims
        if dq is None and ds is None:
            return pack(qvalue, scale), None
        size = axis_data.size
        qvalue = _batch_at_front(qvalue, dq, size)
        scale = _batch_at_front(scale, ds, size)
        return pack(qvalue, scale), QArraySpec()


class Unpack(HiPrim):
    """q8[..., n] -> (int8[..., n], f32[...]): read a QArray's parts.

    For reading results out (e.g. returning quantized weights): the parts carry
    no derivative (zero tangents, like ``lax.stop_gradient``).
    """

    def __init__(self, q_aval):
        _require_qarray("unpack", "q", q_aval)
        self.in_avals = (q_aval,)
        self.out_aval = tuple(q_aval.lo_ty())
        self.params = {}
        super().__init__()

    def expand(self, q):
        return (q.qvalue, q.scale)

    def jvp(self, primals, tangents):
        (q,) = primals
        return self(q), tuple(Zero(a.to_tangent_aval()) for a in self.out_aval)

    lin, linearized = linearize_from_jvp

    def vjp_fwd(self, nzs_in, q):
        return self(q), None

    def vjp_bwd_retval(self, _res, g):
        return (None,)

    def batch(self, axis_data, args, dims):
        (q,), (d,) = args, dims
        return unpack(q), (None, None) if d is None else (0, 0)


def _batch_at_front(x, d, size):
    if d is None:
        return jnp.broadcast_to(x, (size, *x.shape))
    return jnp.moveaxis(x, d, 0)


def quantize(x):
    """Quantize f32[..., n] to a q8[..., n] QArray, one scale per row.

    ``scale = max|row| / 127``, ``qvalue = round_half_even(x / scale)`` clipped
    to [-127, 127]; an all-zero row gives scale 0 and qvalue 0.
    """
    return Quantize(jax.typeof(x))(x)


def dequantize(q):
    """q8[..., n] -> f32[..., n]: ``qvalue * scale[..., None]``."""
    return Dequantize(jax.typeof(q))(q)


def matmul_qt(g, qw):
    """f32[..., n] @ q8[k, n]^T -> f32[..., k] (internal: matmul_q's backward)."""
    return MatmulQT(jax.typeof(g), jax.typeof(qw))(g, qw)


def pack(qvalue, scale):
    """A QArray from its parts: int8[..., n] and one f32 scale per row [...].

    Use it for weights quantized elsewhere; ``quantize`` is the usual way in.
    Gradients flow to ``scale``.
    """
    return Pack(jax.typeof(qvalue), jax.typeof(scale))(qvalue, scale)


def unpack(q):
    """The parts ``(qvalue int8[..., n], scale f32[...])`` of a QArray.

    Works under every transformation (unlike reading ``q.qvalue`` on a
    tracer); the parts carry no derivative.
    """
    return Unpack(jax.typeof(q))(q)


def matmul_q(x, qw, activations="float32"):
    """f32[..., k] @ q8[k, n] -> f32[..., n]; ``x`` may be a vector.

    ``activations``: ``"float32"`` (weight-only, default) or ``"int8"`` (``x``
    is quantized per row too, for an int8 x int8 product). Derivatives are
    those of ``x @ dequantize(qw)`` in both cases.
    """
    return MatmulQ(jax.typeof(x), jax.typeof(qw), activations)(x, qw)
