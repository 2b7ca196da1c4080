"""``QuantConfig``: how a model is quantized, one object checked once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from .._ops import ACTIVATION_PRECISIONS, PRECISIONS, check_group_size
from ._calibrate import METHODS
from ._weights import MatmulPrecision, checked_matmul_precision

STATIC_MODES = (False, True, "tensor", "channel")
CLIPS = ("mse", "absmax")


@dataclass(frozen=True)
class QuantConfig:
    """How ``qarray.nn.quantize`` (and what builds on it: ``evaluate``,
    ``plan``, ``ModelTesseract``) quantizes a model; checked here, once
    (ValueError for a value out of its set, TypeError for a wrong type).

    ``precision``: "int8", "int4" (groups of ``group_size``, default 128,
    along each output channel's inputs) or "float32" (nothing quantized);
    ``activations``: "float32" (weight-only) or "int8" (each quantized
    layer's input quantized per row too); ``method``: "rtn", "gptq" or "awq"
    (calibrated: ``quantize(..., data=X)``); ``smoothquant``: an alpha in
    [0, 1] (int8 activations); ``static``: False (dynamic activation
    scales), True / "tensor" or "channel" (int8 activations, ranges from the
    calibration data); ``clip``: how a static range is chosen, "mse" (the
    clipping range with the least squared quantization error on the data)
    or "absmax" (the data's absolute maximum).

    ``matmul_precision``: the ``precision`` every quantized layer passes to
    its products (``linear_q``, ``matmul_q``, ``conv_q``; a
    ``SpectralConv``'s mixing, a LoRA adapter's), with JAX's meaning (as
    ``jnp.dot``'s): None, "default", "high", "highest", a
    ``jax.lax.Precision`` or a pair of them (x's, the weights'); kept as
    given (a list as a tuple), a ValueError naming the field otherwise. The
    default, None, is ``jax.default_matmul_precision``: on CPU the products
    are float32-exact whatever is asked; on a TPU the default is one
    bfloat16 pass over the activations, "highest" float32 throughout. It
    is not the weights' bits: that is ``precision``.
    """

    precision: str = "int8"
    activations: str = "float32"
    group_size: int | None = None
    method: str = "rtn"
    smoothquant: float | None = None
    static: bool | str = False
    clip: str = "mse"
    matmul_precision: MatmulPrecision = None

    # each field's choices, for command lines and schemas
    precisions: ClassVar[tuple[str, ...]] = PRECISIONS
    methods: ClassVar[tuple[str, ...]] = METHODS
    clips: ClassVar[tuple[str, ...]] = CLIPS

    def __post_init__(self):
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("activations", self.activations, ACTIVATION_PRECISIONS)
        _one_of("method", self.method, METHODS)
        _one_of("clip", self.clip, CLIPS)
        # frozen: the checked value is set past the dataclass's guard
        object.__setattr__(
            self,
            "matmul_precision",
            checked_matmul_precision("QuantConfig", self.matmul_precision),
        )
        if self.static not in STATIC_MODES or not isinstance(self.static, bool | str):
            raise ValueError(
                f"QuantConfig: static must be one of {STATIC_MODES}, got "
                f"{self.static!r}."
            )
        if self.group_size is not None:
            if isinstance(self.group_size, bool) or not isinstance(
                self.group_size, int
            ):
                raise TypeError(
                    "QuantConfig: group_size must be an int or None, got "
                    f"{type(self.group_size).__name__}."
                )
            check_group_size("QuantConfig: group_size", self.group_size)
        if self.smoothquant is not None:
            if isinstance(self.smoothquant, bool) or not isinstance(
                self.smoothquant, int | float
            ):
                raise TypeError(
                    "QuantConfig: smoothquant must be a number or None, got "
                    f"{type(self.smoothquant).__name__}."
                )
            if not 0 <= self.smoothquant <= 1:
                raise ValueError(
                    f"QuantConfig: smoothquant must be in [0, 1], got "
                    f"{self.smoothquant!r}."
                )
        w8a8 = [f"smoothquant={self.smoothquant!r}"] * (self.smoothquant is not None)
        w8a8 += [f"static={self.static!r}"] * bool(self.static)
        if w8a8 and self.activations != "int8":
            raise ValueError(
                f"QuantConfig: {' and '.join(w8a8)} calibrate int8 activations: "
                f"needs activations='int8', got {self.activations!r}."
            )
        choosers = [f"method={self.method!r}"] * (self.method == "awq")
        choosers += [f"static={self.static!r}"] * (self.static == "channel")
        choosers += [f"smoothquant={self.smoothquant!r}"] * (
            self.smoothquant is not None
        )
        if len(choosers) > 1:
            raise ValueError(
                f"QuantConfig: {' and '.join(choosers)} each choose a scale per "
                "input channel: take one."
            )

    @property
    def static_mode(self) -> str | None:
        """``static`` as None (dynamic), "tensor" or "channel"."""
        return {False: None, True: "tensor"}.get(self.static, self.static)

    @property
    def calibrated(self) -> bool:
        """Whether quantizing needs calibration data."""
        return self.method != "rtn" or self.smoothquant is not None or bool(self.static)

    def replace(self, **changes) -> QuantConfig:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


def _one_of(name: str, value, allowed: tuple) -> None:
    if not isinstance(value, str):
        raise TypeError(
            f"QuantConfig: {name} must be a string, one of {allowed}, got "
            f"{type(value).__name__}."
        )
    if value not in allowed:
        raise ValueError(
            f"QuantConfig: {name} must be one of {allowed}, got {value!r}."
        )
