"""qarray Tesseract: an int8-quantized linear layer as differentiable endpoints.

``y = x @ W + bias`` with ``W`` quantized per row (one float32 scale per K row),
served through tesseract-core's JAX recipes. Gradients are exact for ``x``,
``bias`` and ``w_q.scale`` and straight-through for ``w`` (quantization acts as
the identity for derivatives). This module is thin on purpose: request
validation here, everything numeric in ``qarray``.

Environment:
    QARRAY_MAX_ELEMENTS    largest array (declared shape, any field) and largest
                           result accepted, in elements (default 33554432)
    QARRAY_VJP_CACHE_SIZE  entries in the VJP residual cache (default 8; 0 = off)
    QARRAY_VJP_CACHE_MIN_INTENSITY
                           apply stores its pullback in the cache only when the
                           product costs at least this many flops per input
                           element, 2*M*K*N / (M*K + K*N + N) (default 2**20,
                           i.e. not for any shape QARRAY_MAX_ELEMENTS admits:
                           see _cache_pays); 0 caches every apply
"""

from __future__ import annotations

import functools
import math
import os
from typing import Annotated, Any, Literal, Self

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from fastapi import HTTPException
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from tesseract_core.runtime import Array, Differentiable, Float32, Int8, jax_recipes
from tesseract_core.runtime.experimental import set_jax_vjp_cache_size

import qarray as qa


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw.strip() else default
    except ValueError:
        raise RuntimeError(f"{name} must be an integer, got {raw!r}.") from None
    if value < minimum:
        raise RuntimeError(f"{name} must be >= {minimum}, got {value}.")
    return value


MAX_ELEMENTS = _env_int("QARRAY_MAX_ELEMENTS", 2**25, minimum=1)
VJP_CACHE_SIZE = _env_int("QARRAY_VJP_CACHE_SIZE", 8, minimum=0)
VJP_CACHE_MIN_INTENSITY = _env_int("QARRAY_VJP_CACHE_MIN_INTENSITY", 2**20, minimum=0)
set_jax_vjp_cache_size(VJP_CACHE_SIZE)


# --- size limits, checked on the declared shape before any array is decoded


def _declared_shape(value: Any) -> tuple[int, ...] | None:
    """The shape a raw field value declares, without decoding it."""
    if isinstance(value, dict) and "shape" in value:
        shape = value["shape"]
        if isinstance(shape, list | tuple) and all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            return tuple(shape)
        return None  # malformed: the array validator names the problem
    if hasattr(value, "shape"):
        return tuple(value.shape)
    shape = []
    while isinstance(value, list | tuple):  # nested JSON lists
        shape.append(len(value))
        value = value[0] if value else None
    return tuple(shape)


def _limit_size(value: Any) -> Any:
    shape = _declared_shape(value)
    if shape is not None and any(d < 0 for d in shape):
        raise ValueError(f"declared shape {shape} has a negative dimension")
    if shape is not None and math.prod(shape) > MAX_ELEMENTS:
        raise ValueError(
            f"declared shape {shape} has {math.prod(shape)} elements, over the "
            f"limit of {MAX_ELEMENTS} (QARRAY_MAX_ELEMENTS)"
        )
    return value


SizeLimited = BeforeValidator(_limit_size)


def _shape(value: Any) -> tuple[int, ...] | None:
    """Shape of a decoded array or of an abstract ShapeDType (abstract_eval)."""
    return None if value is None else tuple(value.shape)


def _concrete(value: Any) -> bool:
    return isinstance(value, np.ndarray)


def _require_finite(name: str, value: Any) -> None:
    if _concrete(value) and not np.isfinite(value).all():
        index = tuple(int(i) for i in np.argwhere(~np.isfinite(value))[0])
        raise ValueError(
            f"{name} must be finite, got {value[index]} at index {index} of "
            f"{name} {value.shape}"
        )


# --- schemas


class QuantizedWeights(BaseModel):
    """Weights already quantized per row: ``W = qvalue * scale[:, None]``."""

    qvalue: Annotated[Array[(None, None), Int8], SizeLimited] = Field(
        description="int8 payload, shape (K, N), values in [-127, 127]."
    )
    scale: Annotated[Differentiable[Array[(None,), Float32]], SizeLimited] = Field(
        description="One float32 scale per row, shape (K,), finite and >= 0."
    )

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _check(self) -> Self:
        k = _shape(self.qvalue)[0]
        if _shape(self.scale) != (k,):
            raise ValueError(
                f"w_q.scale must have shape (K,) = ({k},) to match w_q.qvalue "
                f"{_shape(self.qvalue)}, got {_shape(self.scale)}"
            )
        if _concrete(self.qvalue) and self.qvalue.size and self.qvalue.min() < -127:
            raise ValueError(
                "w_q.qvalue must lie in [-127, 127] (symmetric int8), got -128"
            )
        _require_finite("w_q.scale", self.scale)
        if _concrete(self.scale) and (self.scale < 0).any():
            raise ValueError("w_q.scale must be >= 0, got a negative scale")
        return self


class InputSchema(BaseModel):
    x: Annotated[Differentiable[Array[..., Float32]], SizeLimited] = Field(
        description="Activations, float32 of shape (..., K): any leading axes."
    )
    w: Annotated[Differentiable[Array[(None, None), Float32]], SizeLimited] | None = (
        Field(
            default=None,
            description=(
                "Dense weights (K, N), quantized per row (one scale per K row) on "
                "every call; straight-through gradient. Give exactly one of w, w_q."
            ),
        )
    )
    w_q: QuantizedWeights | None = Field(
        default=None,
        description="Pre-quantized weights {qvalue (K, N), scale (K,)}. Give "
        "exactly one of w, w_q.",
    )
    bias: Annotated[Differentiable[Array[(None,), Float32]], SizeLimited] | None = (
        Field(default=None, description="Optional bias, shape (N,).")
    )
    activations: Literal["float32", "int8"] = Field(
        default="float32",
        description='"float32": weight-only quantization (default). "int8": the '
        "activations are quantized per row too, for an int8 x int8 product; "
        "gradients stay those of the dense product (straight-through).",
    )

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.w is None) == (self.w_q is None):
            got = "both" if self.w is not None else "neither"
            raise ValueError(f"give exactly one of w and w_q, got {got}")
        x_shape = _shape(self.x)
        if not x_shape:
            raise ValueError(
                "x must have shape (..., K) with at least one axis, got ()"
            )
        name, w_shape = (
            ("w", _shape(self.w))
            if self.w is not None
            else ("w_q.qvalue", _shape(self.w_q.qvalue))
        )
        k, n = w_shape
        if x_shape[-1] != k:
            raise ValueError(
                f"x.shape[-1] must equal {name}.shape[0] (K), got x {x_shape} and "
                f"{name} {w_shape}"
            )
        if self.bias is not None and _shape(self.bias) != (n,):
            raise ValueError(
                f"bias must have shape (N,) = ({n},) to match {name} {w_shape}, got "
                f"{_shape(self.bias)}"
            )
        y_size = math.prod(x_shape[:-1]) * n
        if y_size > MAX_ELEMENTS:
            raise ValueError(
                f"y would have shape {(*x_shape[:-1], n)} ({y_size} elements), over "
                f"the limit of {MAX_ELEMENTS} (QARRAY_MAX_ELEMENTS)"
            )
        _require_finite("x", self.x)
        _require_finite("w", self.w)
        _require_finite("bias", self.bias)
        return self


class QuantizedWeightsOut(BaseModel):
    qvalue: Array[(None, None), Int8] = Field(description="int8 payload (K, N).")
    scale: Array[(None,), Float32] = Field(description="One scale per row (K,).")


class OutputSchema(BaseModel):
    y: Differentiable[Array[..., Float32]] = Field(
        description="x @ W + bias, float32 of shape (..., N)."
    )
    w_q: QuantizedWeightsOut | None = Field(
        description="The quantized weights when w was given (reuse them as w_q), "
        "else null."
    )
    weight_error: Float32 = Field(
        description="Relative quantization error ||w - W|| / ||w|| of the weights "
        "used (0 when w_q was given or w is zero)."
    )


# --- the computation


def apply_jit(inputs: dict) -> dict:
    """inputs (as InputSchema.model_dump()) -> outputs (as OutputSchema), compiled.

    What tesseract-core's jax_recipes differentiate. A plain function over one
    jax.jit (activations static) rather than eqx.filter_jit: filter_jit's
    per-call partitioning measured ~50 us, a third of a small apply's latency.
    """
    arrays = {k: v for k, v in inputs.items() if k != "activations"}
    return _compute(arrays, activations=inputs["activations"])


@functools.partial(jax.jit, static_argnames="activations")
def _compute(inputs: dict, activations: str) -> dict:
    x = jnp.asarray(inputs["x"])
    w_q_out, weight_error = None, jnp.float32(0.0)
    if inputs["w"] is not None:
        w = jnp.asarray(inputs["w"])
        qw = qa.quantize(w)
        qvalue, scale = qa.unpack(qw)
        w_q_out = {"qvalue": qvalue, "scale": scale}
        w_norm = jnp.linalg.norm(w)
        error = jnp.linalg.norm(w - qa.dequantize(qw)) / jnp.where(
            w_norm > 0, w_norm, 1
        )
        # a diagnostic output: it carries no derivative
        weight_error = jax.lax.stop_gradient(error)
    else:
        parts = inputs["w_q"]
        qw = qa.pack(jnp.asarray(parts["qvalue"]), jnp.asarray(parts["scale"]))
    y = qa.matmul_q(x, qw, activations)
    if inputs["bias"] is not None:
        y = y + jnp.asarray(inputs["bias"])
    return {"y": y, "w_q": w_q_out, "weight_error": weight_error}


def _as_dict(inputs: InputSchema) -> dict:
    """inputs.model_dump(), without its cost (~50 us on small requests)."""
    out = dict(inputs)
    if inputs.w_q is not None:
        out["w_q"] = dict(inputs.w_q)
    return out


def apply(inputs: InputSchema) -> OutputSchema:
    """y = x @ W + bias with int8 per-row quantized W."""
    if jax_recipes._jax_vjp_cache is None or not _cache_pays(inputs):
        # NumPy straight into the compiled call: converting each input to a jax
        # array first (as_jax_arrays) costs more than the whole small product
        return apply_jit(_as_dict(inputs))
    return _apply_and_cache_pullback(inputs)


# --- the VJP residual cache
#
# tesseract-core's jax_apply fills its LRU with an eager jax.vjp of apply_jit,
# which pays Python dispatch per call and made apply + vjp slower than
# recomputing (benchmarks/bench_cache.py measures both). Here one compiled call
# runs the forward pass and returns its pullback (jax.vjp inside jit: the
# pullback is a pytree of residuals), stored in the same LRU under the same key
# (tesseract-core's device fingerprint of the inputs), in the form
# jax_recipes.jax_vjp reads. jax_vjp is unchanged: on a hit it calls the
# compiled pullback, on a miss it recomputes.


def _cache_pays(inputs: InputSchema) -> bool:
    """Whether apply should store its pullback (see QARRAY_VJP_CACHE_MIN_INTENSITY).

    Measured (benchmarks/bench_cache.py): a hit saves less than it costs here.
    y = x @ W + b is linear, so the VJP never needs y and XLA drops the product
    from the recomputed forward pass: a miss recomputes only quantize(w). A hit
    instead pays tesseract-core's key, a device fingerprint of every input,
    computed on apply and again on vjp, plus a bitwise compare. So by default
    apply does not cache; the threshold is there for hardware where hashing is
    cheap relative to the product, or to force caching (0).
    """
    k, n = _weights_shape(inputs)
    m = math.prod(inputs.x.shape[:-1])
    flops, elements = 2 * m * k * n, m * k + k * n + n
    return flops >= VJP_CACHE_MIN_INTENSITY * max(elements, 1)


# plain jax.jit, not eqx.filter_jit: the pullback's residuals include QArray
# values, which filter_jit would take for static (non-array) outputs
@functools.partial(jax.jit, static_argnames="activations")
def _forward_with_pullback(arrays: dict, activations: str):
    diff, nondiff = eqx.partition(arrays, eqx.is_inexact_array)

    def forward(diff):
        out = _compute(eqx.combine(diff, nondiff), activations=activations)
        return {"y": out["y"]}, out

    _, pullback, out = jax.vjp(forward, diff, has_aux=True)
    return out, pullback


@jax.jit
def _run_pullback(pullback, cotangent):
    return pullback(cotangent)


def _apply_and_cache_pullback(inputs: InputSchema) -> dict:
    inputs_dict = jax_recipes.as_jax_arrays(inputs.model_dump())
    arrays = {k: v for k, v in inputs_dict.items() if k != "activations"}
    out, pullback = _forward_with_pullback(arrays, inputs_dict["activations"])
    # jax_vjp looks the same key up and calls vjp_func(cotangent shaped like
    # the template)
    jax_recipes._jax_vjp_cache.put(
        jax_recipes._cache_key(inputs_dict),
        (functools.partial(_run_pullback, pullback), {"y": out["y"]}),
    )
    return out


def abstract_eval(abstract_inputs):
    """Output shapes and dtypes from input shapes and dtypes, without computing."""
    return jax_recipes.jax_abstract_eval(apply_jit, abstract_inputs)


# --- gradient endpoints: request checks the runtime's schemas cannot express,
# then one call into the recipes


def _bad_request(message: str) -> HTTPException:
    return HTTPException(status_code=422, detail=message)


def _require_given(inputs: InputSchema, paths: set[str], field: str) -> None:
    for path in sorted(paths):
        head, _, _ = path.partition(".")
        if getattr(inputs, head) is None:
            other = "w_q" if head == "w" else "w"
            raise _bad_request(
                f"{field} names {path!r}, which this request did not give "
                f"(it gave {other})"
                if head in ("w", "w_q")
                else f"{field} names {path!r}, which this request did not give"
            )


def _weights_shape(inputs: InputSchema) -> tuple[int, int]:
    """(K, N) of whichever weights the request gave."""
    return (inputs.w if inputs.w is not None else inputs.w_q.qvalue).shape


def _y_shape(inputs: InputSchema) -> tuple[int, ...]:
    return (*inputs.x.shape[:-1], _weights_shape(inputs)[1])


def _input_shape(inputs: InputSchema, path: str) -> tuple[int, ...]:
    value = inputs
    for part in path.split("."):
        value = getattr(value, part)
    return tuple(value.shape)


def jacobian(inputs: InputSchema, jac_inputs: set[str], jac_outputs: set[str]):
    """d y / d (jac_inputs), each of shape y.shape + input.shape."""
    _require_given(inputs, jac_inputs, "jac_inputs")
    y_size = math.prod(_y_shape(inputs))
    for path in jac_inputs:
        size = y_size * math.prod(_input_shape(inputs, path))
        if size > MAX_ELEMENTS:
            raise _bad_request(
                f"the Jacobian of y {_y_shape(inputs)} with respect to {path} "
                f"{_input_shape(inputs, path)} has {size} elements, over the limit "
                f"of {MAX_ELEMENTS} (QARRAY_MAX_ELEMENTS): use "
                "vector_jacobian_product or jacobian_vector_product"
            )
    return jax_recipes.jax_jacobian(apply_jit, inputs, jac_inputs, jac_outputs)


def jacobian_vector_product(
    inputs: InputSchema,
    jvp_inputs: set[str],
    jvp_outputs: set[str],
    tangent_vector: dict[str, Any],
):
    """Tangent of y for tangents of jvp_inputs (each shaped like its input)."""
    _require_given(inputs, jvp_inputs, "jvp_inputs")
    tangents = _checked_vectors(
        "tangent_vector", tangent_vector, lambda p: (p, _input_shape(inputs, p))
    )
    return jax_recipes.jax_jvp(apply_jit, inputs, jvp_inputs, jvp_outputs, tangents)


def vector_jacobian_product(
    inputs: InputSchema,
    vjp_inputs: set[str],
    vjp_outputs: set[str],
    cotangent_vector: dict[str, Any],
):
    """Cotangents of vjp_inputs for a cotangent of y (shaped like y)."""
    _require_given(inputs, vjp_inputs, "vjp_inputs")
    cotangents = _checked_vectors(
        "cotangent_vector", cotangent_vector, lambda p: ("y", _y_shape(inputs))
    )
    return jax_recipes.jax_vjp(apply_jit, inputs, vjp_inputs, vjp_outputs, cotangents)


def _checked_vectors(field: str, vectors: dict[str, Any], like) -> dict[str, Any]:
    """Tangents / cotangents, checked: ``like(path)`` names the array each must
    match and its shape; they must be finite. Returned as float32."""
    for path, v in vectors.items():
        name, shape = like(path)
        if tuple(np.shape(v)) != shape:
            raise _bad_request(
                f"{field}[{path!r}] must have the shape of {name} {shape}, got "
                f"{tuple(np.shape(v))}"
            )
        if not np.isfinite(v).all():
            raise _bad_request(f"{field}[{path!r}] must be finite")
    return {path: np.asarray(v, np.float32) for path, v in vectors.items()}
