"""``qarray.nn.Conv``: one quantized convolution as an equinox module."""

from __future__ import annotations

import math
from collections.abc import Sequence

import equinox as eqx
import jax.numpy as jnp

from .._conv import conv_q
from .._ops import FLOAT_DTYPES
from ._product import QuantizedProduct
from ._weights import (
    check_modes,
    checked_group_size,
    dtype_str,
    require_array,
    stored_width,
)


class Conv(QuantizedProduct):
    """One quantized convolution, ``eqx.nn.Conv``'s conventions: channels
    first, an unbatched ``x (C, *spatial) -> (out, *out_spatial)`` (``vmap``
    for batches; a batched ``(B, C, *spatial)`` works too), 1 to 3 spatial
    axes, zero padding.

    Weights ``(out, C / groups, *kernel_size)`` are quantized as the 2-D
    QArray ``quantize(w.reshape(out, -1))``, one scale per output channel
    (``conv_q``). As ``Linear``: stored (``qvalue (out, C / groups *
    prod(kernel_size))`` int8 and ``scale (out,)``) for serving, or trainable
    (``weight`` float32, bfloat16 or float16, quantized on every call,
    straight-through gradient in its dtype). ``bias``: ``(out,)``. ``x``
    float32, bfloat16 or float16, the output in x's dtype (the bias added
    in it) and ``matmul_precision`` the convolution's ``precision``, as
    ``Linear``'s.

    ``precision="int4"`` (weight-only): each row of ``w.reshape(out, -1)`` in
    groups of ``group_size`` (which must divide ``C / groups *
    prod(kernel_size)``), stored packed: ``qvalue`` uint8 ``(out, K / 2)``,
    ``scale`` ``(out, K / group_size)``.

    ``channel_scale`` ``(C,)`` and ``activation_scale`` ``()``: as
    ``Linear``'s (per input channel; calibrated layers).
    """

    # the fields it shares: Linear's (QuantizedWeights', QuantizedProduct's)
    kernel_size: tuple[int, ...] = eqx.field(static=True)
    stride: tuple[int, ...] = eqx.field(static=True)
    padding: str | tuple[tuple[int, int], ...] = eqx.field(static=True)
    dilation: tuple[int, ...] = eqx.field(static=True)
    groups: int = eqx.field(static=True)

    def __init__(
        self,
        weight=None,
        bias=None,
        *,
        qvalue=None,
        scale=None,
        kernel_size: Sequence[int] | None = None,
        stride: int | Sequence[int] = 1,
        padding: str | int | Sequence = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        activations: str = "float32",
        stored_error: float | None = None,
        precision: str = "int8",
        group_size: int | None = None,
        channel_scale=None,
        activation_scale=None,
        matmul_precision=None,
    ):
        check_modes(
            "Conv", activations, weight, qvalue, scale, "qvalue, scale and kernel_size"
        )
        group_size = checked_group_size(
            "Conv",
            precision,
            group_size,
            activations,
            ("int8", "int4"),
            " (a float32 convolution is eqx.nn.Conv)",
        )
        if weight is None:
            if qvalue is None or scale is None or kernel_size is None:
                raise TypeError("Conv takes qvalue, scale and kernel_size together.")
            per_out = stored_width("Conv", qvalue, scale, precision, group_size)
            if qvalue.ndim != 2:
                raise TypeError(
                    "Conv requires qvalue (out, K) for K = C / groups * "
                    f"prod(kernel_size) (int4: (out, K / 2)), got {dtype_str(qvalue)}."
                )
            kernel_size = tuple(int(k) for k in kernel_size)
            if per_out % math.prod(kernel_size):
                raise TypeError(
                    f"Conv: qvalue {dtype_str(qvalue)} has no whole number of "
                    f"input channels for kernel_size {kernel_size}."
                )
        else:
            require_array("weight", weight, FLOAT_DTYPES, 3, "Conv")
            if not 3 <= weight.ndim <= 5:
                raise TypeError(
                    "Conv requires weight (out, C / groups, *kernel_size) with 1 "
                    f"to 3 spatial axes, got {dtype_str(weight)}."
                )
            kernel_size = tuple(weight.shape[2:])
            per_out = math.prod(weight.shape[1:])
            if precision == "int4" and per_out % group_size:
                raise TypeError(
                    f"Conv (int4) requires K = C / groups * prod(kernel_size) = "
                    f"{per_out} (weight {dtype_str(weight)}) to be a multiple of "
                    f"group_size {group_size}."
                )
        nsp = len(kernel_size)

        def per_axis(v):
            return (int(v),) * nsp if isinstance(v, int) else tuple(int(a) for a in v)

        self._keep_weights(
            weight, qvalue, scale, precision, group_size, stored_error, matmul_precision
        )
        self.kernel_size, self.stride, self.dilation = (
            kernel_size,
            per_axis(stride),
            per_axis(dilation),
        )
        if isinstance(padding, str):
            self.padding = padding.upper()
        elif isinstance(padding, int):
            self.padding = ((padding, padding),) * nsp
        else:
            self.padding = tuple(
                (int(p), int(p)) if isinstance(p, int) else (int(p[0]), int(p[1]))
                for p in padding
            )
        self.groups = int(groups)
        if bias is not None:
            require_array("bias", bias, FLOAT_DTYPES, 1, "Conv")
            if tuple(bias.shape) != (self.out_channels,):
                raise TypeError(
                    f"Conv requires bias of shape ({self.out_channels},), got "
                    f"{dtype_str(bias)}."
                )
        self._keep_inputs(
            bias, channel_scale, activation_scale, activations, self.in_channels
        )

    @classmethod
    def from_float(
        cls,
        weight,
        bias=None,
        *,
        trainable: bool = False,
        **conv,
    ) -> Conv:
        """A layer from float weights ``(out, C / groups, *kernel_size)``,
        kept float and quantized every call (``trainable=True``) or stored
        quantized (the default); ``conv``: stride, padding, dilation, groups,
        activations, precision, group_size, matmul_precision."""
        bias = None if bias is None else jnp.asarray(bias).reshape(-1)
        layer = cls(jnp.asarray(weight), bias, **conv)
        return layer if trainable else layer.frozen()

    @classmethod
    def from_eqx(
        cls,
        conv: eqx.nn.Conv,
        *,
        trainable=False,
        activations="float32",
        precision="int8",
        group_size=None,
        matmul_precision=None,
    ):
        """The quantized counterpart of an ``eqx.nn.Conv`` (zero padding;
        ``ConvTranspose``: of an ``eqx.nn.ConvTranspose``)."""
        if conv.padding_mode != "ZEROS":
            raise ValueError(
                f"{cls.__name__} supports zero padding, got "
                f"padding_mode={conv.padding_mode!r}."
            )
        return cls.from_float(
            conv.weight,
            conv.bias,
            trainable=trainable,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            groups=conv.groups,
            activations=activations,
            precision=precision,
            group_size=group_size,
            matmul_precision=matmul_precision,
            **cls._eqx_extras(conv),
        )

    @staticmethod
    def _eqx_extras(conv) -> dict:
        """What else ``from_eqx`` reads off the equinox layer."""
        return {}

    @property
    def out_channels(self) -> int:
        return (self.weight if self.trainable else self.qvalue).shape[0]

    @property
    def in_channels(self) -> int:
        if self.trainable:
            return self.weight.shape[1] * self.groups
        per_out = self.qvalue.shape[1] * (2 if self.precision == "int4" else 1)
        return per_out // math.prod(self.kernel_size) * self.groups

    def _weight_rows(self, weight):
        """``(out, C/groups, *kernel)`` -> ``(out, C/groups * prod(kernel))``."""
        return weight.reshape(weight.shape[0], -1)

    def __call__(self, x, *, key=None):
        """``x (C, *spatial)`` or ``(B, C, *spatial)`` -> ``(out, ...)``;
        ``key`` is accepted and unused (equinox's convention)."""
        del key
        return self.product(x)

    def product(self, x, qw=None):
        """The convolution with the quantized weights ``qw`` (default:
        ``self.quantized()``)."""
        qw = self.quantized() if qw is None else qw
        x, activations = self._prepared(x, -len(self.kernel_size) - 1)
        parameters = self._conv_parameters() | {"activations": activations}
        y = conv_q(x, qw, self.kernel_size, **parameters)
        return self._plus_bias(y, len(self.kernel_size))

    def _conv_parameters(self) -> dict:
        """``conv_q``'s keyword arguments for this layer."""
        return {
            "window_strides": self.stride,
            "padding": self.padding,
            "rhs_dilation": self.dilation,
            "feature_group_count": self.groups,
            "activations": self.activations,
            "precision": self.matmul_precision,
        }


class ConvTranspose(Conv):
    """One quantized transposed convolution, ``eqx.nn.ConvTranspose``'s
    conventions: weights ``(out, C / groups, *kernel_size)``, ``stride``,
    ``padding`` (that of the forward convolution it transposes: ints, pairs,
    "VALID", "SAME" or "SAME_LOWER"), ``output_padding`` (< stride),
    ``dilation``, ``groups``; zero padding.

    Computed as equinox computes it: the convolution of ``x`` spread
    ``stride`` apart (``conv_q``'s ``lhs_dilation``) with the weights, padded
    ``dilation * (kernel - 1) - padding`` on each side (plus
    ``output_padding`` at the end). Quantization, storage, ``precision``,
    ``trainable`` and gradients are ``Conv``'s.
    """

    output_padding: tuple[int, ...] = eqx.field(static=True)

    def __init__(self, weight=None, bias=None, *, output_padding=0, **conv):
        super().__init__(weight, bias, **conv)
        nsp = len(self.kernel_size)
        extra = (
            (output_padding,) * nsp
            if isinstance(output_padding, int)
            else output_padding
        )
        self.output_padding = tuple(int(a) for a in extra)
        if len(self.output_padding) != nsp or not all(
            0 <= a < s for a, s in zip(self.output_padding, self.stride, strict=True)
        ):
            raise ValueError(
                f"ConvTranspose requires output_padding of {nsp} int(s) in "
                f"[0, stride), got {output_padding!r} with stride {self.stride}."
            )
        pads = self.transposed_padding()
        if any(lo < 0 or hi < 0 for lo, hi in pads):
            raise ValueError(
                f"ConvTranspose supports padding up to dilation * (kernel_size - 1) "
                f"per side, got padding {self.padding} for kernel_size "
                f"{self.kernel_size} and dilation {self.dilation}."
            )

    @staticmethod
    def _eqx_extras(conv) -> dict:
        return {"output_padding": conv.output_padding}

    def transposed_padding(self) -> tuple[tuple[int, int], ...]:
        """The padding of the spread-out input, per spatial axis: with the
        forward padding ``(p0, p1)``, ``(d (k - 1) - p0, d (k - 1) - p1 + a)``
        (Dumoulin and Visin's relationship 14; "SAME" chooses ``p0 + p1 =
        d (k - 1) - s + a + 1``, the surplus at the end, or the start for
        "SAME_LOWER", as equinox does)."""
        pads = []
        for k, s, a, d, p in zip(
            self.kernel_size,
            self.stride,
            self.output_padding,
            self.dilation,
            (None,) * len(self.kernel_size)
            if isinstance(self.padding, str)
            else self.padding,
            strict=True,
        ):
            reach = d * (k - 1)
            if self.padding == "VALID":
                p0 = p1 = 0
            elif isinstance(self.padding, str):  # SAME, SAME_LOWER
                total = reach - s + a + 1
                a, total = (-total, 0) if total < 0 else (a, total)
                p0 = (total + (self.padding == "SAME_LOWER")) // 2
                p1 = total - p0
            else:
                p0, p1 = p
            pads.append((reach - p0, reach - p1 + a))
        return tuple(pads)

    def _conv_parameters(self) -> dict:
        return {
            "window_strides": (1,) * len(self.kernel_size),
            "padding": self.transposed_padding(),
            "lhs_dilation": self.stride,
            "rhs_dilation": self.dilation,
            "feature_group_count": self.groups,
            "activations": self.activations,
            "precision": self.matmul_precision,
        }
