"""The Tesseract contract's request checks: what the top-level
``tesseract_api.py``'s ``InputSchema`` inherits (``NetworkRequest``), beyond
what its fields' types say.

Errors are ValueErrors (422s) naming the field and the shapes
(``layers.[2].w_q.scale``); work is bounded from the declared shapes before
any array is decoded (``QARRAY_MAX_ELEMENTS``, ``QARRAY_MAX_WORK``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Self

from pydantic import BaseModel, model_validator

from ..network import LayerShapes, NetworkShape, layer_shapes, network_shape
from ._endpoints import given_paths
from ._limits import (
    declared_shape,
    quantized_payload,
    require_at_least,
    require_finite,
)
from ._paths import lookup_path
from ._runtime import Runtime


class NetworkRequest(BaseModel):
    """The checks of a request for the contract's network (fields ``x``,
    ``layers``, ``quantize_activations``, ``return_w_q``,
    ``return_weight_error``, ``lora``, declared by the subclass);
    ``runtime``: the API module's (its limits and resident model)."""

    runtime: ClassVar[Runtime]

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
        """Whether the request may merge with others (``MergedRows.job``): the
        resident model on rows of x, adapters (if any) one per request, no
        per-layer outputs."""
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

    def given(self, paths, field: str) -> dict[str, tuple]:
        """Each of ``paths``' shapes, a 422 naming ``field`` for one the
        request did not give."""
        return given_paths(self, paths, field, type(self).lookup)

    def cache_pays(self) -> bool:
        """Whether apply should keep its pullback (``ResidualCache.pays``)."""
        if self.layers is None:
            linear = all(a == "none" for a in self.runtime.resident.activation)
        else:
            linear = all(layer.activation == "none" for layer in self.layers)
        elements = self.x.size + sum(
            math.prod(s.weights) + math.prod(s.bias or ()) for s in self.layer_shapes()
        )
        return self.runtime.cache.pays(self.network_shape().flops, elements, linear)
