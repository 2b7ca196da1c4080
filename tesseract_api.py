"""qarray Tesseract: a quantized network (``qarray.nn.Network``) as endpoints.

Each layer is ``h -> activation(h @ W + bias)`` with ``W`` int8: dense ``w``
quantized on every call (straight-through gradient) or quantized ``w_q``,
stored ``(K, N)`` (layout "kn") or ``(N, K)`` ("nk", PyTorch's). Without
``layers`` the resident model (``QARRAY_MODEL``) runs. This file holds the
schemas, the checks they cannot express and the endpoints; ``qarray.tesseract``
the serving machinery.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tesseract_core.runtime import Array, Differentiable, Float32, jax_recipes

import qarray.nn as qnn
from qarray.tesseract import (
    Rows,
    Runtime,
    checked_vectors,
    declared_shape,
    install_gradient_path_check,
    jit_request,
    lookup_path,
    quantized_payload,
    require_at_least,
    require_finite,
    unprocessable,
)

RUNTIME = Runtime.from_env()
LIMITS = RUNTIME.limits
install_gradient_path_check()  # InputSchema.check_gradient_path, at validation

Float32Array = Annotated[Differentiable[Array[..., Float32]], LIMITS.array("float32")]
Payload = Annotated[Array[..., None], LIMITS.array(("int8", "uint8"))]
Layout = Literal[qnn.LAYOUTS]
Precision = Literal[qnn.PRECISIONS]
Activation = Literal[tuple(qnn.ACTIVATIONS)]


class QuantizedWeights(BaseModel):
    """Weights already quantized: per row, ``W = qvalue * scale[..., None]``
    (int8), or per group of a row (int4, packed)."""

    qvalue: Payload = Field(
        description="int8 payload, (..., K, N) for layout 'kn' or (..., N, K) for "
        "'nk', values in [-127, 127]; precision 'int4': uint8 (..., N, K/2), two "
        "values in [-7, 7] a byte (4-bit two's complement, low nibble = even k)."
    )
    scale: Float32Array = Field(
        description="float32, finite and >= 0: one per row of qvalue, shape "
        "qvalue.shape[:-1]; precision 'int4': one per group, (..., N, K/group_size)."
    )

    model_config = ConfigDict(extra="forbid")


class Layer(BaseModel):
    """One layer: ``h -> activation(h @ W + bias)`` with W quantized to int8."""

    w: Float32Array | None = Field(
        default=None,
        description="Dense weights, (..., K, N) for layout 'kn' or (..., N, K) for "
        "'nk', quantized per row on every call; straight-through gradient. Give "
        "exactly one of w, w_q.",
    )
    w_q: QuantizedWeights | None = Field(
        default=None,
        description="Pre-quantized weights {qvalue, scale} (e.g. an earlier "
        "apply's w_q output). Give exactly one of w, w_q.",
    )
    layout: Layout = Field(
        default="kn",
        description="'kn': stored (K, N), one scale per input row (qarray.matmul_q). "
        "'nk': stored (N, K) like PyTorch's nn.Linear.weight, one scale per output "
        "channel (qarray.linear_q).",
    )
    bias: Float32Array | None = Field(
        default=None, description="Optional bias, shape (..., N)."
    )
    activation: Activation = Field(
        default="none",
        description="Nonlinearity applied after the bias ('gelu' is the exact, erf "
        "form).",
    )
    precision: Precision = Field(
        default="int8",
        description="'int8' (per row); 'int4' (layout 'nk', weight-only, groups of "
        "group_size along K, packed); 'float32' (w used as given: not quantized, "
        "exact gradients; w_q refused).",
    )
    group_size: int = Field(
        default=128, ge=2, description="int4: values of a row per scale (even)."
    )

    model_config = ConfigDict(extra="forbid")

    exclusive: ClassVar = ("w", "w_q")  # lookup_path: which one a layer gave

    def shapes(self) -> qnn.LayerShapes:
        return qnn.layer_shapes({**dict(self), "w_q": self.w_q and dict(self.w_q)})


class Adapter(BaseModel):
    """A layer's LoRA adapter: ``(alpha / rank) (h a^T) b^T`` added to the
    layer's output before its activation (``qarray.nn.Adapter``)."""

    a: Float32Array = Field(
        description="(..., rank, K_i), 1 <= rank <= min(K_i, N_i): the down projection."
    )
    b: Float32Array = Field(description="(..., N_i, rank): the up projection.")
    alpha: float | None = Field(
        default=None,
        gt=0,
        description="The update's scale is alpha / rank; default rank (a scale of 1).",
    )

    model_config = ConfigDict(extra="forbid")


def _check_size(shape: qnn.NetworkShape) -> None:
    LIMITS.check_result("y", shape.y)
    LIMITS.check_work(shape.rows, shape.widths)


def _check_resident_fit(x: tuple[int, ...]) -> None:
    try:
        _check_size(qnn.network_shape(x, _resident_shapes()))
    except ValueError as error:
        raise ValueError(
            f"x does not fit the resident model ({RUNTIME.settings.model}): {error}"
        ) from None


@functools.cache
def _resident_shapes() -> tuple[qnn.LayerShapes, ...]:
    # once per process: the resident model never changes, and reading an
    # equinox module's fields costs more than a small request's product
    return tuple(layer.shapes() for layer in RUNTIME.resident.layers)


class InputSchema(BaseModel):
    x: Float32Array = Field(
        description="Input activations, float32 (..., K0): any leading axes."
    )
    layers: list[Layer] | None = Field(
        default=None,
        min_length=1,
        description="The network, 1 to QARRAY_MAX_LAYERS layers; layer i maps width "
        "K_i to N_i, K_{i+1} = N_i. Required unless the server has a resident "
        "model (QARRAY_MODEL), which runs when it is omitted.",
    )
    quantize_activations: bool = Field(
        default=False,
        description="False: weight-only quantization (activations stay float32). "
        "True: each layer's input is quantized per row too, for an int8 x int8 "
        "product; gradients stay those of the dense product (straight-through).",
    )
    return_w_q: bool = Field(
        default=False,
        description="Return the per-layer outputs with the quantized weights of "
        "the layers given as dense w (they cost wire bytes on every call).",
    )
    return_weight_error: bool = Field(
        default=False,
        description="Return the per-layer outputs (each layer's weight_error). "
        "Without it or return_w_q, the output's layers is null.",
    )
    lora: list[Adapter | None] | None = Field(
        default=None,
        description="LoRA adapters, one entry (or null: none) per layer of the "
        "request's network or the resident one: layer i computes "
        "activation(h @ W + bias + (alpha / rank) (h a^T) b^T). a and b are "
        "differentiable (lora.[i].a, lora.[i].b): with a resident model a request "
        "of x and the adapters fine-tunes it (QLoRA) without sending its weights. "
        "Leading axes of a and b are batch axes, as the weights' are.",
    )

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _bound_before_decoding(cls, data: Any) -> Any:
        """Bound the work from the declared shapes, before any array is decoded
        (arrays whose declared shape is itself out of bounds are left to their
        field's validator, which names them)."""
        if not isinstance(data, dict):
            return data
        layers, x = data.get("layers"), declared_shape(data.get("x"))
        if layers is None and RUNTIME.resident is not None and LIMITS.in_bounds(x):
            _check_resident_fit(x)
        if not isinstance(layers, list):
            return data
        LIMITS.check_layers(len(layers))
        shapes = [qnn.layer_shapes(layer, declared_shape) for layer in layers]
        if layers and None not in shapes and LIMITS.in_bounds(x):
            arrays = [a for s in shapes for a in (s.weights, s.scale, s.bias)]
            if all(a is None or LIMITS.in_bounds(a) for a in arrays):
                _check_size(qnn.network_shape(x, shapes))
        return data

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.layers is None:
            if RUNTIME.resident is None:
                raise ValueError(
                    "layers is required: no resident model is loaded (QARRAY_MODEL)"
                )
            require_finite("x", self.x)
            _check_resident_fit(tuple(self.x.shape))
            self._check_lora()
            return self
        for i, layer in enumerate(self.layers):
            if (layer.w is None) == (layer.w_q is None):
                got = "both" if layer.w is not None else "neither"
                raise ValueError(
                    f"layers.[{i}] must give exactly one of w and w_q, got {got}"
                )
        _check_size(self.network_shape())
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
            _check_size(self.network_shape())
        for i, adapter in enumerate(self.lora):
            if adapter is not None:
                require_finite(f"lora.[{i}].a", adapter.a)
                require_finite(f"lora.[{i}].b", adapter.b)

    def layer_shapes(self) -> Sequence[qnn.LayerShapes]:
        if self.layers is None:
            return _resident_shapes()
        return [layer.shapes() for layer in self.layers]

    def network_shape(self) -> qnn.NetworkShape:
        adapters = None
        if self.lora is not None:
            adapters = [
                None if e is None else (tuple(e.a.shape), tuple(e.b.shape))
                for e in self.lora
            ]
        return qnn.network_shape(tuple(self.x.shape), self.layer_shapes(), adapters)

    def lookup(self, path: str) -> Any:
        """The array at a differentiable path (``layers.[1].w_q.scale``), or a
        ValueError naming the path when the request did not give it."""
        if self.layers is None and path.startswith("layers."):
            raise ValueError(
                f"{path!r} names a layer of the resident model "
                f"({RUNTIME.settings.model}), whose weights are not inputs: this "
                "request gave no layers (differentiate with respect to x)"
            )
        return lookup_path(self, path)

    check_gradient_path = lookup  # what the gradient endpoints' schemas call

    def cache_pays(self) -> bool:
        """Whether apply should keep its pullback (``ResidualCache.pays``)."""
        if self.layers is None:
            linear = all(a == "none" for a in RUNTIME.resident.activation)
        else:
            linear = all(layer.activation == "none" for layer in self.layers)
        elements = self.x.size + sum(
            math.prod(s.weights) + math.prod(s.bias or ()) for s in self.layer_shapes()
        )
        return RUNTIME.cache.pays(self.network_shape().flops, elements, linear)


class QuantizedWeightsOut(BaseModel):
    qvalue: Array[..., None] = Field(
        description="int8 payload shaped like the layer's w (batch axes included); "
        "int4: uint8, packed (..., N, K/2)."
    )
    scale: Array[..., Float32] = Field(
        description="One scale per row of qvalue (int4: per group)."
    )


class LayerOut(BaseModel):
    weight_error: Array[..., Float32] = Field(
        description="Relative quantization error ||w - W|| / ||w|| of the layer's "
        "dense weights (0 for w_q layers or zero w; a resident model's dense layers "
        "report their quantization at load); one per batch element: shape "
        "the network's batch axes (a scalar without them)."
    )
    w_q: QuantizedWeightsOut | None = Field(
        description="The quantized weights of a w layer when return_w_q is set "
        "(reuse them as w_q), else null."
    )


class OutputSchema(BaseModel):
    y: Differentiable[Array[..., Float32]] = Field(
        description="The network's output, float32 (*batch, ..., N_last)."
    )
    layers: list[LayerOut] | None = Field(
        description="Per layer diagnostics, in order, when return_weight_error or "
        "return_w_q asks for them; else null."
    )


# --- the computation: the request's network, or the resident one


def _adapters(inputs: dict) -> list[qnn.Adapter | None] | None:
    if inputs["lora"] is None:
        return None
    return [
        None
        if entry is None
        else qnn.Adapter(
            entry["a"],
            entry["b"],
            float(entry["alpha"] or entry["a"].shape[-2]),
        )
        for entry in inputs["lora"]
    ]


def _network(inputs: dict, resident: qnn.Network | None) -> qnn.Network:
    activations = "int8" if inputs["quantize_activations"] else "float32"
    if inputs["layers"] is None:
        network = resident.with_activations(activations)
        return dataclasses.replace(network, adapters=_adapters(inputs))
    layers = []
    for layer in inputs["layers"]:
        w_q = layer["w_q"] or {"qvalue": None, "scale": None}
        qvalue = w_q["qvalue"]  # (abstract_eval: any integer dtype declared)
        if qvalue is not None:
            qvalue = qvalue.astype("uint8" if layer["precision"] == "int4" else "int8")
        layers.append(
            qnn.Linear(
                layer["w"],
                layer["bias"],
                qvalue=qvalue,
                scale=w_q["scale"],
                layout=layer["layout"],
                activations=activations,
                precision=layer["precision"],
                group_size=layer["group_size"],
            )
        )
    return qnn.Network(
        layers,
        [layer["activation"] for layer in inputs["layers"]],
        mesh_axes=None if RUNTIME.mesh is None else RUNTIME.mesh.axis_names,
        adapters=_adapters(inputs),
    )


def _outputs(inputs: dict, resident: qnn.Network | None) -> dict:
    """inputs (as InputSchema.model_dump()) -> outputs (as OutputSchema)."""
    network = _network(inputs, resident)
    y, per_layer = network.run(inputs["x"], return_w_q=inputs["return_w_q"])
    asked = inputs["return_w_q"] or inputs["return_weight_error"]
    return {"y": y, "layers": per_layer if asked else None}


_compiled_outputs = jit_request(_outputs)
# concurrent requests on the resident model merge along x's rows (RUNTIME's
# batcher: QARRAY_MAX_BATCH_ROWS, QARRAY_BATCH_WAIT_MS)
BATCHES = Rows(RUNTIME.batcher, _outputs, ["x"], lambda: (RUNTIME.resident,))


def apply_jit(inputs: dict) -> dict:
    """What tesseract-core's jax_recipes differentiate: compiled, NumPy in."""
    return _compiled_outputs(inputs, RUNTIME.resident)


def _as_dict(inputs: InputSchema) -> dict:
    """inputs.model_dump(), without its cost (visible on small requests)."""
    out = dict(inputs)
    if inputs.layers is not None:
        out["layers"] = [
            {**dict(layer), "w_q": None if layer.w_q is None else dict(layer.w_q)}
            for layer in inputs.layers
        ]
    if inputs.lora is not None:
        out["lora"] = [None if e is None else dict(e) for e in inputs.lora]
    return out


def _mergeable(inputs: InputSchema, request: dict) -> dict | None:
    """The request, if it may merge with others (``Rows.job``): the resident
    model on rows of x, adapters (if any) one per request, no per-layer
    outputs; else None (it computes alone)."""
    if inputs.layers is not None or inputs.x.ndim < 2:
        return None
    if inputs.return_w_q or inputs.return_weight_error:
        return None
    if inputs.lora is not None and (
        RUNTIME.mesh is not None
        or any(e is not None and e.a.ndim + e.b.ndim > 4 for e in inputs.lora)
    ):
        return None
    return request


def apply(inputs: InputSchema) -> OutputSchema:
    """The network's output y (and per-layer diagnostics when asked)."""
    request = _as_dict(inputs)
    store = RUNTIME.cache.arriving(inputs.cache_pays())

    def alone():
        if store:
            return RUNTIME.cache.apply(_outputs, request, (RUNTIME.resident,))
        return apply_jit(request)

    return BATCHES.run(BATCHES.job("apply", _mergeable(inputs, request), alone))


def abstract_eval(abstract_inputs):
    """Output shapes and dtypes from input shapes and dtypes, without computing."""
    return jax_recipes.jax_abstract_eval(apply_jit, abstract_inputs)


# --- gradient endpoints: request checks the schemas cannot express, then one
# call into the recipes


def _given(inputs: InputSchema, paths: set[str], field: str) -> dict[str, tuple]:
    """Each path's array shape; a 422 naming the field for one not given."""
    shapes = {}
    for path in sorted(paths):
        try:
            shapes[path] = tuple(inputs.lookup(path).shape)
        except ValueError as error:
            raise unprocessable(f"{field}: {error}") from None
    return shapes


def jacobian(inputs: InputSchema, jac_inputs: set[str], jac_outputs: set[str]):
    """d y / d (jac_inputs), each of shape y.shape + input.shape."""
    shapes = _given(inputs, jac_inputs, "jac_inputs")
    shape = inputs.network_shape()
    y, advice = shape.y, ": use vector_jacobian_product or jacobian_vector_product"
    try:  # jacrev runs one backward pass per element of y
        passes = math.prod(y)
        LIMITS.check_work(
            shape.rows, shape.widths, passes, f", once per element of y {y}"
        )
        for path, input_shape in shapes.items():
            what = f"the Jacobian of y {y} with respect to {path} {input_shape}"
            LIMITS.check_elements(what, passes * math.prod(input_shape))
    except ValueError as error:
        raise unprocessable(f"{error}{advice}") from None
    return RUNTIME.batcher.call(
        lambda: jax_recipes.jax_jacobian(apply_jit, inputs, jac_inputs, jac_outputs)
    )


def jacobian_vector_product(
    inputs: InputSchema, jvp_inputs, jvp_outputs, tangent_vector
):
    """Tangent of y for tangents of jvp_inputs (each shaped like its input)."""
    _given(inputs, jvp_inputs, "jvp_inputs")
    tangents = checked_vectors(
        "tangent_vector", tangent_vector, lambda p: (p, inputs.lookup(p).shape)
    )
    request = _as_dict(inputs)
    job = BATCHES.job(
        "jvp",
        _mergeable(inputs, request),
        lambda: jax_recipes.jax_jvp(
            apply_jit, inputs, jvp_inputs, jvp_outputs, tangents
        ),
        paths=jvp_inputs,
        outputs=jvp_outputs,
        vectors=tangents,
    )
    return BATCHES.run(job)


def vector_jacobian_product(
    inputs: InputSchema, vjp_inputs, vjp_outputs, cotangent_vector
):
    """Cotangents of vjp_inputs for a cotangent of y (shaped like y)."""
    _given(inputs, vjp_inputs, "vjp_inputs")
    y = inputs.network_shape().y
    cotangents = checked_vectors(
        "cotangent_vector", cotangent_vector, lambda p: ("y", y)
    )
    full = {"y": cotangents.get("y", np.zeros(y, np.float32))}
    request = _as_dict(inputs)
    cached = RUNTIME.batcher.call(
        lambda: RUNTIME.cache.vjp(_outputs, request, full, vjp_inputs)
    )
    if cached is not None:
        return cached
    job = BATCHES.job(
        "vjp",
        _mergeable(inputs, request),
        lambda: jax_recipes.jax_vjp(
            apply_jit, inputs, vjp_inputs, vjp_outputs, cotangents
        ),
        paths=vjp_inputs,
        outputs=full,
        vectors=full,
    )
    return BATCHES.run(job)
