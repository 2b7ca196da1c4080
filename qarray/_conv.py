"""conv_q: a convolution with int8 (or packed int4) weights, as a hijax primitive.

The weights ``(out, in / groups, *kernel_size)`` (PyTorch's and
``eqx.nn.Conv``'s layout) are the 2-D QArray ``quantize(w.reshape(out, -1))``:
one scale per output channel, as ``linear_q``'s weights, so the type and every
QArray rule stay as they are and the scales factor out of the convolution,
``y = conv(x, qvalue) * scale[o]``. Inputs are channels-first, ``(C, *spatial)``
or ``(B, C, *spatial)``, with 1 to 3 spatial axes. int4 weights
(``quantize(w.reshape(out, -1), bits=4, group_size=G)``, a scale per group of
G consecutive entries of a row) are weight-only.

Derivatives are those of ``lax.conv_general_dilated(x, W)`` with
``W = dequantize(qw).reshape(out, in / groups, *kernel_size)``
(straight-through), in float32. The tangent product in ``x`` is conv_q itself
(weight-only), so every rule is traced code and higher-order AD works.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.hijax import (
    HiPrim,
    ShapedArray,
    linearize_from_jvp,
)

from . import _ffi, _formulations, _numerics, _ops
from ._primitives import dequantize
from ._qarray import FLOAT32, full_spec, with_spec

PADDINGS = ("VALID", "SAME", "SAME_LOWER")

# How the forward convolution runs (`make bench`, suite conv, measures them
# against float32 `lax.conv_general_dilated`): "dequantized" converts the int8
# weights to float32 (weight-only); for int8 activations "float_sums" convolves
# the integer-valued float32 operands (exact while every sum stays below 2**24,
# i.e. C/groups * prod(kernel) <= 1040) and "int8_conv" asks XLA for int8 x
# int8 -> int32, which XLA:CPU runs as a slow generic loop; "kernel" is
# qarray's CPU kernel (an implicit int8 GEMM over a padded channels-last copy
# of x, qarray/_cpu/conv.cc), the default for int8 activations on CPU
# (weight-only, its three int8 parts of x measured slower than the
# dequantized float32 convolution: make bench, suite conv). A TPU keeps
# "float_sums" (its integer-valued operands take one exact bf16 pass): XLA's
# int8 convolution there measured no faster (benchmarks.bench_tpu_conv).
CONV_STRATEGIES = ("dequantized", "float_sums", "int8_conv", "kernel")


def _positive_ints(name: str, value, nsp: int) -> tuple[int, ...]:
    """``value`` (an int, or one int per spatial axis) as ``nsp`` positive ints."""
    values = (value,) * nsp if isinstance(value, int) else tuple(value)
    if len(values) != nsp or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values
    ):
        raise ValueError(
            f"conv_q requires {name} to be {nsp} positive int(s), got {value!r}."
        )
    return values


def _explicit_padding(padding, spatial, window, strides) -> tuple:
    """``padding`` (a name in PADDINGS, an int, or (low, high) per spatial
    axis) as ((low, high), ...) for the given spatial input shape."""
    nsp = len(spatial)
    if isinstance(padding, str):
        if padding.upper() not in PADDINGS:
            raise ValueError(
                f"conv_q requires padding in {PADDINGS} or (low, high) pairs, "
                f"got {padding!r}."
            )
        return tuple(
            tuple(p) for p in lax.padtype_to_pads(spatial, window, strides, padding)
        )
    if isinstance(padding, int) and not isinstance(padding, bool):
        padding = ((padding, padding),) * nsp
    try:
        pairs = tuple((int(lo), int(hi)) for lo, hi in padding)
        ok = len(pairs) == nsp and all(
            lo >= 0 and hi >= 0 and (lo, hi) == tuple(p)
            for (lo, hi), p in zip(pairs, padding, strict=True)
        )
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"conv_q requires padding to be {nsp} (low, high) pair(s) of "
            f"non-negative ints, a non-negative int or one of {PADDINGS}, "
            f"got {padding!r}."
        )
    return pairs


def _dimension_numbers(nsp: int):
    """Channels first for inputs and outputs, (out, in, *kernel) weights."""
    space = "DHW"[3 - nsp :]
    return ("NC" + space, "OI" + space, "NC" + space)


class ConvQ(_ops.CompiledWhenEager, _ops.ProductVJP, HiPrim):
    """``x (B?, C, *spatial)`` (float32, bfloat16 or float16) convolved with q8
    (or q4) ``qw (out, C/groups * prod(kernel_size))`` -> ``(B?, out,
    *out_spatial)`` in x's dtype, computed in float32 at ``precision``.

    ``activations="int8"`` quantizes each example of ``x`` (all its channels
    and positions: one scale per example) for an int8 x int8 convolution with
    int32 sums; ``"float32"`` (weight-only) keeps ``x`` as it is.
    """

    op_name = "conv_q"

    def __init__(
        self,
        x_aval,
        qw_aval,
        kernel_size,
        window_strides=None,
        padding="VALID",
        rhs_dilation=None,
        feature_group_count=1,
        activations="float32",
        lhs_dilation=None,
        precision=None,
    ):
        ks = (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)
        if not 1 <= len(ks) <= 3:
            raise ValueError(
                f"conv_q supports 1 to 3 spatial axes, got kernel_size={kernel_size!r}."
            )
        nsp = len(ks)
        ks = _positive_ints("kernel_size", ks, nsp)
        strides = _positive_ints(
            "window_strides", 1 if window_strides is None else window_strides, nsp
        )
        dilation = _positive_ints(
            "rhs_dilation", 1 if rhs_dilation is None else rhs_dilation, nsp
        )
        lhs = _positive_ints(
            "lhs_dilation", 1 if lhs_dilation is None else lhs_dilation, nsp
        )
        (groups,) = _positive_ints("feature_group_count", feature_group_count, 1)
        _ops.check_activations("conv_q", activations)
        precision = _ops.check_precision("conv_q", precision)
        _ops.require_float("conv_q", "x", x_aval, min_rank=1)
        _ops.require_qarray("conv_q", "qw", qw_aval)
        operands = f"x: {_ops.type_str(x_aval)}, qw: {_ops.type_str(qw_aval)}"
        if qw_aval.bits == 4 and activations != "float32":
            raise TypeError(
                "conv_q with int4 weights is weight-only (activations='float32'), "
                f"got activations={activations!r} for {operands}."
            )
        if x_aval.ndim not in (nsp + 1, nsp + 2):
            raise TypeError(
                f"conv_q with {nsp} spatial axes (kernel_size={ks}) requires x of "
                f"shape (C, *spatial) or (B, C, *spatial), rank {nsp + 1} or "
                f"{nsp + 2}, got {operands}."
            )
        batched = x_aval.ndim == nsp + 2
        channels = x_aval.shape[-nsp - 1]
        # an lhs-dilated input: l - 1 zeros between neighbours (a transposed
        # convolution's stride)
        spatial = tuple(
            (n - 1) * d + 1 if n else 0
            for n, d in zip(x_aval.shape[-nsp:], lhs, strict=True)
        )
        out_channels, per_out = (*qw_aval.shape, 0, 0)[:2]
        window = math.prod(ks)
        if (
            qw_aval.ndim != 2
            or channels % groups
            or out_channels % groups
            or per_out != channels // groups * window
        ):
            raise TypeError(
                f"conv_q requires qw of shape (out, C / groups * prod(kernel_size)) "
                f"= (out, {channels} / {groups} * {window}) with out divisible by "
                f"feature_group_count={groups} (weights quantized as "
                f"quantize(w.reshape(out, -1))), got {operands}."
            )
        dilated = tuple((k - 1) * d + 1 for k, d in zip(ks, dilation, strict=True))
        pads = _explicit_padding(padding, spatial, dilated, strides)
        padded = tuple(n + lo + hi for n, (lo, hi) in zip(spatial, pads, strict=True))
        out_spatial = tuple(
            (n - k) // s + 1 if n >= k else 0
            for n, k, s in zip(padded, dilated, strides, strict=True)
        )
        if not all(out_spatial):
            raise TypeError(
                f"conv_q: the (dilated) kernel {dilated} is larger than the padded "
                f"input {padded}, got {operands}."
            )
        x_spec = full_spec(x_aval.sharding, x_aval.ndim)
        batch_spec = x_spec[:1] if batched else ()
        if any(p is not None for p in x_spec[len(batch_spec) :]) or any(
            p is not None for p in qw_aval.spec
        ):
            raise TypeError(
                "conv_q shards only x's batch axis (channels, positions and the "
                f"weights replicated), got {operands}."
            )
        out_spec = (*batch_spec, *(None,) * (nsp + 1))
        sharding = (
            x_aval.sharding if x_aval.sharding.mesh.axis_names else qw_aval.sharding
        )
        self.in_avals = (x_aval, qw_aval)
        self.out_aval = ShapedArray(
            (*x_aval.shape[: len(batch_spec)], out_channels, *out_spatial),
            x_aval.dtype,
            sharding=with_spec(sharding, out_spec),
            manual_axis_type=_ops.union_mat(x_aval.manual_axis_type, qw_aval.mat),
        )
        self.params = {
            "kernel_size": ks,
            "window_strides": strides,
            "padding": pads,
            "rhs_dilation": dilation,
            "feature_group_count": groups,
            "lhs_dilation": lhs,
            "activations": activations,
            "precision": precision,
        }
        super().__init__()

    @property
    def _static(self) -> dict:
        """The convolution's parameters, for calling conv_q again (weight-only)."""
        return {k: v for k, v in self.params.items() if k != "activations"}

    def _conv(self, x, w, preferred=None, explicit=True):
        """``lax.conv_general_dilated`` with this primitive's parameters on
        ``w (out, C/groups, *kernel_size)``, ``x`` batched or not, summing in
        ``preferred`` (default: the operands' dtype) at this primitive's
        precision; ``explicit``: give the output sharding of explicit mode
        (False inside ``auto_axes``)."""
        batched = x.ndim == len(self.kernel_size) + 2
        out_sharding = (
            _ops.explicit_spec(self.out_aval) if batched and explicit else None
        )
        out = lax.conv_general_dilated(
            x if batched else x[None],
            w,
            self.window_strides,
            self.padding,
            lhs_dilation=self.lhs_dilation,
            rhs_dilation=self.rhs_dilation,
            dimension_numbers=_dimension_numbers(len(self.kernel_size)),
            feature_group_count=self.feature_group_count,
            precision=None if preferred == jnp.int32 else self.precision,
            preferred_element_type=preferred,
            out_sharding=out_sharding,
        )
        return out if batched else out[0]

    @property
    def _w_shape(self) -> tuple[int, ...]:
        """The dense weights' shape, (out, C/groups, *kernel_size)."""
        out, per_out = self.in_avals[1].shape
        ks = self.kernel_size
        return (out, per_out // math.prod(ks), *ks)

    def _dense_w(self, w2d):
        """(out, C/groups * prod(kernel)) -> (out, C/groups, *kernel)."""
        return w2d.reshape(self._w_shape)

    def expand(self, x, qw):
        x = x.astype(FLOAT32)
        if self.in_avals[1].bits == 4:  # weight-only: each group times its scale
            w = _numerics.dequantize_groups(qw.qvalue, qw.scale)
            y = self._conv(x, self._dense_w(w))
        else:
            y = self.forward(x, qw.qvalue, qw.scale)
        return y.astype(self.out_aval.dtype)

    def forward(self, x, qvalue, scale, strategy=None):
        """The convolution of ``x`` with the parts of ``qw``, in the
        formulation ``strategy`` (one of CONV_STRATEGIES; default: the CPU
        kernel for int8 activations where it runs and pays, else "float_sums"
        for int8 activations, "dequantized" weight-only)."""
        nsp = len(self.kernel_size)
        if strategy == "kernel":
            return self._kernel(x, qvalue, scale)
        if strategy is None and self._kernel_pays(x):
            return lax.platform_dependent(
                cpu=lambda: self._kernel(x, qvalue, scale),
                default=lambda: self.forward(x, qvalue, scale, "float_sums"),
            )
        w = self._dense_w(qvalue)
        scale = scale.reshape(-1, *(1,) * nsp)
        if self.activations == "float32":
            return self._conv(x, w.astype(FLOAT32)) * scale
        # one scale per example: a row of all its channels and positions
        lead = x.shape[: x.ndim - nsp - 1]
        xq, sx = _numerics.quantize_rows(x.reshape(*lead, -1))
        xq, sx = xq.reshape(x.shape), sx.reshape(*lead, 1, *(1,) * nsp)
        if strategy == "int8_conv":
            sums = self._conv(xq, w, preferred=jnp.int32).astype(FLOAT32)
        else:  # integer-valued float32 operands
            sums = self._conv(xq.astype(FLOAT32), w.astype(FLOAT32))
        return sums * (sx * scale)

    def _kernel_pays(self, x) -> bool:
        """Whether the CPU kernel is the default here (see CONV_STRATEGIES):
        int8 activations, no lhs dilation (which the kernel does not do)."""
        return (
            self.activations == "int8"
            and set(self.lhs_dilation) == {1}
            and _ffi.available()
            and not _formulations._explicitly_sharded(x)
        )

    def _kernel(self, x, qvalue, scale):
        """The CPU kernel (``_ffi.conv``) with this primitive's parameters."""
        if set(self.lhs_dilation) != {1}:
            raise ValueError("conv_q's CPU kernel takes no lhs_dilation.")
        nsp = len(self.kernel_size)
        batched = x.ndim == nsp + 2
        xb = x if batched else x[None]
        lead = 3 - nsp
        geometry = (
            *(1,) * lead,
            *self.kernel_size,
            *(1,) * lead,
            *self.window_strides,
            *(0,) * lead,
            *(lo for lo, _ in self.padding),
            *(1,) * lead,
            *self.rhs_dilation,
            self.feature_group_count,
        )
        out_shape = self.out_aval.shape if batched else (1, *self.out_aval.shape)
        y = _ffi.conv(
            xb, qvalue, scale, out_shape, geometry, int8=self.activations == "int8"
        )
        return y if batched else y[0]

    # d conv(x, W) = conv(dx, W) + conv(x, dW), with W = dequantize(qw); the
    # first term is the weight-only conv_q whatever the activations
    def jvp(self, primals, tangents):
        (x, qw), (tx, tw) = primals, tangents
        dtype = self.out_aval.dtype
        return self(x, qw), _ops.product_rule(
            self.out_aval,
            (tx, lambda t: conv_q(t, qw, **self._static)),
            (
                tw,
                lambda t: self._conv(x.astype(FLOAT32), self._dense_w(t)).astype(dtype),
            ),
        )

    lin, linearized = linearize_from_jvp

    def _ct_x(self, g, qw):
        """``g`` pulled back through the convolution with ``W``, typed like x."""
        x_aval = self.in_avals[0]
        w = self._dense_w(dequantize(qw))
        like = jax.ShapeDtypeStruct(
            x_aval.shape,
            FLOAT32,
            sharding=x_aval.sharding,
            manual_axis_type=x_aval.manual_axis_type,
        )
        conv = lambda t: self._conv(t, w)  # noqa: E731
        (ct_x,) = jax.linear_transpose(conv, like)(g.astype(FLOAT32))
        return _ops.sum_to_type(ct_x.astype(x_aval.dtype), x_aval)

    def _ct_w(self, x, g):
        """``g`` pulled back to the weights, laid out (and typed) like qw."""
        w_aval = self.in_avals[1].to_tangent_aval()
        like = jax.ShapeDtypeStruct(self._w_shape, FLOAT32)
        x, g = x.astype(FLOAT32), g.astype(FLOAT32)

        def pull(x, g, explicit=True):
            conv = lambda w: self._conv(x, w, explicit=explicit)  # noqa: E731
            (ct_w,) = jax.linear_transpose(conv, like)(g)
            return ct_w.reshape(w_aval.shape)

        if _ops.explicit_spec(self.in_avals[0]) is None:
            return _ops.sum_to_type(pull(x, g), w_aval)
        # a sum over x's sharded batch axis, whose result sharding explicit
        # mode cannot infer (lax's transpose rule takes no out_sharding): let
        # the partitioner place it, then as the weights are
        return jax.sharding.auto_axes(
            lambda x, g: pull(x, g, explicit=False),
            out_sharding=_ops.explicit_spec(w_aval),
        )(x, g)

    def batch(self, axis_data, args, dims):
        (x, qw), (dx, dq) = args, dims
        params = dict(self._static, activations=self.activations)
        if dq is None:
            if dx is None:
                return self(x, qw), None
            x = jnp.moveaxis(x, dx, 0)
            if x.ndim == len(self.kernel_size) + 2:  # unbatched examples
                return conv_q(x, qw, **params), 0
            # batched examples: merge the two batch axes, one example per row
            size, batch = x.shape[:2]
            y = conv_q(x.reshape(size * batch, *x.shape[2:]), qw, **params)
            return y.reshape(size, batch, *y.shape[1:]), 0
        # one weight matrix per example: loop over the stacked QArray
        if dx is None:
            body = lambda _, q: (None, conv_q(x, q, **params))  # noqa: E731
            xs = qw
        else:
            body = lambda _, xq: (None, conv_q(*xq, **params))  # noqa: E731
            xs = (jnp.moveaxis(x, dx, 0), qw)
        _, ys = lax.scan(body, None, xs, length=axis_data.size)
        return ys, 0


def conv_q(
    x,
    qw,
    kernel_size: int | Sequence[int],
    *,
    window_strides: int | Sequence[int] | None = None,
    padding="VALID",
    rhs_dilation: int | Sequence[int] | None = None,
    feature_group_count: int = 1,
    activations: str = "float32",
    lhs_dilation: int | Sequence[int] | None = None,
    precision=None,
):
    """A convolution of ``x`` (float32, bfloat16 or float16) with quantized
    weights: ``(C, *spatial)`` or ``(B, C, *spatial)`` -> ``(out,
    *out_spatial)`` or ``(B, out, ...)``, in x's dtype.

    ``qw = quantize(w.reshape(out, -1))`` for weights ``w (out, C / groups,
    *kernel_size)`` (PyTorch's and ``eqx.nn.Conv``'s layout), one scale per
    output channel, or ``quantize(w.reshape(out, -1), bits=4, group_size=G)``
    (int4, weight-only). Computes ``lax.conv_general_dilated(x,
    dequantize(qw).reshape(w.shape), window_strides, padding, rhs_dilation=...,
    feature_group_count=...)`` with channels-first dimension numbers; 1 to 3
    spatial axes. ``padding``: "VALID", "SAME", "SAME_LOWER", an int or
    ``(low, high)`` per spatial axis. ``activations="int8"`` quantizes each
    example of ``x`` with one scale for an int8 x int8 convolution.
    ``lhs_dilation`` spreads x's positions ``l`` apart (zeros between) before
    padding: a transposed convolution's stride (``qarray.nn.ConvTranspose``).
    ``precision``: as ``linear_q``'s (JAX's meaning; the sums are float32).
    Derivatives are those of the dense convolution (straight-through): x's
    cotangent in x's dtype.
    """
    return ConvQ(
        jax.typeof(x),
        jax.typeof(qw),
        kernel_size,
        window_strides,
        padding,
        rhs_dilation,
        feature_group_count,
        activations,
        lhs_dilation,
        precision,
    )(x, qw)
