"""Request limits, checked on declared shapes before any array is decoded."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BeforeValidator
from tesseract_core.runtime.array_encoding import ALLOWED_DTYPE_NAMES

from ._settings import Settings


def declared_shape(value: Any) -> tuple[int, ...] | None:
    """The shape a raw field value declares, without decoding it (None when
    it declares none that can be read: the array validator names the problem)."""
    if isinstance(value, dict) and "shape" in value:
        shape = value["shape"]
        if isinstance(shape, list | tuple) and all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            return tuple(shape)
        return None
    if hasattr(value, "shape"):
        return tuple(value.shape)
    if not isinstance(value, list | tuple):
        return None
    shape = []
    while isinstance(value, list | tuple):  # nested JSON lists
        shape.append(len(value))
        value = value[0] if value else None
    return tuple(shape)


def _castable(declared: Any, dtype: str) -> bool:
    """Whether tesseract-core decodes an array of ``declared`` dtype into a
    ``dtype`` field (its rule: a same-kind cast, or integer to integer)."""
    if declared not in ALLOWED_DTYPE_NAMES:
        return False
    if np.can_cast(declared, dtype, casting="same_kind"):
        return True
    return np.issubdtype(declared, np.integer) and np.issubdtype(dtype, np.integer)


def first_index(mask: np.ndarray) -> tuple[int, ...]:
    """The index of the first true element of ``mask``."""
    return tuple(int(i) for i in np.argwhere(mask)[0])


def require_finite(name: str, value: Any) -> None:
    """ValueError naming ``name`` and the first non-finite entry (decoded
    arrays only: abstract ones have no entries)."""
    if isinstance(value, np.ndarray) and not np.isfinite(value).all():
        index = first_index(~np.isfinite(value))
        raise ValueError(
            f"{name} must be finite, got {value[index]} at index {index} of "
            f"{name} {value.shape}"
        )


def quantized_payload(name: str, qvalue: Any, precision: str) -> Any:
    """A layer's ``w_q.qvalue`` as its precision stores it: int8 in
    [-127, 127], or uint8 (two int4 values a byte) for "int4"; integers of
    another dtype (JSON lists, int16, ...) are cast when they fit. A
    ValueError naming ``name`` otherwise (abstract arrays pass as they are)."""
    if not isinstance(qvalue, np.ndarray):
        return qvalue
    dtype, low, high = ("uint8", 0, 255) if precision == "int4" else ("int8", -127, 127)
    what = "uint8 (two int4 values a byte)" if precision == "int4" else "int8"
    if qvalue.dtype == dtype and precision == "int4":
        return qvalue
    if qvalue.dtype.kind not in "iu":
        raise ValueError(
            f"{name} must be {what} for precision {precision!r}, got "
            f"{qvalue.dtype.name} {qvalue.shape}"
        )
    if qvalue.size and (qvalue.min() < low or qvalue.max() > high):
        bad = (qvalue < low) | (qvalue > high)
        index = first_index(bad)
        raise ValueError(
            f"{name} must lie in [{low}, {high}] ({what}), got {qvalue[index]} at "
            f"index {index} of {name} {qvalue.shape}"
        )
    return qvalue.astype(dtype)


def require_at_least(name: str, value: Any, low, what: str = "") -> None:
    """ValueError naming ``name`` and the first entry below ``low`` (decoded
    arrays only); ``what`` says why the bound holds."""
    if isinstance(value, np.ndarray) and value.size and value.min() < low:
        index = first_index(value < low)
        raise ValueError(
            f"{name} must be >= {low}{what}, got {value[index]} at index {index} of "
            f"{name} {value.shape}"
        )


class Limits:
    """The size limits of ``settings``, as checks for schemas and endpoints."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def array(self, dtype: str | tuple[str, ...]) -> BeforeValidator:
        """For ``Annotated[Array[..., dtype], limits.array(dtype)]``: the
        declared size within QARRAY_MAX_ELEMENTS, and the dtype of an encoded
        array (tesseract-core answers a dtype it cannot cast with "Could not
        parse value as a numeric array"), before the array is decoded.
        ``dtype``: one, or the dtypes a field takes (each exactly)."""

        def check(value: Any) -> Any:
            self.check_declared(declared_shape(value))
            if isinstance(value, dict) and value.get("object_type") == "array":
                declared = value.get("dtype")
                if isinstance(dtype, tuple):  # integer payloads, range-checked later
                    ok = declared in ALLOWED_DTYPE_NAMES and np.issubdtype(
                        declared, np.integer
                    )
                else:
                    ok = _castable(declared, dtype)
                if not ok:
                    want = " or ".join(dtype) if isinstance(dtype, tuple) else dtype
                    raise ValueError(
                        f"the array (declared shape {declared_shape(value)}) has "
                        f"dtype {declared!r}, which does not cast to {want} "
                        f"without loss: send {want}"
                    )
            return value

        return BeforeValidator(check)

    def check_declared(self, shape: tuple[int, ...] | None) -> None:
        if shape is None:
            return
        if any(d < 0 for d in shape):
            raise ValueError(f"declared shape {shape} has a negative dimension")
        limit = self.settings.max_elements
        if math.prod(shape) > limit:
            raise ValueError(
                f"declared shape {shape} has {math.prod(shape)} elements, over the "
                f"limit of {limit} (QARRAY_MAX_ELEMENTS)"
            )

    def in_bounds(self, shape: tuple[int, ...] | None) -> bool:
        """A declared shape the per-array limit accepts."""
        return (
            shape is not None
            and all(d >= 0 for d in shape)
            and math.prod(shape) <= self.settings.max_elements
        )

    def check_result(self, name: str, shape: tuple[int, ...]) -> None:
        size, limit = math.prod(shape), self.settings.max_elements
        if size > limit:
            raise ValueError(
                f"{name} would have shape {shape} ({size} elements), over the limit "
                f"of {limit} (QARRAY_MAX_ELEMENTS)"
            )

    def check_elements(self, what: str, size: int) -> None:
        """``what`` (a result, a Jacobian) of ``size`` elements within
        QARRAY_MAX_ELEMENTS."""
        limit = self.settings.max_elements
        if size > limit:
            raise ValueError(
                f"{what} has {size} elements, over the limit of {limit} "
                "(QARRAY_MAX_ELEMENTS)"
            )

    def check_work(
        self, rows: int, widths: tuple[int, ...], passes: int = 1, what: str = ""
    ) -> None:
        """Elements of x and of every layer's output (``widths``: K0, N0, N1,
        ...) over ``rows`` rows, ``passes`` times, within QARRAY_MAX_WORK; or
        a ValueError naming the layer that passes it."""
        limit = self.settings.max_work
        total = passes * rows * widths[0]
        for i, width in enumerate(widths[1:]):
            total += passes * rows * width
            if total > limit:
                raise ValueError(
                    f"layers.[{i}] brings the request's work to {total} elements "
                    f"(activations of x and layers.[0..{i}] over {rows} rows"
                    f"{what}), over the limit of {limit} (QARRAY_MAX_WORK)"
                )

    def check_layers(self, count: int) -> None:
        limit = self.settings.max_layers
        if count > limit:
            raise ValueError(
                f"layers has {count} layers, over the limit of {limit} "
                "(QARRAY_MAX_LAYERS)"
            )
