"""``qarray.nn.SpectralConv``: the Fourier layer of a Fourier neural operator,
with its complex spectral weights stored int8 (or int4)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._ops import FLOAT_DTYPES
from .._primitives import dequantize
from ._weights import QuantizedWeights, checked_group_size, stored_width


def kept_frequencies(n: int, m: int, last: bool) -> np.ndarray:
    """The indices of the ``m`` lowest frequencies of an FFT axis of ``n``
    points: ``0 .. m - 1`` on the last (rFFT) axis, else the non-negative
    ``0 .. ceil(m / 2) - 1`` then the negative ``-floor(m / 2) .. -1``
    (FFT order)."""
    if last:
        return np.arange(m)
    return np.r_[0 : (m + 1) // 2, n - m // 2 : n]


class SpectralConv(QuantizedWeights):
    """``x (..., in_channels, *spatial) -> (..., out_channels, *spatial)``:
    an rFFT over the ``len(modes)`` spatial axes (1 to 3), the lowest
    ``modes`` frequencies of each axis (``kept_frequencies``) mixed across
    channels by complex weights ``(in, out, *modes)``, every other frequency
    zero, an inverse rFFT back to the input's spatial shape. No bias (an FNO
    block adds a pointwise 1 x 1 ``Conv``); no key used at call time.

    ``SpectralConv(in, out, modes, key=k)`` is float and trainable: its
    ``weight`` float32 (or ``dtype``) ``(in, out, *modes, 2)`` holds the
    real and imaginary parts (real leaves: optimisers step them as they do
    any other, where a complex leaf's JAX gradient is the conjugate of the
    descent direction; and safetensors stores them), FNO's initialisation,
    uniform in [0, 1 / (in * out)) for both parts. ``qnn.quantize`` stores
    it quantized: the
    weights as rows, one per output channel and mode (``out * prod(modes)``
    rows of the ``2 * in`` real and imaginary parts of that mode's input
    weights, interleaved), int8 with a scale per row, or int4 packed with a
    scale per group of ``group_size`` entries of a row (``group_size``
    dividing ``2 * in``): a mode's weights share their dynamic range, which
    falls steeply from the low modes to the high ones. With
    ``trainable=True`` the float weights are quantized on every call.

    Gradients with respect to ``x`` are exact for the layer as stored;
    with respect to trainable weights, straight-through; with respect to
    stored scales, exact.

    ``x`` float32, bfloat16 or float16, the output in x's dtype: the FFTs
    and the mixing run in float32 (complex64; XLA has no bfloat16 FFT), the
    result rounded once. The weights may be bfloat16 or float16 too
    (``dtype=`` at initialisation, or a cast model); their gradients come in
    their dtype. ``matmul_precision``: the mixing's ``precision`` (JAX's
    meaning, as ``Linear``'s).
    """

    # the fields it shares, QuantizedWeights': weight float (in, out,
    # *modes, 2), real and imaginary parts; qvalue int8 (rows, 2 in), int4
    # uint8 (rows, in); scale (rows,), int4 (rows, 2 in / group_size); ...
    in_channels: int = eqx.field(static=True)
    out_channels: int = eqx.field(static=True)
    modes: tuple[int, ...] = eqx.field(static=True)

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        modes: int | Sequence[int],
        *,
        key=None,
        weight=None,
        qvalue=None,
        scale=None,
        precision: str = "float32",
        group_size: int | None = None,
        stored_error: float | None = None,
        matmul_precision=None,
        dtype=None,
    ):
        """``dtype``: the initialised weights' (default float32), as
        equinox's layers take it."""
        modes = (modes,) if isinstance(modes, int) else tuple(int(m) for m in modes)
        if not 1 <= len(modes) <= 3 or min(modes) < 1:
            raise ValueError(
                f"SpectralConv takes 1 to 3 positive modes (one per spatial axis), "
                f"got {modes!r}."
            )
        group_size = checked_group_size(
            "SpectralConv", precision, group_size, "float32"
        )
        if group_size is not None and (2 * in_channels) % group_size:
            raise ValueError(
                f"SpectralConv (int4) requires group_size to divide "
                f"2 * in_channels = {2 * in_channels}, got {group_size!r}."
            )
        self.in_channels, self.out_channels, self.modes = (
            int(in_channels),
            int(out_channels),
            modes,
        )
        if qvalue is not None or scale is not None:
            if weight is not None or precision == "float32":
                raise TypeError(
                    "SpectralConv takes either weight (float32 or trainable) or "
                    "qvalue and scale (stored int8 / int4), not both."
                )
            width = stored_width("SpectralConv", qvalue, scale, precision, group_size)
            rows = self.out_channels * math.prod(modes)
            if width != 2 * self.in_channels or qvalue.shape[0] != rows:
                raise TypeError(
                    f"SpectralConv requires stored rows (out * prod(modes), 2 * in) "
                    f"= ({rows}, {2 * self.in_channels}), got qvalue "
                    f"{qvalue.dtype}{tuple(qvalue.shape)}."
                )
        else:
            weight = self._checked_weight(weight, key, dtype)
        self._keep_weights(
            weight, qvalue, scale, precision, group_size, stored_error, matmul_precision
        )

    def _checked_weight(self, weight, key, dtype):
        """The float weights given, or FNO's initialisation from ``key``,
        once they are ``(in, out, *modes, 2)`` of a float dtype."""
        if weight is None:
            if key is None:
                raise TypeError("SpectralConv needs a key to initialise its weights.")
            shape = (self.in_channels, self.out_channels, *self.modes, 2)
            bound = 1.0 / (self.in_channels * self.out_channels)
            dtype = jnp.float32 if dtype is None else dtype
            weight = jax.random.uniform(key, shape, dtype, maxval=bound)
        want = (self.in_channels, self.out_channels, *self.modes, 2)
        dtype = getattr(weight, "dtype", None)
        if tuple(getattr(weight, "shape", ())) != want or dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"SpectralConv requires weight float32, bfloat16 or float16 (in, "
                f"out, *modes, 2) = {want} (real and imaginary parts), got {dtype}"
                f"{tuple(getattr(weight, 'shape', ()))}."
            )
        return weight

    def _weight_rows(self, weight):
        """(in, out, *modes, 2) -> rows (out * prod(modes), 2 in)."""
        return jnp.moveaxis(weight, 0, -2).reshape(-1, 2 * self.in_channels)

    def _parts(self, rows):
        """The inverse of ``_weight_rows``."""
        parts = rows.reshape(self.out_channels, *self.modes, self.in_channels, 2)
        return jnp.moveaxis(parts, -2, 0)

    def spectral_weight(self):
        """The complex weights ``(in, out, *modes)`` the layer multiplies by
        (dequantized for a quantized layer: straight-through when
        trainable)."""
        if self.precision == "float32":
            # complex64: a bfloat16 or float16 layer's parts are widened
            parts = jnp.asarray(self.weight).astype(jnp.float32)
        else:
            parts = self._parts(dequantize(self.quantized()))
        return jax.lax.complex(parts[..., 0], parts[..., 1])

    def __call__(self, x, *, key=None):
        """``x (..., in_channels, *spatial)``; ``key`` is accepted and unused."""
        del key
        return self.through_modes(x, self.mixing())

    def mixing(self):
        """The layer's mixing of the kept modes, complex ``(...,
        in_channels, *modes) -> (..., out_channels, *modes)``, for
        ``through_modes`` (its weights computed once, here)."""
        weight = self.spectral_weight()
        letters = "xyz"[: len(self.modes)]
        return lambda kept: jnp.einsum(
            f"...i{letters},io{letters}->...o{letters}",
            kept,
            weight,
            precision=self.matmul_precision,
        )

    def through_modes(self, x, mix):
        """The layer with ``mix`` for its weights: an rFFT of ``x (...,
        in_channels, *spatial)``, ``mix`` of the kept modes (complex ``(...,
        in_channels, *modes) -> (..., out_channels, *modes)``), every other
        frequency zero, the inverse rFFT (what ``qnn.lora``'s adapter shares
        with the base: one transform for both)."""
        x = jnp.asarray(x)
        nsp = len(self.modes)
        if x.ndim < nsp + 1 or x.shape[-nsp - 1] != self.in_channels:
            raise TypeError(
                f"SpectralConv({self.in_channels} -> {self.out_channels}, modes "
                f"{self.modes}) requires x of shape (..., {self.in_channels}, "
                f"*{nsp} spatial axes), got {x.dtype}{x.shape}."
            )
        spatial = x.shape[-nsp:]
        limits = (*spatial[:-1], spatial[-1] // 2 + 1)
        if any(m > n for m, n in zip(self.modes, limits, strict=True)):
            raise TypeError(
                f"SpectralConv modes {self.modes} exceed the frequencies of "
                f"spatial shape {spatial} (at most {limits})."
            )
        axes = tuple(range(x.ndim - nsp, x.ndim))
        # at least float32: XLA's FFTs are float32 / float64 (no bfloat16)
        wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        spectrum = jnp.fft.rfftn(wide, axes=axes)
        index = [
            kept_frequencies(n, m, i == nsp - 1)
            for i, (n, m) in enumerate(zip(spatial, self.modes, strict=True))
        ]
        grid = np.ix_(*index)
        mixed = mix(spectrum[(..., slice(None), *grid)])  # (..., out, *modes)
        out = jnp.zeros((*x.shape[: -nsp - 1], self.out_channels, *limits), mixed.dtype)
        out = out.at[(..., slice(None), *grid)].set(mixed)
        return jnp.fft.irfftn(out, s=spatial, axes=axes).astype(x.dtype)

    def as_precision(
        self, precision: str, *, trainable: bool, group_size=None, matmul_precision=None
    ):
        """This float layer at ``precision``: quantized every call
        (``trainable``) or stored now, its mixing at ``matmul_precision``."""
        layer = dataclasses.replace(
            self,
            precision=precision,
            group_size=group_size,
            stored_error=None,
            matmul_precision=matmul_precision,
        )
        return layer if trainable else layer.frozen()
