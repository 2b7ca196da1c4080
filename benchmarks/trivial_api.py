"""A trivial Tesseract (y = x): the HTTP floor of tesseract-runtime serve."""

from pydantic import BaseModel, Field
from tesseract_core.runtime import Array, Float32


class InputSchema(BaseModel):
    x: Array[..., Float32] = Field(description="Any float32 array.")


class OutputSchema(BaseModel):
    y: Array[..., Float32] = Field(description="x, unchanged.")


def apply(inputs: InputSchema) -> OutputSchema:
    """Return x."""
    return OutputSchema(y=inputs.x)
