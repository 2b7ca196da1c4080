"""A dense float32 Tesseract: the end-to-end baseline of benchmarks/bench_e2e.py.

Written the way tesseract-core's JAX examples are: a pydantic schema, one
``@eqx.filter_jit apply_jit`` over ``inputs.model_dump()``, and every endpoint a
one-line delegation to tesseract-core's ``jax_recipes``. No qarray: the same
request as qarray's Tesseract (``x`` and ``layers`` of ``w`` in layout "kn"
``(K, N)`` or "nk" ``(N, K)``, ``bias``, ``activation``), computed in float32,
answering ``y``. Served the same way as ours (``qarray-serve``, base64).

Environment:
    QARRAY_MODEL  a model file (qarray.checkpoint's layout, dense ``layers.{i}.w``
                  only) loaded at start-up as float32 device arrays: requests
                  that omit ``layers`` run it (the same variable as qarray's
                  Tesseract, so one bench serves both from one file)
"""

from __future__ import annotations

import os
from typing import Literal

import equinox as eqx
import jax.numpy as jnp
from pydantic import BaseModel, Field, model_validator
from tesseract_core.runtime import Array, Differentiable, Float32, jax_recipes

from qarray.tesseract.internal import ACTIVATIONS  # the same nonlinearities


def _load_model(path: str) -> list[dict]:
    """A dense model file's layers as float32 device arrays."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    layers = []
    for i in range(len({name.split(".")[1] for name in tensors})):
        prefix = f"layers.{i}"
        if f"{prefix}.w" not in tensors:
            raise RuntimeError(f"QARRAY_MODEL: {prefix}.w is missing (dense only)")
        bias = tensors.get(f"{prefix}.bias")
        layers.append(
            {
                "w": jnp.asarray(tensors[f"{prefix}.w"], jnp.float32),
                "bias": None if bias is None else jnp.asarray(bias, jnp.float32),
                "layout": metadata.get(f"{prefix}.layout", "kn"),
                "activation": metadata.get(f"{prefix}.activation", "none"),
            }
        )
    return layers


MODEL_PATH = os.environ.get("QARRAY_MODEL", "").strip() or None
RESIDENT = _load_model(MODEL_PATH) if MODEL_PATH else None


class Layer(BaseModel):
    w: Differentiable[Array[(None, None), Float32]] = Field(
        description="Weights, (K, N) for layout 'kn' or (N, K) for 'nk'."
    )
    layout: Literal["kn", "nk"] = Field(
        default="kn", description="'kn': (K, N); 'nk': (N, K), like nn.Linear."
    )
    bias: Differentiable[Array[(None,), Float32]] | None = Field(
        default=None, description="Optional bias, shape (N,)."
    )
    activation: Literal["none", "relu", "gelu", "tanh", "sigmoid", "silu"] = Field(
        default="none", description="Nonlinearity applied after the bias."
    )


class InputSchema(BaseModel):
    x: Differentiable[Array[..., Float32]] = Field(
        description="Input activations, (..., K0)."
    )
    layers: list[Layer] | None = Field(
        default=None if RESIDENT else ...,
        description="The network; optional when a resident model is loaded.",
    )

    @model_validator(mode="after")
    def _check_widths(self):
        width = self.x.shape[-1]
        for i, layer in enumerate(self.layers or ()):
            k, n = layer.w.shape if layer.layout == "kn" else layer.w.shape[::-1]
            if k != width:
                raise ValueError(f"layers.[{i}].w has K = {k}, its input {width}")
            if layer.bias is not None and layer.bias.shape != (n,):
                raise ValueError(f"layers.[{i}].bias must have shape ({n},)")
            width = n
        return self


class OutputSchema(BaseModel):
    y: Differentiable[Array[..., Float32]] = Field(description="The output.")


@eqx.filter_jit
def apply_jit(inputs: dict) -> dict:
    h = inputs["x"]
    for layer in inputs["layers"] or RESIDENT:
        w = layer["w"] if layer["layout"] == "kn" else layer["w"].T
        h = h @ w
        if layer["bias"] is not None:
            h = h + layer["bias"]
        h = ACTIVATIONS[layer["activation"]](h)
    return {"y": h}


def apply(inputs: InputSchema) -> OutputSchema:
    if inputs.layers is None:  # the resident model's arrays as arguments
        return apply_jit({"x": inputs.x, "layers": RESIDENT})
    return jax_recipes.jax_apply(apply_jit, inputs)


def jacobian(inputs: InputSchema, jac_inputs: set[str], jac_outputs: set[str]):
    return jax_recipes.jax_jacobian(apply_jit, inputs, jac_inputs, jac_outputs)


def jacobian_vector_product(
    inputs: InputSchema, jvp_inputs: set[str], jvp_outputs: set[str], tangent_vector
):
    return jax_recipes.jax_jvp(
        apply_jit, inputs, jvp_inputs, jvp_outputs, tangent_vector
    )


def vector_jacobian_product(
    inputs: InputSchema, vjp_inputs: set[str], vjp_outputs: set[str], cotangent_vector
):
    return jax_recipes.jax_vjp(
        apply_jit, inputs, vjp_inputs, vjp_outputs, cotangent_vector
    )


def abstract_eval(abstract_inputs):
    return jax_recipes.jax_abstract_eval(apply_jit, abstract_inputs)
