"""A trivial Tesseract: the HTTP floor of tesseract-runtime serve.

It takes the same request as qarray's apply (x and one layer's w) and answers with x, so
the comparison isolates what qarray adds on top of the framework: validation,
the computation, and its extra outputs.
"""

from pydantic import BaseModel, Field
from tesseract_core.runtime import Array, Float32


class Layer(BaseModel):
    w: Array[..., Float32] = Field(description="Any float32 array (ignored).")


class InputSchema(BaseModel):
    x: Array[..., Float32] = Field(description="Any float32 array.")
    layers: list[Layer] = Field(description="Layers (ignored).")


class OutputSchema(BaseModel):
    y: Array[..., Float32] = Field(description="x, unchanged.")


def apply(inputs: InputSchema) -> OutputSchema:
    """Return x."""
    return OutputSchema(y=inputs.x)
