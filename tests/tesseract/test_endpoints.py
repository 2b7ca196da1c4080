"""qarray/tesseract/_endpoints.py's shared pieces: request_dict (what both
Tesseracts compute on) and Endpoints.check_jacobian (the Jacobian's limits)."""

import numpy as np
import pytest
from fastapi import HTTPException
from pydantic import BaseModel

from qarray.tesseract import Endpoints, Runtime
from qarray.tesseract.internal import request_dict


class Inner(BaseModel):
    a: int
    b: list[int] | None = None


class Outer(BaseModel):
    x: list[float]
    inner: Inner
    items: list[Inner | None]
    table: dict[str, Inner]


def test_request_dict_equals_model_dump():
    model = Outer(
        x=[1.0, 2.0],
        inner=Inner(a=1, b=[2]),
        items=[Inner(a=3), None],
        table={"k": Inner(a=4)},
    )
    got = request_dict(model)
    assert got == model.model_dump()
    assert type(got["table"]) is dict and type(got["items"][0]) is dict


def test_request_dict_keeps_arrays_and_makes_dict_subclasses_plain():
    class Request(dict):
        pass

    x = np.ones(3)
    got = request_dict(Request(x=x, nested=Request(y=x)))
    assert type(got) is dict and type(got["nested"]) is dict
    assert got["x"] is x  # arrays as they are, not copied


def test_check_jacobian_names_the_output_and_input_in_a_422():
    runtime = Runtime.from_env({"QARRAY_MAX_ELEMENTS": "100"})
    endpoints = Endpoints(runtime, lambda request: request, lambda: ())
    endpoints.check_jacobian({"y": (2, 5)}, {"x": (2, 5)})  # 100 elements: in
    with pytest.raises(HTTPException) as caught:
        endpoints.check_jacobian({"y": (3, 5)}, {"x": (3, 5)})
    assert caught.value.status_code == 422
    detail = str(caught.value.detail)
    assert "the Jacobian of y (3, 5) with respect to x (3, 5)" in detail
    assert "use vector_jacobian_product" in detail
    seen = []
    endpoints.check_jacobian({"y": (2,)}, {}, lambda *a: seen.append(a))
    assert seen == [(2, "y", (2,))]
