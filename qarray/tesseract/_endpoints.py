"""``Endpoints``: apply and the gradient endpoints of a Tesseract over one
function of the request, shared by ``ModelTesseract`` and the top-level
``tesseract_api.py``: each of their endpoint functions is one call of these.

``run(request, *constants()) -> outputs`` is the computation (the request
as a dict of arrays and values, the constants the resident model); around
it, decided here and nowhere else: the request's paths and vectors checked
(422s), compiled once per request signature (``jit_request``), concurrent
requests merged along ``row_fields`` (``MergedRows``, ``QARRAY_MAX_BATCH_ROWS``),
apply's pullback kept for the VJP that follows when it pays
(``ResidualCache``), and tesseract-core's ``jax_recipes`` for the derivatives
of what cannot merge. The API module's schemas check a request first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import BaseModel
from tesseract_core.runtime import jax_recipes

from ._paths import lookup_path
from ._request import (
    checked_vectors,
    given_paths,
    jit_request,
    merge_request,
    request_dict,
    split_request,
    unprocessable,
)
from ._row_merging import MergedRows
from ._runtime import Runtime


class Endpoints:
    """The endpoints of ``run`` (module doc); ``run_rows``: ``run`` for
    merged requests when it differs (per-row adapters).

    What a request says about itself, each asked of its validated model
    (``inputs``) where the API knows better than the defaults (the
    contract's ``NetworkRequest`` answers from its declared shapes):

    - ``differentiable_outputs(inputs) -> {name: shape}``; default: ``run``
      traced on the request's signature (``output_shapes``), its float
      outputs;
    - ``mergeable(inputs) -> bool``: whether it may merge with others once
      every ``row_fields`` input is given (default: then it may);
    - ``cache_pays(inputs) -> bool``: whether apply should keep its pullback
      (default: ``run`` taken as nonlinear, ``ResidualCache.pays`` from
      ``QARRAY_VJP_CACHE_MIN_FLOPS``);
    - ``lookup(inputs, path)``: the array at a differentiable path, a
      ValueError naming it where the request did not give it (default
      ``lookup_path``);
    - ``jacobian_work(inputs, passes, name, shape)``: refuses a Jacobian
      past the work limit (default: none beyond ``check_jacobian``'s).
    """

    def __init__(
        self,
        runtime: Runtime,
        run: Callable[..., dict],
        constants: Callable[[], tuple],
        row_fields: Sequence[str] = (),
        run_rows: Callable[..., dict] | None = None,
        *,
        differentiable_outputs: Callable[[Any], dict[str, tuple]] | None = None,
        mergeable: Callable[[Any], bool] | None = None,
        cache_pays: Callable[[Any], bool] | None = None,
        lookup: Callable[[Any, str], Any] = lookup_path,
        jacobian_work: Callable[[Any, int, str, tuple], None] | None = None,
    ):
        self.runtime = runtime
        self.run = run
        self.constants = constants
        self.row_fields = tuple(row_fields)
        self.rows = MergedRows(runtime.batcher, run_rows or run, row_fields, constants)
        self._compiled = jit_request(run)
        self._declared_outputs = differentiable_outputs
        self._may_merge = mergeable
        self._pays = cache_pays
        self._lookup = lookup
        self._jacobian_work = jacobian_work
        self._shapes: dict = {}  # output_shapes, per request signature

    def apply_jit(self, request: dict) -> dict:
        """``run`` compiled, on the constants: what ``jax_recipes``
        differentiate."""
        return self._compiled(request, *self.constants())

    # --- what the endpoints ask of a request

    def output_shapes(self, request: dict) -> dict[str, jax.ShapeDtypeStruct]:
        """Every output's shape and dtype for the request dict (``run``
        traced once per request signature); a 422 where ``run`` cannot take
        it, or an output would pass ``QARRAY_MAX_ELEMENTS``."""
        arrays, static = split_request(request)
        key = (static, tuple((np.shape(a), np.result_type(a)) for a in arrays))
        if key not in self._shapes:
            try:
                shapes = jax.eval_shape(
                    lambda arrays: self.run(
                        merge_request(arrays, static), *self.constants()
                    ),
                    [  # None: a static leaf's place
                        None
                        if a is None
                        else jax.ShapeDtypeStruct(np.shape(a), np.result_type(a))
                        for a in arrays
                    ],
                )
                for name, shape in shapes.items():
                    self.runtime.limits.check_result(name, shape.shape)
            except (TypeError, ValueError) as error:
                raise unprocessable(f"inputs: {error}") from None
            self._shapes[key] = shapes
        return self._shapes[key]

    def differentiable_outputs(
        self, inputs: BaseModel, request: dict | None = None
    ) -> dict[str, tuple]:
        """The differentiable outputs' shapes (what a pullback takes
        cotangents of); ``request``: ``request_dict(inputs)`` where the
        caller has it."""
        if self._declared_outputs is not None:
            return self._declared_outputs(inputs)
        if request is None:
            request = request_dict(inputs)
        shapes = self.output_shapes(request)
        return {
            name: tuple(s.shape)
            for name, s in shapes.items()
            if jnp.issubdtype(s.dtype, jnp.floating)
        }

    def mergeable(self, inputs: BaseModel, request: dict) -> bool:
        """Whether the request may merge with others (``MergedRows.job``):
        row fields declared, each given, and the request agrees."""
        if not self.row_fields or any(request.get(f) is None for f in self.row_fields):
            return False
        return self._may_merge is None or self._may_merge(inputs)

    def cache_pays(self, inputs: BaseModel) -> bool:
        """Whether apply should keep the request's pullback
        (``ResidualCache.pays``)."""
        if self._pays is not None:
            return self._pays(inputs)
        cache = self.runtime.cache  # a model's pullback taken to pay for itself
        return cache.pays(cache.min_flops, 1, False)

    # --- the endpoints

    def apply(self, inputs: BaseModel) -> dict:
        """The outputs; the pullback of the differentiable ones kept for a
        VJP when it pays (``ResidualCache.arriving``)."""
        request = request_dict(inputs)
        self._check_runs(request)
        cache = self.runtime.cache
        store = cache.arriving(self.cache_pays(inputs))
        outputs = tuple(self.differentiable_outputs(inputs, request)) if store else ()

        def alone():
            if store:
                return cache.apply(self.run, request, self.constants(), outputs)
            return self.apply_jit(request)

        job = self.rows.job("apply", self._merging(inputs, request), alone)
        return self.rows.run(job)

    def abstract_eval(self, abstract_inputs) -> dict:
        """Output shapes and dtypes from input shapes and dtypes."""
        return jax_recipes.jax_abstract_eval(self.apply_jit, abstract_inputs)

    def check_jacobian(
        self,
        outputs: dict[str, tuple],
        inputs: dict[str, tuple],
        work: Callable[[int, str, tuple], None] | None = None,
    ) -> None:
        """A 422 where a Jacobian asked for is past the limits: of each of
        ``outputs`` (name -> shape) with respect to each of ``inputs`` (path
        -> shape), ``Limits.check_elements``; ``work(passes, name, shape)``
        (jacrev runs one backward pass per element of the output) may refuse
        too."""
        try:
            for name, out in sorted(outputs.items()):
                passes = math.prod(out)
                if work is not None:
                    work(passes, name, out)
                for path, shape in inputs.items():
                    self.runtime.limits.check_elements(
                        f"the Jacobian of {name} {out} with respect to {path} {shape}",
                        passes * math.prod(shape),
                    )
        except ValueError as error:
            raise unprocessable(
                f"{error}: use vector_jacobian_product or jacobian_vector_product"
            ) from None

    def jacobian(self, inputs: BaseModel, jac_inputs, jac_outputs) -> dict:
        """d outputs / d inputs, each of shape output.shape + input.shape
        (``check_jacobian`` bounds their size), in the batcher's turn."""
        given = given_paths(inputs, jac_inputs, "jac_inputs", self._lookup)
        shapes = self.differentiable_outputs(inputs)
        work = None
        if self._jacobian_work is not None:
            work = functools.partial(self._jacobian_work, inputs)
        self.check_jacobian({name: shapes[name] for name in jac_outputs}, given, work)
        return self.runtime.batcher.call(
            lambda: jax_recipes.jax_jacobian(
                self.apply_jit, inputs, jac_inputs, jac_outputs
            )
        )

    def jacobian_vector_product(
        self, inputs: BaseModel, jvp_inputs, jvp_outputs, tangent_vector: dict
    ) -> dict:
        """Tangents of ``jvp_outputs`` for tangents of ``jvp_inputs`` (each
        shaped like its input)."""
        given = given_paths(inputs, jvp_inputs, "jvp_inputs", self._lookup)
        tangents = checked_vectors("tangent_vector", tangent_vector, given)
        request = request_dict(inputs)
        self._check_runs(request)
        return self._derivative(
            "jvp", inputs, request, jvp_inputs, jvp_outputs, tangents
        )

    def vector_jacobian_product(
        self, inputs: BaseModel, vjp_inputs, vjp_outputs, cotangent_vector: dict
    ) -> dict:
        """Cotangents of ``vjp_inputs`` for cotangents of ``vjp_outputs``
        (each shaped like its output); the differentiable outputs without one
        get zeros (the cached pullback and a merged batch take them all)."""
        given_paths(inputs, vjp_inputs, "vjp_inputs", self._lookup)
        request = request_dict(inputs)
        shapes = self.differentiable_outputs(inputs, request)
        asked = {name: shapes[name] for name in vjp_outputs if name in shapes}
        cotangents = checked_vectors("cotangent_vector", cotangent_vector, asked)
        full = {
            name: cotangents.get(name, np.zeros(shape, np.float32))
            for name, shape in shapes.items()
        }
        pullback = self.runtime.cache.pullback(self.run, request, vjp_inputs)
        if pullback is not None:  # apply kept it: no forward pass, no merging
            return self.runtime.batcher.call(lambda: pullback(full))
        return self._derivative(
            "vjp", inputs, request, vjp_inputs, vjp_outputs, cotangents,
            merged=(full, full),
        )  # fmt: skip

    def _check_runs(self, request: dict) -> None:
        """A 422 where ``run`` cannot take the request (``output_shapes``),
        unless the API declares the outputs' shapes: its schemas checked
        that, and tracing again would cost a small request."""
        if self._declared_outputs is None:
            self.output_shapes(request)

    def _merging(self, inputs: BaseModel, request: dict) -> dict | None:
        """What ``MergedRows.job`` merges: the request where it may."""
        return request if self.mergeable(inputs, request) else None

    def _derivative(self, kind: str, inputs, request, paths, outputs, vectors, *,
                    merged: tuple | None = None) -> dict:  # fmt: skip
        """``kind`` "jvp" or "vjp": ``jax_recipes``' ``jax_jvp`` / ``jax_vjp``
        of ``(apply_jit, inputs, paths, outputs, vectors)`` in the batcher's
        turn, or the request's rows merged with others'; ``merged``: the
        ``(outputs, vectors)`` a merged batch takes instead."""
        recipe = getattr(jax_recipes, f"jax_{kind}")
        merged_outputs, merged_vectors = merged or (outputs, vectors)
        job = self.rows.job(
            kind,
            self._merging(inputs, request),
            lambda: recipe(self.apply_jit, inputs, paths, outputs, vectors),
            paths=paths,
            outputs=merged_outputs,
            vectors=merged_vectors,
        )
        return self.rows.run(job)
