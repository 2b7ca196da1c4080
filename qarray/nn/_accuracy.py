"""What quantization costs in accuracy, layer by layer (``evaluate``,
``qarray-serve evaluate``), measured as ``_plan``'s search needs it: the
quantized model itself, or the float model with dequantized weights.

A model here is any float32 equinox model of float32 ``qarray.nn.Linear`` or
``eqx.nn.Linear`` / ``eqx.nn.Conv`` /
``eqx.nn.ConvTranspose`` / ``eqx.nn.Embedding`` / ``eqx.nn.GRUCell`` /
``eqx.nn.LSTMCell`` / float32 ``qarray.nn.SpectralConv`` layers (others stay
float32; a cell is one layer: its input and hidden matrices take one
precision), called on one example (``jax.vmap`` over the data's leading
axis). Errors are measured against the float32 model on the data: the
outputs (relative L2 and SQNR) and the gradient with respect to the input of
``sum(y * r)`` for a fixed random ``r`` (what an optimiser through the model
sees: relative L2 and cosine; ``None`` for integer inputs, such as an
embedding's indices, which have no gradient).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._ops import DEFAULT_GROUP_SIZE, PRECISION_BITS
from .._primitives import dequantize
from ._calibrate import METHODS, Calibration, calibrated, device_array
from ._config import QuantConfig
from ._kinds import (
    CELLS,
    QUANTIZED_LAYERS,
    fits_int4,
    float_weights,
    kind_of,
    quantizable,
    quantized,
    rows,
)
from ._quantize import as_config
from ._quantize import quantize as quantize_model
from ._spectral import SpectralConv
from ._weights import without_stored_errors

METRICS = ("output", "gradient")
# the precisions cheapest first, what plan tries before the next: the
# quantized ones by their bits, then float32 (not quantized)
LADDER = (*sorted(PRECISION_BITS, key=PRECISION_BITS.get), "float32")


def layers_of(model) -> list:
    """The model's quantizable layers, in tree order."""
    return [n for n in jax.tree.leaves(model, is_leaf=quantizable) if quantizable(n)]


def precisions_for(layer, group_size: int) -> tuple[str, ...]:
    """What a layer can be stored as (int4 where it packs: ``fits_int4``)."""
    return LADDER if fits_int4(layer, group_size) else LADDER[1:]


def _as(layer, precision: str, group_size: int):
    """``layer`` computing with ``precision`` (quantized every call)."""
    return quantized(layer, precision, group_size, trainable=True)


def with_precisions(model, choice: dict[int, str], group_size: int):
    """``model`` with its i-th quantizable layer at ``choice[i]`` (float32
    where not given)."""
    found = iter(range(len(layers_of(model))))

    def swap(node):
        if not quantizable(node):
            return node
        return _as(node, choice.get(next(found), "float32"), group_size)

    return jax.tree.map(swap, model, is_leaf=quantizable)


def on_device(model):
    """``model`` with its NumPy leaves (a model file's, ``load_tree``) as
    JAX arrays: equinox layers index their weights with traced values."""
    return jax.tree.map(
        lambda a: device_array(a) if isinstance(a, np.ndarray) else a, model
    )


def _inputs(x) -> jax.Array:
    """The data as an array: float32, or integers (indices) as they are."""
    x = device_array(x)
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.float32:
        return x
    return x.astype(jnp.float32)


def _check_method(method: str, model, data, x):
    """The calibration inputs for ``method`` (``data``, else ``x``)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    if method == "rtn":
        return None
    if not any(kind_of(n).calibrated for n in layers_of(model)):
        raise ValueError(
            f"method={method!r} calibrates eqx.nn.Linear and eqx.nn.Conv layers; "
            "this model has none (a qarray.tesseract.Network: calibrate "
            "network.to_equinox()), use method='rtn'."
        )
    return _inputs(x if data is None else data)


def calibrated_choice(model, data, choice: dict[int, str], group_size: int,
                      method: str = "gptq"):  # fmt: skip
    """``model`` stored with its i-th quantizable layer at ``choice[i]``
    (float32 where not given): Linear and Conv layers by ``method`` ("gptq"
    or "awq") on ``data`` (``qnn.quantize(method=...)``), the others
    (transposed and spectral convolutions, embeddings, cells)
    round-to-nearest."""
    layers = layers_of(model)

    def stored(layer, precision):
        if precision == "float32":
            return layer
        group = group_size if precision == "int4" else None
        return quantize_model(layer, precision=precision, group_size=group)

    found = iter(range(len(layers)))

    def others_first(node):
        if not quantizable(node):
            return node
        precision = choice.get(next(found), "float32")
        return node if kind_of(node).calibrated else stored(node, precision)

    model = jax.tree.map(others_first, model, is_leaf=quantizable)
    # calibrated converts the Linear / Conv layers once each, in tree order
    targets = iter(i for i, n in enumerate(layers) if kind_of(n).calibrated)
    return calibrated(
        model,
        data,
        lambda n: stored(n, choice.get(next(targets), "float32")),
        Calibration(method=method),
    )


def _slots(model) -> list:
    """A quantized copy's layers where the float model's quantizable ones
    were (a ``qarray.nn`` layer, a cell of them, or the float layer left as
    it is), in tree order."""

    def is_slot(n) -> bool:
        return isinstance(n, (*QUANTIZED_LAYERS, *CELLS)) or quantizable(n)

    return [n for n in jax.tree.leaves(model, is_leaf=is_slot) if is_slot(n)]


@eqx.filter_jit
def _outputs_and_gradient(model, x, r):
    """y and the gradient of sum(y * r) with respect to x, one forward pass
    (no gradient, ``None``, for integer inputs); compiled: eagerly every
    quantize and convolution compiles on its own."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jax.vmap(model)(x), None
    y, pullback = jax.vjp(jax.vmap(model), x)
    (g,) = pullback(r)
    return y, g


def _errors(y, g, y_ref, g_ref) -> dict[str, float | None]:
    y, y_ref = np.asarray(y, np.float64), np.asarray(y_ref, np.float64)
    noise = np.sum((y - y_ref) ** 2)
    signal = np.sum(y_ref**2)
    errors = {
        "output_rel_l2": float(math.sqrt(noise / signal)) if signal else 0.0,
        "output_sqnr_db": float(10 * math.log10(signal / noise)) if noise else math.inf,
        "gradient_rel_l2": None,
        "gradient_cosine": None,
    }
    if g_ref is None:
        return errors
    g, g_ref = np.asarray(g, np.float64), np.asarray(g_ref, np.float64)
    g_norm = np.linalg.norm(g_ref)
    return errors | {
        "gradient_rel_l2": float(np.linalg.norm(g - g_ref) / g_norm) if g_norm else 0.0,
        "gradient_cosine": float(
            np.sum(g * g_ref) / (np.linalg.norm(g) * g_norm) if g_norm else 1.0
        ),
    }


@eqx.filter_jit
def _dequantized_weights(layers: list, precision: str, group_size: int) -> list:
    """Each layer's float weights after quantization to ``precision`` (not
    float32) and back, in their own shapes: what the quantized (weight-only)
    layer's products multiply by. The layers together, one compiled program
    (one per layer and primitive, eagerly)."""
    return [_parts_of(_as(layer, precision, group_size), layer) for layer in layers]


def _dequantized_parts(quantized: list, layers: list) -> list:
    """``_parts_of`` each of ``quantized`` and its float layer, one compiled
    program (the recorded errors, static, left out of it)."""
    return _compiled_parts(without_stored_errors(quantized), layers)


@eqx.filter_jit
def _compiled_parts(quantized: list, layers: list) -> list:
    return [_parts_of(q, layer) for q, layer in zip(quantized, layers, strict=True)]


def _parts_of(quantized, layer) -> tuple[jax.Array, ...]:
    """A quantized layer's weights dequantized, in float ``layer``'s shapes
    (a spectral layer's rows back to its (in, out, *modes, 2) parts, a
    cell's two matrices); a layer left float (``quantize`` keeps some) its
    own weights. Traced code."""
    if isinstance(quantized, CELLS):
        return tuple(
            _parts_of(getattr(quantized, name), getattr(layer, name))[0]
            for name in kind_of(layer).weights
        )
    if not isinstance(quantized, QUANTIZED_LAYERS):
        return float_weights(quantized)
    back = dequantize(quantized.quantized())
    if isinstance(quantized, SpectralConv):
        return (quantized._parts(back),)
    shape = layer.shape if isinstance(layer, jax.Array) else layer.weight.shape
    back = back.reshape(shape)
    s = getattr(quantized, "channel_scale", None)
    if s is not None:  # AWQ's: the layer computes (x / s) @ W^T
        back = back / jnp.reshape(s, (1, -1, *(1,) * (back.ndim - 2)))
    return (back,)


def _weight_sqnr(layer, dequantized) -> float:
    """10 log10(||w||^2 / ||w - W||^2) of the layer's weights and their
    ``dequantized`` parts (a cell's two matrices together)."""
    pairs = zip(float_weights(layer), dequantized, strict=True)
    signal = noise = 0.0
    for w, back in pairs:
        w, back = np.asarray(w, np.float64), np.asarray(back, np.float64)
        signal, noise = signal + np.sum(w**2), noise + np.sum((w - back) ** 2)
    return float(10 * math.log10(signal / noise)) if noise else math.inf


def _with_weights(model, weights: list):
    """``model`` with its i-th quantizable layer's float weights
    ``weights[i]`` (a tuple: its kind's ``weights`` fields)."""
    given = iter(weights)

    def swap(node):
        if not quantizable(node):
            return node
        names = kind_of(node).weights
        return eqx.tree_at(
            lambda n: tuple(getattr(n, name) for name in names), node, next(given)
        )

    return jax.tree.map(swap, model, is_leaf=quantizable)


def layer_bytes(layer, precision: str, group_size: int) -> int:
    """The stored weights' bytes (payload and scales) at ``precision``."""
    if precision == "float32":
        return sum(4 * out * per_out for out, per_out in rows(layer))
    if precision == "int4":
        return sum(
            out * per_out // 2 + 4 * out * per_out // group_size
            for out, per_out in rows(layer)
        )
    return sum(out * per_out + 4 * out for out, per_out in rows(layer))


class _Measurer:
    """The errors against float32 on ``x`` of the model with a choice of
    precisions ``{layer index: precision}`` (float32 where not given), each
    layer quantized by ``method``: "rtn", or "gptq" / "awq" calibrated on
    ``calibration`` (the model's inputs).

    ``measured`` runs the quantized model itself (its layers ``qarray.nn``'s,
    compiled anew for every choice: the precisions are static). ``simulated``
    runs the float model with each layer's weights replaced by their
    dequantized values, the same weight-only products in float32, as one
    compiled function whatever the choice: one compilation for the whole
    search rather than one per choice. ``plan`` verifies its answer with
    ``measured``.
    A calibrated method's weights for the simulation come from a model
    calibrated at one precision throughout (one calibration per precision);
    ``measured`` calibrates the chosen mix itself."""

    def __init__(self, model, x, group_size: int, seed: int, calibration=None):
        self.model, self.x, self.group_size = model, _inputs(x), group_size
        self.calibration = calibration
        shape = jax.eval_shape(jax.vmap(model), self.x).shape
        rng = np.random.default_rng(seed)
        self.r = device_array(rng.standard_normal(shape).astype(np.float32))
        # the module's compiled function, cached across measurers
        self.run = _outputs_and_gradient
        self.y_ref, self.g_ref = self.run(model, self.x, self.r)
        self.layers = layers_of(model)
        self.dequantized: dict[tuple, tuple[jax.Array, ...]] = {}

    def weight(self, i: int, precision: str, method: str = "rtn"):
        """Layer i's weights at ``precision`` by ``method``, dequantized
        (with every other layer's that takes ``precision``: one program)."""
        if precision == "float32":
            return float_weights(self.layers[i])
        if method == "rtn" and (i, precision, "rtn") not in self.dequantized:
            fits = {
                j
                for j, layer in enumerate(self.layers)
                if precision in precisions_for(layer, self.group_size)
            }
            fits = sorted(fits | {i})
            layers = [self.layers[j] for j in fits]
            parts = _dequantized_weights(layers, precision, self.group_size)
            self.dequantized |= {
                (j, precision, "rtn"): p for j, p in zip(fits, parts, strict=True)
            }
        if (i, precision, method) not in self.dequantized:
            layers = self.layers
            everywhere = {j: precision for j in range(len(layers))}
            everywhere |= {
                j: "int8"
                for j, layer in enumerate(layers)
                if precision not in precisions_for(layer, self.group_size)
            }
            whole = calibrated_choice(
                self.model, self.calibration, everywhere, self.group_size, method
            )
            slots = _slots(whole)
            done = [j for j in range(len(layers)) if everywhere[j] == precision]
            parts = _dequantized_parts(
                [slots[j] for j in done], [layers[j] for j in done]
            )
            self.dequantized |= {
                (j, precision, method): p for j, p in zip(done, parts, strict=True)
            }
        return self.dequantized[i, precision, method]

    def _errors_of(self, model):
        # (a calibrated model's recorded errors, static, would recompile it)
        y, g = self.run(without_stored_errors(model), self.x, self.r)
        return _errors(y, g, self.y_ref, self.g_ref)

    def simulated(self, choice, method: str = "rtn"):
        weights = [
            self.weight(i, choice.get(i, "float32"), method)
            for i in range(len(self.layers))
        ]
        return self._errors_of(_with_weights(self.model, weights))

    def measured(self, choice, method: str = "rtn"):
        if method == "rtn":
            quantized = with_precisions(self.model, choice, self.group_size)
        else:
            quantized = calibrated_choice(
                self.model, self.calibration, choice, self.group_size, method
            )
        return self._errors_of(quantized)


def _shape(layer) -> list:
    """The layer's weight shape (a cell's: its two matrices')."""
    shapes = [list(w.shape) for w in float_weights(layer)]
    return shapes if isinstance(layer, CELLS) else shapes[0]


def evaluate(model, x, config: QuantConfig | None = None, *, seed=0, data=None,
             **options):  # fmt: skip
    """Errors of ``model`` (float32) quantized to ``precision`` on the data
    ``x``: per layer (its weights' SQNR in dB; the model's output and input
    gradient with only that layer quantized: its sensitivity, run as the
    float model with that layer's weights dequantized) and for the whole
    model (every layer at ``precision`` where it can be, the quantized model
    itself). ``method="gptq"`` or ``"awq"``: the layers as that method
    quantizes them, calibrated on ``data`` (default: ``x``), each layer's row
    with round-to-nearest's SQNR and sensitivity beside (``rtn_...``).

    ``config`` (a ``QuantConfig``; or its fields as keywords: ``precision``,
    ``group_size``, ``method``) says how; the default int8, round-to-nearest,
    groups of 128 for int4."""
    precision, group_size, method = _weight_options(config, options, "evaluate")
    model = on_device(model)
    calibration = _check_method(method, model, data, x)
    measure = _Measurer(model, x, group_size, seed, calibration)

    per_layer, whole = [], {}
    for i, layer in enumerate(measure.layers):
        chosen = precision if precision in precisions_for(layer, group_size) else "int8"
        whole[i] = chosen
        row = {
            "layer": i,
            "kind": type(layer).__name__,
            "shape": _shape(layer),
            "precision": chosen,
            "bytes": layer_bytes(layer, chosen, group_size),
            "float32_bytes": layer_bytes(layer, "float32", group_size),
        }
        for name in dict.fromkeys((method, "rtn")):
            prefix = "" if name == method else "rtn_"
            row[f"{prefix}weight_sqnr_db"] = (
                math.inf
                if chosen == "float32"
                else _weight_sqnr(layer, measure.weight(i, chosen, name))
            )
            errors = measure.simulated({i: chosen}, name)
            row |= {f"{prefix}alone_{k}": v for k, v in errors.items()}
        per_layer.append(row)
    return {
        "precision": precision,
        "group_size": group_size,
        "method": method,
        "examples": int(np.shape(x)[0]),
        "layers": per_layer,
        "model": measure.measured(whole, method),
    }


def _weight_options(config, options: dict, caller: str) -> tuple[str, int, str]:
    """(precision, group size, method) of ``config`` with ``options`` applied
    (``QuantConfig`` checks them); evaluate and plan measure the weights'
    quantization, so W8A8 calibration (smoothquant, static) is refused."""
    config = as_config(config, options)
    if (
        config.smoothquant is not None
        or config.static
        or config.activations != "float32"
    ):
        raise ValueError(
            f"{caller} measures weight quantization: activations='float32', without "
            "smoothquant or static (quantize a W8A8 model with qnn.quantize)"
        )
    group_size = DEFAULT_GROUP_SIZE if config.group_size is None else config.group_size
    return config.precision, group_size, config.method
