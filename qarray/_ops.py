"""The vocabulary of QArray operations and the rules their primitives share.

The names layers, model files and the Tesseract contract use (what a product
may do with its activations, a layer's precisions and layouts, the int4
group size), the trace-time checks every primitive makes (TypeError for
operands, ValueError for static parameters), and the pieces of their AD,
batching and sharding rules: the primitives themselves are ``_primitives``
(quantize, dequantize, pack, unpack, matmul_q, linear_q) and ``_conv``
(conv_q).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.hijax import (
    GradAccum,
    ShapedArray,
    Zero,
    instantiate_zeros,
    linearize_from_jvp,
)
from jax.sharding import AxisType

from ._qarray import (
    DEFAULT_GROUP_SIZE,
    FLOAT32,
    QArrayTy,
    full_spec,
)

# what a product may do with its activations: keep them (weight-only) or
# quantize them per row (int8 x int8)
ACTIVATION_PRECISIONS = ("float32", "int8")
# what a layer's weights are: int8 per row (the default), int4 per group of
# ``group_size`` along K (layout "nk"), or float32 as given (not quantized)
PRECISIONS = ("int8", "int4", "float32")
# the quantized precisions' bits (``quantize(x, bits, group_size)``)
PRECISION_BITS = {"int8": 8, "int4": 4}
# a dense layer's weights: "kn" stored (K, N), one scale per input row (the
# hijax doc's layout, matmul_q); "nk" stored (N, K), one scale per output
# channel (PyTorch's and eqx.nn.Linear's weight, linear_q)
LAYOUTS = ("kn", "nk")


def check_activations(owner: str, activations) -> None:
    """A ValueError unless ``activations`` is one of ``ACTIVATION_PRECISIONS``
    (what every primitive and layer with an ``activations`` parameter says)."""
    if activations not in ACTIVATION_PRECISIONS:
        raise ValueError(
            f"{owner} requires activations in {ACTIVATION_PRECISIONS}, got "
            f"{activations!r}."
        )


def type_str(aval) -> str:
    """Short type string for error messages: ``f32[2,3]``, ``q8[4,5]``."""
    if isinstance(aval, QArrayTy):
        return aval.str_short()
    if hasattr(aval, "str_short"):
        return aval.str_short(short_dtypes=True)
    return repr(aval)


# what activations (and the arrays quantize takes) may be: the products
# compute in float32 (scales stay float32) and answer in x's dtype
FLOAT_DTYPES = tuple(jnp.dtype(d) for d in ("float32", "bfloat16", "float16"))


def require_float(name: str, what: str, aval, min_rank: int) -> None:
    """A TypeError unless ``aval`` is a float32, bfloat16 or float16 array of
    rank >= ``min_rank`` (float64 too is refused: the scales are float32)."""
    if not isinstance(aval, ShapedArray) or aval.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} requires {what} to be a float32, bfloat16 or float16 array, "
            f"got {type_str(aval)}."
        )
    if aval.ndim < min_rank:
        raise TypeError(
            f"{name} requires {what} of rank >= {min_rank}, got {type_str(aval)}."
        )


def check_precision(name: str, precision):
    """``precision`` as JAX's dots take it (``jnp.dot``'s meaning): None (the
    ``jax.default_matmul_precision`` in effect), a ``jax.lax.Precision`` or
    its name ("default", "high", "highest"), or a pair of those (x's, the
    weights'); a ValueError naming ``name`` otherwise. Hashable: a
    primitive's static parameter."""
    if precision is None or isinstance(precision, lax.Precision):
        return precision
    if isinstance(precision, str):
        try:
            return lax.Precision(precision)
        except ValueError:
            pass
    elif isinstance(precision, tuple | list) and len(precision) == 2:
        if not any(isinstance(p, tuple | list) for p in precision):
            return tuple(check_precision(name, p) for p in precision)
    raise ValueError(
        f"{name} requires precision None, 'default', 'high', 'highest', a "
        f"jax.lax.Precision or a pair of them, got {precision!r}."
    )


def require_qarray(name: str, what: str, aval) -> None:
    if not isinstance(aval, QArrayTy):
        raise TypeError(
            f"{name} requires {what} to be a QArray (q8 or q4), got {type_str(aval)}."
        )


BITS = (8, 4)


def check_group_size(name: str, group_size) -> int:
    """``group_size`` (int4: values of a row per scale) once it is a positive
    even int (two int4 values a byte), else a ValueError naming it as
    ``name`` (the caller's spelling: a parameter, a field, a flag)."""
    if (
        not isinstance(group_size, int)
        or isinstance(group_size, bool)
        or group_size < 2
        or group_size % 2
    ):
        raise ValueError(
            f"{name} must be a positive even int (two int4 values a byte), "
            f"got {group_size!r}."
        )
    return group_size


def check_bits(name: str, bits, group_size) -> int | None:
    """The group size for ``bits`` (int4: ``group_size`` or the default, a
    positive even int; int8: none), or a ValueError naming the parameter."""
    if bits not in BITS:
        raise ValueError(f"{name} requires bits in {BITS}, got {bits!r}.")
    if bits == 8:
        if group_size is not None:
            raise ValueError(
                f"{name}: group_size is for bits=4 (int8 has one scale per row), "
                f"got group_size={group_size!r}."
            )
        return None
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    return check_group_size(f"{name}: group_size", group_size)


def union_mat(a, b):
    """Manual-axis type varying over the axes of both ``a`` and ``b``."""
    if b.varying <= a.varying:
        return a
    return a.update(varying=a.varying | b.varying)


def explicit_spec(aval):
    """``aval``'s partition spec if its mesh has explicit axes, else None.

    Passed as ``out_sharding`` to contractions whose result sharding explicit
    mode cannot infer; in manual (shard_map) or unsharded code it is not needed.
    """
    mesh = aval.sharding.mesh
    if any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return jax.P(*full_spec(aval.sharding, aval.ndim))
    return None


def sum_to_type(ct, aval):
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


def product_rule(out_aval, *terms):
    """The tangent sum of ``fn(tangent)`` over ``(tangent, fn)`` terms, skipping
    symbolic zeros; a symbolic zero of ``out_aval``'s tangent type if all are."""
    parts = [fn(t) for t, fn in terms if not isinstance(t, Zero)]
    if not parts:
        return Zero(out_aval.to_tangent_aval())
    return sum(parts[1:], parts[0])


def contract_leading(a, b, target_aval, precision=None):
    """a[..., k] . b[..., n] over all leading axes -> [k, n] (an outer product
    for vectors), typed (float32, whatever the operands' dtype) and placed
    like ``target_aval``."""
    lead = tuple(range(a.ndim - 1))
    out = lax.dot_general(
        a.astype(FLOAT32),
        b.astype(FLOAT32),
        ((lead, lead), ((), ())),
        precision=precision,
        out_sharding=explicit_spec(target_aval),
    )
    return sum_to_type(out, target_aval)


def same_tangent(tangent, out_aval):
    """A straight-through tangent, re-typed as ``out_aval``'s tangent (a
    bfloat16 array's tangent becomes a QArray's float32 one)."""
    tangent_aval = out_aval.to_tangent_aval()
    if isinstance(tangent, Zero):
        return Zero(tangent_aval)
    return tangent.astype(tangent_aval.dtype)


def batch_at_front(x, d, size):
    if d is None:
        return jnp.broadcast_to(x, (size, *x.shape))
    return jnp.moveaxis(x, d, 0)


class ProductVJP:
    """The reverse rules of a product ``y = x (*) W`` with ``W = dequantize(qw)``
    (matmul_q, linear_q, conv_q): the forward keeps only what the wanted
    cotangents read (x's needs qw, qw's needs x); a subclass gives
    ``op_name`` (the public name, for errors), ``activations``,
    ``_ct_x(g, qw)`` (typed like x) and ``_ct_w(x, g)`` (laid out like qw)."""

    op_name: str

    # linear in x: what jax.linear_transpose (and reverse mode over a
    # linearized jvp, whose tangent products are the weight-only ones) needs
    def transpose(self, ct, x, qw):
        if self.activations != "float32":
            raise TypeError(
                f"{self.op_name} with activations={self.activations!r} is not "
                "linear in x: transpose the weight-only product instead."
            )
        if isinstance(qw, GradAccum) or not isinstance(x, GradAccum):
            raise NotImplementedError(
                f"{self.op_name} transposes in x only, with qw known."
            )
        if not isinstance(ct, Zero):
            x.accum(self._ct_x(ct, qw))

    def vjp_fwd(self, nzs_in, x, qw):
        needs_x, needs_qw = nzs_in
        return self(x, qw), (x if needs_qw else None, qw if needs_x else None)

    def vjp_bwd_retval(self, res, g):
        x, qw = res
        g = instantiate_zeros(g)
        ct_x = None if qw is None else self._ct_x(g, qw)
        ct_qw = None if x is None else self._ct_w(x, g)
        return ct_x, ct_qw


class CompiledWhenEager:
    """A primitive applied outside any trace runs as one compiled program per
    primitive and operand types, not op by op: eagerly each of its lojax
    operations (a nibble unpack's shifts, a product's quantization) compiles
    and dispatches on its own, a compile per op and shape that costs a few
    tenths of a second each on a TPU (docs/accelerators.md). Under a trace
    (jit, grad, vmap...) the primitive binds as usual."""

    def __call__(self, *args):
        if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(args)):
            return super().__call__(*args)
        return _applied(self, *args)


@jax.jit(static_argnums=0)
def _applied(prim, *args):
    # the primitive's own binding (not CompiledWhenEager's: under
    # jax.disable_jit this body runs eagerly and must not come back here);
    # primitives compare by class and parameters, so one compile serves
    # every application of the same primitive to the same operand types
    return super(CompiledWhenEager, prim).__call__(*args)


class StraightThrough:
    """The AD rules of quantize and dequantize (the straight-through
    estimator): the identity for tangents and cotangents, each re-typed as
    the other side's tangent (a QArray's is float32; a bfloat16 x's cotangent
    comes back in bfloat16). For a primitive of one operand."""

    def jvp(self, primals, tangents):
        (a,), (ta,) = primals, tangents
        return self(a), same_tangent(ta, self.out_aval)

    lin, linearized = linearize_from_jvp

    def vjp_fwd(self, nzs_in, a):
        return self(a), None

    def vjp_bwd_retval(self, _res, g):
        dtype = self.in_avals[0].to_tangent_aval().dtype
        return (instantiate_zeros(g).astype(dtype),)


class Parts:
    """A primitive that reads a value's parts (unpack, factors): typed as the
    value's lo types, without parameters; a subclass checks its operand, then
    calls this ``__init__``."""

    def __init__(self, aval):
        self.in_avals = (aval,)
        self.out_aval = tuple(aval.lo_ty())
        self.params = {}
        super().__init__()
