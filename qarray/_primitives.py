"""The QArray primitives but conv_q (``_conv``): quantize, dequantize, pack,
unpack, matmul_q and linear_q.

Each primitive computes its output type (shape, sharding, varying manual axes)
in ``__init__``, which is where operand errors surface: at trace time. The
implementation lives in ``expand``; every other rule is traced code and reaches
QArray contents only through primitives.

Gradients are straight-through: quantize and dequantize are the identity for
tangents and cotangents; matmul_q differentiates like ``x @ dequantize(qw)``
and linear_q like ``x @ dequantize(qw).T``.
"""

from __future__ import annotations

import functools

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

from . import _formulations, _numerics
from ._ops import (
    CompiledWhenEager,
    Parts,
    ProductVJP,
    StraightThrough,
    batch_at_front,
    check_activations,
    check_bits,
    check_precision,
    contract_leading,
    explicit_spec,
    product_rule,
    require_float,
    require_qarray,
    sum_to_type,
    type_str,
    union_mat,
)
from ._qarray import (
    FLOAT32,
    INT8,
    UINT8,
    QArray,
    QArraySpec,
    QArrayTy,
    full_spec,
    with_spec,
)


class Quantize(CompiledWhenEager, StraightThrough, HiPrim):
    """f32[..., n] -> q8[..., n]: symmetric per-row absmax int8 quantization;
    with ``bits=4``, -> q4[..., n]: int4 per group of ``group_size``, packed.
    bfloat16 and float16 ``x`` quantize as their float32 values (the scales
    are float32); their cotangent comes back in their dtype."""

    def __init__(self, x_aval, bits=8, group_size=None):
        group_size = check_bits("quantize", bits, group_size)
        require_float("quantize", "x", x_aval, min_rank=1)
        if bits == 4:
            n = x_aval.shape[-1]
            if n % group_size:
                raise TypeError(
                    f"quantize with bits=4 requires the last axis to be a multiple "
                    f"of group_size={group_size}, got {type_str(x_aval)}."
                )
            if full_spec(x_aval.sharding, x_aval.ndim)[-1] is not None:
                raise TypeError(
                    "quantize with bits=4 requires an unsharded last axis (its "
                    f"groups), got {type_str(x_aval)}."
                )
        self.in_avals = (x_aval,)
        self.out_aval = QArrayTy.like(x_aval, bits=bits, group_size=group_size)
        self.params = {"bits": bits, "group_size": group_size}
        super().__init__()

    def expand(self, x):
        x = x.astype(FLOAT32)
        if self.bits == 4:
            return QArray(*_numerics.quantize_groups(x, self.group_size))
        return QArray(*_formulations.quantize(x))

    def batch(self, axis_data, args, dims):
        (x,), (d,) = args, dims
        if d is None:
            return self(x), None
        # per-row quantization acts on the last axis of each element, which
        # stays last once the batch axis is moved to the front
        moved = jnp.moveaxis(x, d, 0)
        return quantize(moved, self.bits, self.group_size), QArraySpec()


class Dequantize(CompiledWhenEager, StraightThrough, HiPrim):
    """q8[..., n] -> f32[..., n]: ``qvalue * scale[..., None]``."""

    def __init__(self, q_aval):
        require_qarray("dequantize", "q", q_aval)
        self.in_avals = (q_aval,)
        self.out_aval = q_aval.to_tangent_aval()
        self.params = {}
        super().__init__()

    def expand(self, q):
        if self.in_avals[0].bits == 4:
            return _numerics.dequantize_groups(q.qvalue, q.scale)
        return _numerics.dequantize_rows(q.qvalue, q.scale)

    def batch(self, axis_data, args, dims):
        (q,), (d,) = args, dims
        if d is None:
            return dequantize(q), None
        return dequantize(q), 0


class _QProduct(CompiledWhenEager, ProductVJP, HiPrim):
    """What matmul_q and linear_q share: ``x[..., k]`` (float32, bfloat16 or
    float16) contracted with a 2-d QArray ``qw`` over x's last axis and qw's
    axis ``w_axis``; qw's other axis gives the output's last, in x's dtype.

    ``activations="float32"`` (weight-only) keeps ``x`` as it is (computing in
    float32 at ``precision``: JAX's meaning, see ``linear_q``);
    ``activations="int8"`` quantizes it per row for an int8 x int8 product.
    Either way the derivatives are those of the dense product with
    ``W = dequantize(qw)`` (straight-through): x's cotangent in x's dtype,
    qw's in float32.

    The two products are each other's transposes: the cotangent of ``x`` is
    ``g`` contracted with qw's other axis, which is the other primitive's
    weight-only product (``transposed``). So backward passes run on the int8
    payload too, and every rule stays in terms of primitives (higher-order AD).
    """

    w_axis: int  # qw's contracted axis
    w_out: str  # what qw's other (output) axis is called in errors
    operands_fmt: str  # how errors print the operands

    def __init__(self, x_aval, qw_aval, activations="float32", precision=None):
        name = self.op_name
        check_activations(name, activations)
        precision = check_precision(name, precision)
        require_float(name, "x", x_aval, min_rank=1)
        require_qarray(name, "qw", qw_aval)
        operands = self.operands_fmt.format(x=type_str(x_aval), qw=type_str(qw_aval))
        if qw_aval.bits == 4:
            if self.w_axis == 0:
                raise TypeError(
                    f"matmul_q does not take int4 weights (their groups run along "
                    f'each stored row): store them (N, K), layout "nk", and use '
                    f"linear_q, got {operands}."
                )
        if qw_aval.ndim != 2:
            raise TypeError(f"{name} requires qw of rank 2, got {operands}.")
        if x_aval.shape[-1] != qw_aval.shape[self.w_axis]:
            raise TypeError(
                f"{name} requires x.shape[-1] == qw.shape[{self.w_axis}], "
                f"got {operands}."
            )
        x_spec = full_spec(x_aval.sharding, x_aval.ndim)
        if x_spec[-1] is not None or qw_aval.spec[self.w_axis] is not None:
            which = "first" if self.w_axis == 0 else "last"
            raise TypeError(
                f"{name} requires an unsharded contraction axis (x's last, qw's "
                f"{which}), got {operands}."
            )
        out_spec = (*x_spec[:-1], qw_aval.spec[1 - self.w_axis])
        named = [
            n
            for p in out_spec
            if p is not None
            for n in (p if isinstance(p, tuple) else (p,))
        ]
        if len(named) != len(set(named)):
            raise TypeError(
                f"{name} cannot shard x's rows and qw's {self.w_out} over the "
                f"same mesh axis, got {operands}."
            )
        sharding = (
            x_aval.sharding if x_aval.sharding.mesh.axis_names else qw_aval.sharding
        )
        self.in_avals = (x_aval, qw_aval)
        self.out_aval = ShapedArray(
            (*x_aval.shape[:-1], qw_aval.shape[1 - self.w_axis]),
            x_aval.dtype,
            sharding=with_spec(sharding, out_spec),
            manual_axis_type=union_mat(x_aval.manual_axis_type, qw_aval.mat),
        )
        self.params = {"activations": activations, "precision": precision}
        super().__init__()

    def apply(self, x, qw, activations="float32"):
        """The product of ``x`` and ``qw`` with this primitive, at its precision."""
        cls = type(self)
        return cls(jax.typeof(x), jax.typeof(qw), activations, self.precision)(x, qw)

    def transposed(self, g, qw):
        """``g`` contracted with qw's output axis (the other primitive)."""
        raise NotImplementedError

    # d(x . W) = dx . W + x . dW, with W = dequantize(qw); dx . W is the
    # weight-only product whatever the activations (straight-through, float32)
    def jvp(self, primals, tangents):
        (x, qw), (tx, tw) = primals, tangents
        dims = (((x.ndim - 1,), (self.w_axis,)), ((), ()))
        return self(x, qw), product_rule(
            self.out_aval,
            (tx, lambda t: self.apply(t, qw)),
            (
                tw,
                lambda t: lax.dot_general(
                    x.astype(FLOAT32),
                    t,
                    dims,
                    precision=self.precision,
                    out_sharding=explicit_spec(self.out_aval),
                ).astype(self.out_aval.dtype),
            ),
        )

    lin, linearized = linearize_from_jvp

    def _ct_w(self, x, g):
        """x^T g over all leading axes, laid out like qw (cotangents live where
        primals live)."""
        pair = (x, g) if self.w_axis == 0 else (g, x)
        w_aval = self.in_avals[1].to_tangent_aval()
        return contract_leading(*pair, w_aval, self.precision)

    def _ct_x(self, g, qw):
        """``g`` contracted with qw's output axis, typed like ``x``."""
        x_aval, qw_aval = self.in_avals
        unsharded = explicit_spec(x_aval) is None and explicit_spec(qw_aval) is None
        if qw_aval.bits == 4 and unsharded:  # no int4 matmul_q: blocks of rows
            ct_x = _int4_rows_product(g, qw, self.precision)
        elif unsharded:
            ct_x = self.transposed(g, qw)  # runs on the int8 payload
        else:
            # explicit sharding: the contraction (qw's output axis) may be
            # sharded, and the cotangent lands where x lives
            ct_x = lax.dot_general(
                g.astype(FLOAT32),
                dequantize(qw),
                (((g.ndim - 1,), (1 - self.w_axis,)), ((), ())),
                precision=self.precision,
                out_sharding=explicit_spec(x_aval),
            )
        return sum_to_type(ct_x.astype(x_aval.dtype), x_aval)

    def batch(self, axis_data, args, dims):
        (x, qw), (dx, dq) = args, dims
        activations = self.activations
        if dq is None:
            if dx is None:
                return self(x, qw), None
            # x takes any number of leading axes
            return self.apply(jnp.moveaxis(x, dx, 0), qw, activations), 0
        # one weight matrix per example: loop over the stacked QArray, which
        # keeps each example's exact numerics (and every rule) intact
        if dx is None:
            body = lambda _, q: (None, self.apply(x, q, activations))  # noqa: E731
            xs = qw
        else:
            body = lambda _, xq: (None, self.apply(*xq, activations))  # noqa: E731
            xs = (jnp.moveaxis(x, dx, 0), qw)
        _, ys = lax.scan(body, None, xs, length=axis_data.size)
        return ys, 0


class MatmulQ(_QProduct):
    """f32[..., k] @ q8[k, n] -> f32[..., n].

    The per-row weight scales run along the contraction axis, so they fold
    into ``x`` and the product runs against the int8 payload; with
    ``activations="int8"`` the folded ``x * scale`` is quantized per row.
    """

    op_name, w_axis, w_out, operands_fmt = "matmul_q", 0, "columns", "{x} @ {qw}"

    def expand(self, x, qw):
        x = x.astype(FLOAT32)
        y = _formulations.matmul(
            x, qw.qvalue, qw.scale, self.activations, precision=self.precision
        )
        return y.astype(self.out_aval.dtype)

    def transposed(self, g, qw):
        # g[..., n] . W[k, n] over n: linear_q's product with qw read as (out, in)
        return linear_q(g, qw, precision=self.precision)


class LinearQ(_QProduct):
    """f32[..., k] with q8[n, k] -> f32[..., n]: ``x @ dequantize(qw).T``.

    Weights stored ``(out, in)`` (torch's ``F.linear``), one scale per output
    channel: the scales factor out, ``y = (x @ qvalue.T) * scale``; with
    ``activations="int8"``, ``y = int32(xq @ qvalue.T) * sx[:, None] * scale``.
    """

    op_name, w_axis, w_out, operands_fmt = "linear_q", 1, "rows", "{x} @ {qw}^T"

    def expand(self, x, qw):
        product = (
            _formulations.linear_int4
            if self.in_avals[1].bits == 4
            else _formulations.linear
        )
        y = product(
            x.astype(FLOAT32),
            qw.qvalue,
            qw.scale,
            self.activations,
            precision=self.precision,
            bf16_x=x.dtype == jnp.bfloat16,
        )
        return y.astype(self.out_aval.dtype)

    def transposed(self, g, qw):
        # g[..., n] . W[n, k] over n: matmul_q's product with qw read as (in, out)
        return matmul_q(g, qw, precision=self.precision)


class Pack(HiPrim):
    """(int8[..., n], f32[...]) -> q8[..., n]: a QArray from given parts.

    The caller vouches for the invariants' values (qvalue in [-127, 127],
    scale >= 0); shapes and dtypes are checked here. Differentiable in
    ``scale`` (the represented array ``qvalue * scale`` is linear in it);
    ``qvalue`` is integer and has no tangent.
    """

    def __init__(self, qvalue_aval, scale_aval, bits=8, group_size=None):
        group_size = check_bits("pack", bits, group_size)
        got_q, got_s = type_str(qvalue_aval), type_str(scale_aval)
        dtype = INT8 if bits == 8 else UINT8
        what = "int8" if bits == 8 else "uint8 (two int4 values per byte)"
        if not isinstance(qvalue_aval, ShapedArray) or qvalue_aval.dtype != dtype:
            raise TypeError(f"pack requires qvalue to be a {what} array, got {got_q}.")
        if qvalue_aval.ndim < 1:
            raise TypeError(f"pack requires qvalue of rank >= 1, got {got_q}.")
        if not isinstance(scale_aval, ShapedArray) or scale_aval.dtype != FLOAT32:
            raise TypeError(f"pack requires scale to be a float32 array, got {got_s}.")
        if bits == 8:
            want, shape = qvalue_aval.shape[:-1], qvalue_aval.shape
            expected = "qvalue.shape[:-1] (one scale per row)"
        else:
            *lead, half = qvalue_aval.shape
            shape = (*lead, 2 * half)
            if 2 * half % group_size:
                raise TypeError(
                    f"pack with bits=4 requires rows of a multiple of group_size="
                    f"{group_size} values, got {got_q} ({2 * half} values a row)."
                )
            want = (*lead, 2 * half // group_size)
            expected = f"{want} (one per group of {group_size} values)"
        if scale_aval.shape != want:
            raise TypeError(
                f"pack requires scale of shape {expected}, got {got_q} and {got_s}."
            )
        self.in_avals = (qvalue_aval, scale_aval)
        self.out_aval = QArrayTy.like(qvalue_aval, shape, None, bits, group_size)
        self.params = {"bits": bits, "group_size": group_size}
        super().__init__()

    def expand(self, qvalue, scale):
        return QArray(qvalue, scale)

    def _represented(self, qvalue, scale):
        if self.bits == 4:
            return _numerics.dequantize_groups(qvalue, scale)
        return _numerics.dequantize_rows(qvalue, scale)

    def jvp(self, primals, tangents):
        (qvalue, scale), (_, t_scale) = primals, tangents
        out = self(qvalue, scale)
        if isinstance(t_scale, Zero):
            return out, Zero(self.out_aval.to_tangent_aval())
        return out, self._represented(qvalue, t_scale)

    lin, linearized = linearize_from_jvp

    def vjp_fwd(self, nzs_in, qvalue, scale):
        return self(qvalue, scale), qvalue

    def vjp_bwd_retval(self, qvalue, g):
        g = instantiate_zeros(g)
        if self.bits == 4:
            values = _numerics.unpack_nibbles(qvalue).astype(jnp.float32)
            *lead, n = values.shape
            groups = (g * values).reshape(*lead, n // self.group_size, self.group_size)
            return None, jnp.sum(groups, axis=-1)
        return None, jnp.sum(g * qvalue.astype(jnp.float32), axis=-1)

    def batch(self, axis_data, args, dims):
        (qvalue, scale), (dq, ds) = args, dims
        if dq is None and ds is None:
            return self(qvalue, scale), None
        size = axis_data.size
        qvalue = batch_at_front(qvalue, dq, size)
        scale = batch_at_front(scale, ds, size)
        return pack(qvalue, scale, self.bits, self.group_size), QArraySpec()


class Unpack(Parts, HiPrim):
    """q8[..., n] -> (int8[..., n], f32[...]): read a QArray's parts.

    For reading results out (e.g. returning quantized weights): the parts carry
    no derivative (zero tangents, like ``lax.stop_gradient``).
    """

    def __init__(self, q_aval):
        require_qarray("unpack", "q", q_aval)
        super().__init__(q_aval)

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


def quantize(x, bits=8, group_size=None):
    """Quantize f32[..., n] to a q8[..., n] QArray, one scale per row.

    ``scale = max|row| / 127``, ``qvalue = round_half_even(x / scale)`` clipped
    to [-127, 127]; an all-zero row gives scale 0 and qvalue 0.

    ``bits=4``: a q4[..., n] QArray, each row in groups of ``group_size``
    (default 128; even, dividing n) consecutive entries, ``scale = max|group|
    / 7``, values in [-7, 7] packed two per byte (low nibble = even index):
    half of int8's bytes. ``linear_q`` takes it as weights (N, K).
    """
    return Quantize(jax.typeof(x), bits, group_size)(x)


# float32 bytes of int4 weights dequantized at once by a backward pass
# (``_int4_rows_product``): a small fraction of a large layer's payload, so
# that training adapters over an int4 model holds no float copy of it
# (``benchmarks/bench_lora.py``, the memory rows). On a TPU at one bf16 pass
# the blocks are bf16 and larger: a block of 32 rows (1 MiB at K = 8192)
# would be a dot contracting 32 entries, a sliver of the MXU's 128, while
# 2048 rows (32 MiB) stay a small fraction of the chip's memory
_INT4_BLOCK_BYTES = 1 << 20
_INT4_BLOCK_BYTES_TPU = 32 << 20


def _int4_rows_product(g, qw, precision=None):
    """``g[..., n] . W[n, k]`` over n for int4 ``qw (N, K)``. A layer within
    one float32 block is one product on ``dequantize(qw)``, which carries
    the weights' tangent (the x cotangent's derivative in w, a mixed second
    derivative); a larger one goes by blocks of rows (``_int4_blocks``):
    float32, or where a TPU runs it at one bf16 pass, its tile kernel or
    bf16 blocks read as ``int4_bf16`` reads the weights
    (``_int4_rows_on_tpu``)."""
    ty = jax.typeof(qw)
    n, k = ty.shape
    g = g.astype(FLOAT32)
    if 4 * n * k <= _INT4_BLOCK_BYTES or n <= 1:
        return jnp.matmul(g, dequantize(qw), precision=precision)
    qvalue, scale = unpack(qw)
    blocks = functools.partial(_int4_blocks, group_size=ty.group_size)
    if not _formulations.int4_bf16_on_tpu(precision):
        return blocks(g, qvalue, scale, precision=precision)
    # the weights pass the platform's branches as their parts: cond's
    # batching rule (vmap over stacked weights) takes no QArray
    return lax.platform_dependent(
        g,
        qvalue,
        scale,
        tpu=functools.partial(_int4_rows_on_tpu, group_size=ty.group_size),
        default=functools.partial(blocks, precision=precision),
    )


def _int4_rows_on_tpu(g, qvalue, scale, *, group_size):
    """``_int4_rows_product`` at one bf16 pass on a TPU, the weights as
    their parts: the TPU's tile kernel where the rule takes it
    (``_formulations.int4_cotangent_kernel``), else bf16 blocks."""
    n, k = qvalue.shape[0], 2 * qvalue.shape[1]
    flat = g.reshape(-1, n)
    if not _formulations.int4_cotangent_kernel(flat.shape[0], group_size):
        return _int4_blocks(g, qvalue, scale, group_size=group_size, bf16=True)
    out = _int4_tile_cotangent(group_size, flat, qvalue, scale)
    return out.reshape(*g.shape[:-1], k)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _int4_tile_cotangent(group_size, g, qvalue, scale):
    """g (m, n) @ W (n, k) for int4 weights as their parts, by the TPU's
    tile kernel (each block of weights dequantized to bf16 in VMEM, g as
    its one bf16 part). A Pallas call has no transpose, so its derivatives
    (the VJP's own, under second-order derivatives) are those of the bf16
    blocks (``_int4_blocks``), which compute the same product in XLA."""
    return _formulations._tpu_module().int4_product(
        g,
        qvalue,
        scale,
        group_size=group_size,
        mode="tile",
        nk=False,
        interpret=not _formulations._tpu_available(),
    )


@_int4_tile_cotangent.defjvp
def _int4_tile_cotangent_jvp(group_size, primals, tangents):
    blocks = functools.partial(_int4_blocks, group_size=group_size, bf16=True)
    _, tangent = jax.jvp(blocks, primals, tangents)
    return _int4_tile_cotangent(group_size, *primals), tangent


def _int4_blocks(g, qvalue, scale, *, group_size, precision=None, bf16=False):
    """``g[..., n] . W[n, k]`` over n for int4 weights as their parts
    (packed ``qvalue (N, K / 2)``, ``scale (N, K / G)``), a block of rows
    dequantized at a time: in float32 at ``precision`` (1 MiB blocks), or
    (``bf16``) rounded once to bf16 by ``_numerics.dequantize_groups_bf16``,
    g rounded to bf16, one bf16 dot summing in float32 (32 MiB blocks)."""
    n, k = qvalue.shape[0], 2 * qvalue.shape[1]
    block_bytes, itemsize = (
        (_INT4_BLOCK_BYTES_TPU, 2) if bf16 else (_INT4_BLOCK_BYTES, 4)
    )
    rows = max(1, block_bytes // (itemsize * k))
    flat = g.reshape(-1, n)

    def block(start, size):
        rows_of_g = lax.dynamic_slice_in_dim(flat, start, size, 1)
        part = [lax.dynamic_slice_in_dim(a, start, size, 0) for a in (qvalue, scale)]
        if bf16:
            w = _numerics.dequantize_groups_bf16(*part)
            return jnp.matmul(
                rows_of_g.astype(jnp.bfloat16), w, preferred_element_type=FLOAT32
            )
        w = dequantize(pack(*part, 4, group_size))
        return jnp.matmul(rows_of_g, w, precision=precision)

    if rows >= n:
        return block(0, n).reshape(*g.shape[:-1], k)

    def step(total, i):
        return total + block(i * rows, rows), None

    whole = n // rows
    total = jnp.zeros((flat.shape[0], k), g.dtype)
    total, _ = lax.scan(step, total, jnp.arange(whole))
    if whole * rows < n:
        total = total + block(whole * rows, n - whole * rows)
    return total.reshape(*g.shape[:-1], k)


def dequantize(q):
    """q8[..., n] -> f32[..., n]: ``qvalue * scale[..., None]``."""
    return Dequantize(jax.typeof(q))(q)


def pack(qvalue, scale, bits=8, group_size=None):
    """A QArray from its parts: int8[..., n] and one f32 scale per row [...];
    with ``bits=4``, uint8[..., n / 2] (two int4 values per byte, low nibble
    = even index) and one f32 scale per group, [..., n / group_size].

    Use it for weights quantized elsewhere; ``quantize`` is the usual way in.
    Gradients flow to ``scale``.
    """
    return Pack(jax.typeof(qvalue), jax.typeof(scale), bits, group_size)(qvalue, scale)


def unpack(q):
    """The parts ``(qvalue int8[..., n], scale f32[...])`` of a QArray (int4:
    ``(uint8[..., n / 2], f32[..., n / group_size])``).

    Works under every transformation (unlike reading ``q.qvalue`` on a
    tracer); the parts carry no derivative.
    """
    return Unpack(jax.typeof(q))(q)


def matmul_q(x, qw, activations="float32", *, precision=None):
    """x[..., k] @ q8[k, n] -> [..., n] in x's dtype (float32, bfloat16 or
    float16); ``x`` may be a vector.

    ``activations``: ``"float32"`` (weight-only, default) or ``"int8"`` (``x``
    is quantized per row too, for an int8 x int8 product). ``precision``: as
    ``jnp.dot``'s (see ``linear_q``). Derivatives are those of
    ``x @ dequantize(qw)`` in both cases.
    """
    return MatmulQ(jax.typeof(x), jax.typeof(qw), activations, precision)(x, qw)


def linear_q(x, qw, activations="float32", *, precision=None):
    """x[..., k] with q8[n, k] -> [..., n]: ``x @ dequantize(qw).T``, in x's
    dtype (float32, bfloat16 or float16; the scales stay float32).

    torch's ``F.linear`` layout: ``qw`` stores weights ``(out, in)``, e.g. a
    PyTorch ``nn.Linear.weight``, one scale per output channel. ``x`` may be a
    vector. ``activations``: ``"float32"`` (weight-only, default) or ``"int8"``
    (``x`` quantized per row too, for an int8 x int8 product). Derivatives are
    those of ``x @ dequantize(qw).T`` in both cases; x's cotangent comes back
    in x's dtype.

    ``precision`` means what it means to ``jnp.dot``: ``None`` (the
    ``jax.default_matmul_precision`` in effect), ``"default"``, ``"high"``,
    ``"highest"`` or a ``jax.lax.Precision`` (or a pair). The products sum in
    float32; on CPU they are float32-exact whatever is asked, on a TPU the
    default is one bfloat16 pass over x (``"highest"``: float32 throughout).
    int8 activations are integer products: exact at any precision.
    """
    return LinearQ(jax.typeof(x), jax.typeof(qw), activations, precision)(x, qw)
