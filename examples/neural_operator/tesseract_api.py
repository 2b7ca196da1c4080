"""A Fourier neural operator for the steady heat equation, served int8 (or
int4) with gradients: log_k (B, 32, 32) -> u (B, 32, 32) (fno.py).

The weights: fno.safetensors beside this file (QARRAY_MODEL overrides it),
float32 quantized to int8 at start-up, or a stored int4 file (the pipeline's
fno_int4.safetensors) as stored. ModelTesseract gives the endpoints, guard,
limits and residual cache; ``lora``, rank-1 adapters (qlora.py).
"""

from pathlib import Path
from typing import Annotated

import jax
from fno import FNO, GRID
from pydantic import BaseModel, Field
from tesseract_core.runtime import Array, Differentiable, Float32

from qarray.tesseract import ModelTesseract


def forward(model, inputs: dict) -> dict:
    """Each field through the operator (equinox models take one example)."""
    return {"u": jax.vmap(model)(inputs["log_k"][:, None])[:, 0]}


TESSERACT = ModelTesseract(
    FNO(jax.random.key(0)),
    forward,
    model_file=Path(__file__).with_name("fno.safetensors"),
    lora_rank=1,
    batch_inputs=["log_k"],  # concurrent requests merge along B
)
RUNTIME = TESSERACT.runtime  # qarray-serve reads the settings here
Fields = Differentiable[Array[(None, GRID, GRID), Float32]]


class InputSchema(BaseModel):
    log_k: Annotated[Fields, TESSERACT.limits.array("float32")] = Field(
        description=f"Log-conductivity fields, (B, {GRID}, {GRID}) on the unit "
        "square's cell centres."
    )
    lora: TESSERACT.Lora = Field(
        None, description="Adapters {a, b} or null per layer (qnn.adapter_shapes)."
    )


class OutputSchema(BaseModel):
    u: Fields = Field(
        description=f"Temperatures (B, {GRID}, {GRID}): -div(exp(log_k) grad u) = 1, "
        "u = 0 on the boundary, as the quantized FNO predicts them."
    )


def apply(inputs: InputSchema) -> OutputSchema:
    return TESSERACT.apply(inputs)


def abstract_eval(abstract_inputs):
    return TESSERACT.abstract_eval(abstract_inputs)


def jacobian(inputs: InputSchema, jac_inputs: set[str], jac_outputs: set[str]):
    return TESSERACT.jacobian(inputs, jac_inputs, jac_outputs)


def jacobian_vector_product(
    inputs: InputSchema, jvp_inputs, jvp_outputs, tangent_vector
):
    return TESSERACT.jacobian_vector_product(
        inputs, jvp_inputs, jvp_outputs, tangent_vector
    )


def vector_jacobian_product(
    inputs: InputSchema, vjp_inputs, vjp_outputs, cotangent_vector
):
    return TESSERACT.vector_jacobian_product(
        inputs, vjp_inputs, vjp_outputs, cotangent_vector
    )
