"""``Endpoints``: apply and the gradient endpoints of a Tesseract over one
function of the request, shared by ``ModelTesseract`` and the top-level
``tesseract_api.py``.

``run(request, *constants()) -> outputs`` is the computation (the request
as a dict of arrays and values, the constants the resident model); around
it: compiled once per request signature (``jit_request``), concurrent
requests merged along ``row_fields`` (``MergedRows``, ``QARRAY_MAX_BATCH_ROWS``),
apply's pullback kept for the VJP that follows (``ResidualCache``), and
tesseract-core's ``jax_recipes`` for the derivatives of what cannot merge.
The API module checks a request (its schemas, its 422s) and calls these.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel
from tesseract_core.runtime import jax_recipes

from ._request_jit import jit_request
from ._requests import unprocessable
from ._row_merging import MergedRows
from ._runtime import Runtime


class Endpoints:
    """The endpoints of ``run`` (module doc); ``run_rows``: ``run`` for
    merged requests when it differs (per-row adapters)."""

    def __init__(
        self,
        runtime: Runtime,
        run: Callable[..., dict],
        constants: Callable[[], tuple],
        row_fields: Sequence[str] = (),
        run_rows: Callable[..., dict] | None = None,
    ):
        self.runtime = runtime
        self.run = run
        self.constants = constants
        self.rows = MergedRows(runtime.batcher, run_rows or run, row_fields, constants)
        self._compiled = jit_request(run)

    def apply_jit(self, request: dict) -> dict:
        """``run`` compiled, on the constants: what ``jax_recipes``
        differentiate."""
        return self._compiled(request, *self.constants())

    def apply(self, request: dict, mergeable: bool, store: bool,
              outputs: Sequence[str] = ("y",)) -> dict:  # fmt: skip
        """The outputs; ``store``: keep the pullback of ``outputs`` (the
        differentiable ones) for a VJP (``ResidualCache.arriving``)."""
        cache = self.runtime.cache

        def alone():
            if store:
                return cache.apply(self.run, request, self.constants(), outputs)
            return self.apply_jit(request)

        job = self.rows.job("apply", request if mergeable else None, alone)
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

    def jacobian(self, inputs, jac_inputs, jac_outputs) -> dict:
        """d outputs / d inputs (``check_jacobian`` bounded their size), in
        the batcher's turn."""
        return self.runtime.batcher.call(
            lambda: jax_recipes.jax_jacobian(
                self.apply_jit, inputs, jac_inputs, jac_outputs
            )
        )

    def jacobian_vector_product(self, inputs, jvp_inputs, jvp_outputs, tangents, *,
                                mergeable: bool = False, request: dict | None = None,
                                ) -> dict:  # fmt: skip
        """Tangents of ``jvp_outputs`` for ``tangents`` (checked, by path);
        ``mergeable``: it may merge with other requests; ``request``:
        ``request_dict(inputs)`` where the caller has it."""
        request = request_dict(inputs) if request is None else request
        job = self.rows.job(
            "jvp",
            request if mergeable else None,
            lambda: jax_recipes.jax_jvp(
                self.apply_jit, inputs, jvp_inputs, jvp_outputs, tangents
            ),
            paths=jvp_inputs,
            outputs=jvp_outputs,
            vectors=tangents,
        )
        return self.rows.run(job)

    def vector_jacobian_product(self, inputs, vjp_inputs, vjp_outputs, cotangents: dict,
                                shapes: dict, *, mergeable: bool = False,
                                request: dict | None = None) -> dict:  # fmt: skip
        """Cotangents of ``vjp_inputs`` for ``cotangents`` (checked, by
        output name); ``shapes``: every differentiable output's shape (those
        without a cotangent get zeros: the cached pullback and a merged
        batch take them all). ``mergeable``, ``request``: as for the JVP."""
        request = request_dict(inputs) if request is None else request
        full = {
            name: cotangents.get(name, np.zeros(shape, np.float32))
            for name, shape in shapes.items()
        }
        pullback = self.runtime.cache.pullback(self.run, request, vjp_inputs)
        if pullback is not None:  # apply kept it: no forward pass, no merging
            return self.runtime.batcher.call(lambda: pullback(full))
        job = self.rows.job(
            "vjp",
            request if mergeable else None,
            lambda: jax_recipes.jax_vjp(
                self.apply_jit, inputs, vjp_inputs, vjp_outputs, cotangents
            ),
            paths=vjp_inputs,
            outputs=full,
            vectors=full,
        )
        return self.rows.run(job)


def request_dict(inputs: BaseModel) -> dict:
    """``inputs.model_dump()`` without its cost (visible on small requests):
    nested models as dicts, lists as lists, arrays and values as they are."""

    def plain(value):
        if isinstance(value, BaseModel):
            return {name: plain(field) for name, field in value}
        if isinstance(value, dict):  # a plain dict (JAX's pytree node)
            return {name: plain(field) for name, field in value.items()}
        if isinstance(value, list):
            return [plain(item) for item in value]
        return value

    return plain(inputs)


def given_paths(inputs: Any, paths, field: str, lookup: Callable) -> dict[str, tuple]:
    """Each path's array shape (``lookup(inputs, path)``); a 422 naming
    ``field`` for a path the request did not give."""
    shapes = {}
    for path in sorted(paths):
        try:
            shapes[path] = tuple(np.shape(lookup(inputs, path)))
        except ValueError as error:
            raise unprocessable(f"{field}: {error}") from None
    return shapes
