"""tesseract-core's JAX recipe helpers on functions that quantize internally:
matmul_q (weights stored (k, n)) and linear_q (weights stored (n, k))."""

import equinox as eqx
import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict
from tesseract_core.runtime import jax_recipes
from tesseract_core.runtime.experimental import set_jax_vjp_cache_size

import qarray as qa
from support import reference as ref

# rerun on XLA's formulations alone where the kernels ran (make test)
pytestmark = pytest.mark.formulations

RTOL = ATOL = 2e-4


class Inputs(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    x: np.ndarray
    w: np.ndarray


class AbstractInputs(BaseModel):
    x: dict
    w: dict


@eqx.filter_jit
def apply_kn(inputs: dict) -> dict:
    return {"y": qa.matmul_q(inputs["x"], qa.quantize(inputs["w"]))}


@eqx.filter_jit
def apply_nk(inputs: dict) -> dict:
    return {"y": qa.linear_q(inputs["x"], qa.quantize(inputs["w"]))}


# layout -> (apply function, stored weight shape for K = 4, N = 5)
LAYOUTS = {"kn": (apply_kn, (4, 5)), "nk": (apply_nk, (5, 4))}


@pytest.fixture(params=LAYOUTS)
def layout(request):
    return request.param


@pytest.fixture
def apply_jit(layout):
    return LAYOUTS[layout][0]


@pytest.fixture
def inputs(rng, layout):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    w = rng.standard_normal(LAYOUTS[layout][1]).astype(np.float32)
    return Inputs(x=x, w=w)


def dense_kn(layout, w):
    """The dense (k, n) matrix the function multiplies x by (straight-through)."""
    wq = ref.roundtrip(w)
    return wq if layout == "kn" else wq.T


def stored(layout, a_kn):
    """A (k, n) array laid out like the stored weights."""
    return a_kn if layout == "kn" else a_kn.T


@pytest.fixture(params=[0, 8], ids=["cache-off", "cache-on"])
def vjp_cache(request):
    set_jax_vjp_cache_size(request.param)
    yield request.param
    set_jax_vjp_cache_size(0)


def test_apply_and_vjp(apply_jit, layout, inputs, rng, vjp_cache):
    out = jax_recipes.jax_apply(apply_jit, inputs)
    wq = dense_kn(layout, inputs.w)
    np.testing.assert_allclose(
        out["y"], inputs.x.astype(np.float64) @ wq, rtol=RTOL, atol=ATOL
    )
    g = rng.standard_normal((3, 5)).astype(np.float32)
    for _ in range(2):  # a cached pullback serves repeated calls
        cts = jax_recipes.jax_vjp(apply_jit, inputs, {"x", "w"}, {"y"}, {"y": g})
        want_x, want_w = ref.dense_vjp(inputs.x, wq, g)
        np.testing.assert_allclose(cts["x"], want_x, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(
            cts["w"], stored(layout, want_w), rtol=RTOL, atol=ATOL
        )


def test_jvp(apply_jit, layout, inputs, rng):
    tx = rng.standard_normal((3, 4)).astype(np.float32)
    tw = rng.standard_normal(inputs.w.shape).astype(np.float32)
    out = jax_recipes.jax_jvp(apply_jit, inputs, {"x", "w"}, {"y"}, {"x": tx, "w": tw})
    want = ref.dense_jvp(inputs.x, dense_kn(layout, inputs.w), tx, stored(layout, tw))
    np.testing.assert_allclose(out["y"], want, rtol=RTOL, atol=ATOL)


def test_jacobian(apply_jit, layout, inputs):
    jac = jax_recipes.jax_jacobian(apply_jit, inputs, {"x", "w"}, {"y"})
    wq = dense_kn(layout, inputs.w)
    # y[i, n] = sum_a x[i, a] W[a, n]: dy/dx[i,n,j,a] = d_ij W[a,n],
    # dy/dW[i,n,a,m] = d_nm x[i,a] (straight-through for w), with W's axes
    # in the stored order
    want_x = np.einsum("ij,an->inja", np.eye(3), wq)
    want_w = np.einsum("nm,ia->inam", np.eye(5), inputs.x)
    if layout == "nk":
        want_w = want_w.transpose(0, 1, 3, 2)
    np.testing.assert_allclose(jac["y"]["x"], want_x, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(jac["y"]["w"], want_w, rtol=RTOL, atol=ATOL)


def test_abstract_eval(apply_jit, layout):
    abstract = AbstractInputs(
        x={"shape": (7, 4), "dtype": "float32"},
        w={"shape": LAYOUTS[layout][1], "dtype": "float32"},
    )
    out = jax_recipes.jax_abstract_eval(apply_jit, abstract)
    assert out == {"y": {"shape": (7, 5), "dtype": "float32"}}
