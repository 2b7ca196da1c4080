"""A request to an endpoint, from the schemas' validated model to the
compiled call: its 422s, its plain dict, that dict compiled, and the
contract's checks.

- ``unprocessable``, ``checked_vectors``, ``given_paths``: what the schemas
  cannot say about a gradient request (paths it did not give, tangents and
  cotangents of the wrong shape), as 422s naming the field;
- ``request_dict``: the validated model as the dict the endpoint functions
  compute on; ``split_request`` / ``merge_request``: that dict as its array
  leaves (traced) and a hashable rest (static); ``jit_request``: an endpoint
  function of it, compiled;
- ``NetworkRequest``: the Tesseract contract's checks, which the top-level
  ``tesseract_api.py``'s ``InputSchema`` inherits. Its errors are ValueErrors
  (422s) naming the field and the shapes (``layers.[2].w_q.scale``); work is
  bounded from the declared shapes before any array is decoded
  (``QARRAY_MAX_ELEMENTS``, ``QARRAY_MAX_WORK``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Self

import jax
import numpy as np
from fastapi import HTTPException
from pydantic import BaseModel, model_validator

from ..network import LayerShapes, NetworkShape, layer_shapes, network_shape
from ._limits import (
    declared_shape,
    quantized_payload,
    require_at_least,
    require_finite,
)
from ._paths import lookup_path

# --- a gradient request's paths and vectors, checked (422s)


def unprocessable(message: str) -> HTTPException:
    """A 422 with ``message``'s first line (a traced error's may run long)."""
    lines = message.strip().splitlines() or [""]
    return HTTPException(status_code=422, detail=lines[0][:1000])


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


def checked_vectors(field: str, vectors: dict, shapes: dict[str, tuple]) -> dict:
    """Tangents or cotangents, each shaped as the array of its path in
    ``shapes`` (path -> shape) and finite: returned as float32, a 422 naming
    the field otherwise."""
    for path, v in vectors.items():
        if path not in shapes:
            raise unprocessable(f"{field}: no array {path!r}")
        if tuple(np.shape(v)) != tuple(shapes[path]):
            raise unprocessable(
                f"{field}[{path!r}] must have the shape of {path} "
                f"{tuple(shapes[path])}, got {tuple(np.shape(v))}"
            )
        if not np.isfinite(v).all():
            raise unprocessable(f"{field}[{path!r}] must be finite")
    return {path: np.asarray(v, np.float32) for path, v in vectors.items()}


# --- the request as a dict, and that dict compiled


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


_ARRAY = object()  # where an array leaf goes in the static part


def is_array(leaf: Any) -> bool:
    return isinstance(leaf, np.ndarray | np.generic | jax.Array)


def split_request(inputs: Any) -> tuple[list, tuple]:
    """``(arrays, static)``: the array leaves of ``inputs`` and a hashable
    rest (the tree structure and every other leaf); ``merge_request`` inverts
    it. Cheaper per call than ``eqx.filter_jit``'s partition, a visible part
    of a small apply's latency (``make bench``, suite http)."""
    leaves, treedef = jax.tree.flatten(inputs)
    arrays = [leaf if is_array(leaf) else None for leaf in leaves]
    others = tuple(_ARRAY if is_array(leaf) else leaf for leaf in leaves)
    return arrays, (treedef, others)


def merge_request(arrays: list, static: tuple) -> Any:
    treedef, others = static
    leaves = [a if o is _ARRAY else o for a, o in zip(arrays, others, strict=True)]
    return jax.tree.unflatten(treedef, leaves)


def jit_request(fn: Callable) -> Callable:
    """``fn(inputs, *constants)`` compiled with ``jax.jit``: the array leaves
    of the ``inputs`` dict traced, its other leaves static; ``constants``
    (pytrees of arrays the server holds, e.g. a resident model) traced."""

    @functools.partial(jax.jit, static_argnames="static")
    def compiled(arrays, constants, static):
        return fn(merge_request(arrays, static), *constants)

    @functools.wraps(fn)
    def call(inputs, *constants):
        arrays, static = split_request(inputs)
        return compiled(arrays, constants, static=static)

    return call


# --- the contract's request (a quantized network)


class NetworkRequest(BaseModel):
    """The checks of a request for the contract's network (fields ``x``,
    ``layers``, ``quantize_activations``, ``return_w_q``,
    ``return_weight_error``, ``lora``, declared by the subclass);
    ``runtime``: the API module's (its limits and resident model)."""

    # the API module's Runtime (not imported: its cache compiles through
    # this module)
    runtime: ClassVar[Any]

    @classmethod
    def _check_size(cls, shape: NetworkShape) -> None:
        cls.runtime.limits.check_result("y", shape.y)
        cls.runtime.limits.check_work(shape.rows, shape.widths)

    @classmethod
    def _check_resident_fit(cls, x: tuple[int, ...]) -> None:
        try:
            cls._check_size(cls.runtime.resident_network_shape(x))
        except ValueError as error:
            raise ValueError(
                f"x does not fit the resident model ({cls.runtime.settings.model}): "
                f"{error}"
            ) from None

    @model_validator(mode="before")
    @classmethod
    def _bound_before_decoding(cls, data: Any) -> Any:
        """Bound the work from the declared shapes, before any array is decoded
        (arrays whose declared shape is itself out of bounds are left to their
        field's validator, which names them)."""
        if not isinstance(data, dict):
            return data
        layers, x = data.get("layers"), declared_shape(data.get("x"))
        limits = cls.runtime.limits
        if layers is None and cls.runtime.resident is not None and limits.in_bounds(x):
            cls._check_resident_fit(x)
        if not isinstance(layers, list):
            return data
        limits.check_layers(len(layers))
        shapes = [layer_shapes(layer, declared_shape) for layer in layers]
        if layers and None not in shapes and limits.in_bounds(x):
            arrays = [a for s in shapes for a in (s.weights, s.scale, s.bias)]
            if all(a is None or limits.in_bounds(a) for a in arrays):
                cls._check_size(network_shape(x, shapes))
        return data

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.layers is None:
            if self.runtime.resident is None:
                raise ValueError(
                    "layers is required: no resident model is loaded (QARRAY_MODEL)"
                )
            require_finite("x", self.x)
            self._check_resident_fit(tuple(self.x.shape))
            self._check_lora()
            return self
        for i, layer in enumerate(self.layers):
            if (layer.w is None) == (layer.w_q is None):
                got = "both" if layer.w is not None else "neither"
                raise ValueError(
                    f"layers.[{i}] must give exactly one of w and w_q, got {got}"
                )
        self._check_size(self.network_shape())
        require_finite("x", self.x)
        for i, layer in enumerate(self.layers):
            name = f"layers.[{i}]"
            if self.quantize_activations and layer.precision == "int4":
                raise ValueError(
                    f"{name}.precision 'int4' is weight-only: quantize_activations "
                    "needs 'int8' layers"
                )
            require_finite(f"{name}.w", layer.w)
            require_finite(f"{name}.bias", layer.bias)
            if layer.w_q is None:
                continue
            layer.w_q.qvalue = quantized_payload(
                f"{name}.w_q.qvalue", layer.w_q.qvalue, layer.precision
            )
            require_finite(f"{name}.w_q.scale", layer.w_q.scale)
            require_at_least(f"{name}.w_q.scale", layer.w_q.scale, 0)
        self._check_lora(shapes_checked=True)  # network_shape above had them
        return self

    def _check_lora(self, shapes_checked: bool = False) -> None:
        if self.lora is None:
            return
        if not shapes_checked:  # the adapters' shapes and batch axes
            self._check_size(self.network_shape())
        for i, adapter in enumerate(self.lora):
            if adapter is not None:
                require_finite(f"lora.[{i}].a", adapter.a)
                require_finite(f"lora.[{i}].b", adapter.b)

    def layer_shapes(self) -> Sequence[LayerShapes]:
        if self.layers is None:
            return self.runtime.resident_shapes
        return [
            layer_shapes({**dict(layer), "w_q": layer.w_q and dict(layer.w_q)})
            for layer in self.layers
        ]

    def network_shape(self) -> NetworkShape:
        if self.layers is None and self.lora is None:
            return self.runtime.resident_network_shape(tuple(self.x.shape))
        adapters = None
        if self.lora is not None:
            adapters = [
                None if e is None else (tuple(e.a.shape), tuple(e.b.shape))
                for e in self.lora
            ]
        return network_shape(tuple(self.x.shape), self.layer_shapes(), adapters)

    def differentiable_outputs(self) -> dict[str, tuple]:
        """The differentiable outputs' shapes (``Endpoints``): y's, from the
        declared shapes (nothing traced)."""
        return {"y": self.network_shape().y}

    def lookup(self, path: str) -> Any:
        """The array at a differentiable path (``layers.[1].w_q.scale``), or a
        ValueError naming the path when the request did not give it."""
        if self.layers is None and path.startswith("layers."):
            raise ValueError(
                f"{path!r} names a layer of the resident model "
                f"({self.runtime.settings.model}), whose weights are not inputs: this "
                "request gave no layers (differentiate with respect to x)"
            )
        return lookup_path(self, path)

    check_gradient_path = lookup  # what the gradient endpoints' schemas call

    def mergeable(self) -> bool:
        """Whether the request may merge with others, for ``Endpoints`` to
        decide: the resident model on rows of x, adapters (if any) one per
        request, no per-layer outputs."""
        if self.layers is not None or self.x.ndim < 2:
            return False
        if self.return_w_q or self.return_weight_error:
            return False
        return self.lora is None or (
            self.runtime.mesh is None
            and all(e is None or e.a.ndim + e.b.ndim <= 4 for e in self.lora)
        )

    def check_jacobian_work(self, passes: int, name: str, shape: tuple) -> None:
        """jacrev's ``passes`` backward passes (one per element of output
        ``name``, of ``shape``) within the work limit (``QARRAY_MAX_WORK``)."""
        network = self.network_shape()
        self.runtime.limits.check_work(
            network.rows,
            network.widths,
            passes,
            f", once per element of {name} {shape}",
        )

    def cache_pays(self) -> bool:
        """Whether apply should keep its pullback, for ``Endpoints`` to
        decide (``ResidualCache.pays`` on the network's flops, its input
        elements, whether it is linear)."""
        if self.layers is None:
            linear = all(a == "none" for a in self.runtime.resident.activation)
        else:
            linear = all(layer.activation == "none" for layer in self.layers)
        elements = self.x.size + sum(
            math.prod(s.weights) + math.prod(s.bias or ()) for s in self.layer_shapes()
        )
        return self.runtime.cache.pays(self.network_shape().flops, elements, linear)
