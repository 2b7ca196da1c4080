"""qarray/tesseract/_endpoints.py's one choreography: what ``Endpoints`` asks
of a request by default (its outputs traced, merging once its row fields are
given, the pullback kept as for a nonlinear model), each apply counted once
by the residual cache, vectors checked against the outputs' shapes, and
``check_jacobian`` (the Jacobian's limits); ``request_dict`` (what both
Tesseracts compute on)."""

import jax.numpy as jnp
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


class Rows(BaseModel):
    model_config = {"arbitrary_types_allowed": True}
    x: np.ndarray | None = None
    scale: float = 2.0


def _run(request, *constants):
    """y float (differentiable), n an integer count (not)."""
    x = request["x"]
    return {"y": x * request["scale"], "n": jnp.sum(x > 0).astype(jnp.int32)}


def test_the_defaults_trace_run_and_merge_once_rows_are_given():
    runtime = Runtime.from_env({"QARRAY_VJP_CACHE_SIZE": "2"})
    endpoints = Endpoints(runtime, _run, lambda: (), ["x"])
    given = Rows(x=np.ones((3, 4), np.float32))
    request = request_dict(given)
    assert endpoints.differentiable_outputs(given) == {"y": (3, 4)}
    assert set(endpoints.output_shapes(request)) == {"y", "n"}
    assert endpoints.mergeable(given, request)
    assert not endpoints.mergeable(Rows(), request_dict(Rows()))
    assert not Endpoints(runtime, _run, lambda: ()).mergeable(given, request)
    refuses = Endpoints(runtime, _run, lambda: (), ["x"], mergeable=lambda r: False)
    assert not refuses.mergeable(given, request)
    assert endpoints.cache_pays(given)  # a model's pullback pays for itself
    with pytest.raises(HTTPException) as caught:
        endpoints.apply(Rows.model_construct(x=given.x, scale="no"))  # x * "no"
    assert caught.value.status_code == 422


def test_apply_is_counted_once_and_stops_storing_without_vjps():
    runtime = Runtime.from_env({"QARRAY_VJP_CACHE_SIZE": "2"})
    endpoints = Endpoints(runtime, _run, lambda: (), ["x"])
    given = Rows(x=np.ones((3, 4), np.float32))
    for _ in range(2):
        assert endpoints.cache_pays(given)
        np.testing.assert_array_equal(endpoints.apply(given)["y"], 2 * given.x)
    assert not endpoints.cache_pays(given)  # inference traffic: two applies
    g = np.ones((3, 4), np.float32)
    got = endpoints.vector_jacobian_product(given, {"x"}, {"y"}, {"y": g})
    np.testing.assert_array_equal(got["x"], 2 * g)
    assert endpoints.cache_pays(given)  # a VJP resumes storing


def test_vectors_are_checked_against_the_outputs_and_the_given_paths():
    runtime = Runtime.from_env({})
    endpoints = Endpoints(runtime, _run, lambda: ())
    given = Rows(x=np.ones((3, 4), np.float32))
    cases = [
        (endpoints.vector_jacobian_product, {"y": np.ones((3, 5), np.float32)},
         "cotangent_vector['y'] must have the shape of y (3, 4), got (3, 5)"),
        (endpoints.vector_jacobian_product, {"y": np.full((3, 4), np.nan, np.float32)},
         "cotangent_vector['y'] must be finite"),
        (endpoints.jacobian_vector_product, {"x": np.ones(4, np.float32)},
         "tangent_vector['x'] must have the shape of x (3, 4), got (4,)"),
    ]  # fmt: skip
    for endpoint, vectors, message in cases:
        paths, names = ({"x"}, {"y"})
        with pytest.raises(HTTPException) as caught:
            endpoint(given, paths, names, vectors)
        assert caught.value.status_code == 422
        assert caught.value.detail == message
    with pytest.raises(HTTPException, match="422") as caught:
        endpoints.jacobian(Rows(), {"x"}, {"y"})
    assert "jac_inputs: 'x' names an array this request did not give" in str(
        caught.value.detail
    )
