"""Checks on the parts of a gradient request the schemas cannot express."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import HTTPException


def unprocessable(message: str) -> HTTPException:
    """A 422 with ``message``'s first line (a traced error's may run long)."""
    lines = message.strip().splitlines() or [""]
    return HTTPException(status_code=422, detail=lines[0][:1000])


def checked_vectors(
    field: str, vectors: dict, like: Callable[[str], tuple[str, tuple]]
) -> dict[str, Any]:
    """Tangents or cotangents, checked: ``like(path)`` gives the name and the
    shape of the array each must match (a ValueError for a path it does not
    know); they must be finite. Returned as float32; a 422 naming the field
    otherwise."""
    for path, v in vectors.items():
        try:
            name, shape = like(path)
        except ValueError as error:
            raise unprocessable(f"{field}: {error}") from None
        if tuple(np.shape(v)) != tuple(shape):
            raise unprocessable(
                f"{field}[{path!r}] must have the shape of {name} {tuple(shape)}, "
                f"got {tuple(np.shape(v))}"
            )
        if not np.isfinite(v).all():
            raise unprocessable(f"{field}[{path!r}] must be finite")
    return {path: np.asarray(v, np.float32) for path, v in vectors.items()}
