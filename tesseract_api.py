"""qarray Tesseract: a quantized network (``qarray.tesseract.Network``) as endpoints.

Each layer is ``h -> activation(h @ W + bias)``, ``W`` int8, int4 or float32
(``precision``): dense ``w`` (quantized on every call, straight-through
gradient) or ``w_q``, stored ``(K, N)`` ("kn") or ``(N, K)`` ("nk"). Without
``layers`` the resident model (``QARRAY_MODEL``) runs. Here: the schemas and
the endpoints; in ``qarray.tesseract``: the checks and the serving machinery.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field
from tesseract_core.runtime import Array, Differentiable, Float32

from qarray.tesseract import Endpoints, Network, Runtime
from qarray.tesseract import internal as qt

RUNTIME = Runtime.from_env()  # settings, limits, resident model, cache, batcher
LIMITS = RUNTIME.limits
qt.install_gradient_path_check()  # InputSchema.check_gradient_path, at validation

Float32Array = Annotated[Differentiable[Array[..., Float32]], LIMITS.array("float32")]
Payload = Annotated[Array[..., None], LIMITS.array(("int8", "uint8"))]
Layout = Literal[qt.LAYOUTS]
Precision = Literal[qt.PRECISIONS]
Activation = Literal[tuple(qt.ACTIVATIONS)]


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
    """One layer: ``h -> activation(h @ W + bias)``, W quantized (int8 or
    int4) or float32 as given (``precision``)."""

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
        default=qt.DEFAULT_GROUP_SIZE,
        ge=2,
        description="int4: values of a row per scale (even).",
    )

    model_config = ConfigDict(extra="forbid")

    exclusive: ClassVar = ("w", "w_q")  # lookup_path: which one a layer gave


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


class InputSchema(qt.NetworkRequest):
    """The request; its checks beyond the fields' types are the contract's
    (``qarray.tesseract.internal.NetworkRequest``), on this module's runtime."""

    runtime: ClassVar[Runtime] = RUNTIME
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
        "dense weights (0 for w_q layers or zero w; a resident model's: at load); one "
        "per batch element, shaped as the batch axes (a scalar without them)."
    )
    w_q: QuantizedWeightsOut | None = Field(
        description="A w layer's quantized weights (reuse them as w_q) if return_w_q."
    )


class OutputSchema(BaseModel):
    y: Differentiable[Array[..., Float32]] = Field(
        description="The network's output, float32 (*batch, ..., N_last)."
    )
    layers: list[LayerOut] | None = Field(
        description="Per layer diagnostics if return_weight_error or return_w_q."
    )


# --- the computation: the request's network, or the resident one


def _outputs(inputs: dict, resident: Network | None) -> dict:
    """inputs (as InputSchema.model_dump()) -> outputs (as OutputSchema)."""
    axes = None if RUNTIME.mesh is None else RUNTIME.mesh.axis_names
    network = Network.from_request(inputs, resident, mesh_axes=axes)
    y, per_layer = network.run(inputs["x"], return_w_q=inputs["return_w_q"])
    asked = inputs["return_w_q"] or inputs["return_weight_error"]
    return {"y": y, "layers": per_layer if asked else None}


# compiled; concurrent requests on the resident model merge along x's rows;
# what a request says about itself (its output's shape, whether it may merge,
# whether apply's pullback pays) the contract answers from declared shapes
ENDPOINTS = Endpoints(
    RUNTIME, _outputs, lambda: (RUNTIME.resident,), ["x"],
    differentiable_outputs=InputSchema.differentiable_outputs,
    mergeable=InputSchema.mergeable,
    cache_pays=InputSchema.cache_pays,
    lookup=InputSchema.lookup,
    jacobian_work=InputSchema.check_jacobian_work,
)  # fmt: skip
apply_jit = ENDPOINTS.apply_jit  # what tesseract-core's jax_recipes differentiate


def apply(inputs: InputSchema) -> OutputSchema:
    """The network's output y (and per-layer diagnostics when asked)."""
    return ENDPOINTS.apply(inputs)


abstract_eval = ENDPOINTS.abstract_eval  # shapes and dtypes, without computing


# --- gradient endpoints: Endpoints checks the request's paths and vectors


def jacobian(inputs: InputSchema, jac_inputs: set[str], jac_outputs: set[str]):
    """d y / d (jac_inputs), each of shape y.shape + input.shape."""
    return ENDPOINTS.jacobian(inputs, jac_inputs, jac_outputs)


def jacobian_vector_product(
    inputs: InputSchema, jvp_inputs, jvp_outputs, tangent_vector
):
    """Tangent of y for tangents of jvp_inputs (each shaped like its input)."""
    return ENDPOINTS.jacobian_vector_product(
        inputs, jvp_inputs, jvp_outputs, tangent_vector
    )


def vector_jacobian_product(
    inputs: InputSchema, vjp_inputs, vjp_outputs, cotangent_vector
):
    """Cotangents of vjp_inputs for a cotangent of y (shaped like y)."""
    return ENDPOINTS.vector_jacobian_product(
        inputs, vjp_inputs, vjp_outputs, cotangent_vector
    )
