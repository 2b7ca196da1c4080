"""``plan`` and ``apply_plan``: the cheapest precision per layer within an
error budget, searched on the accuracy measurements of ``_accuracy``, and
the model stored as planned."""

from __future__ import annotations

import jax.numpy as jnp

from ._accuracy import (
    METRICS,
    _check_method,
    _inputs,
    _Measurer,
    _weight_options,
    calibrated_choice,
    layer_bytes,
    layers_of,
    on_device,
    precisions_for,
    with_precisions,
)
from ._calibrate import device_array
from ._config import QuantConfig
from ._quantize import freeze


def _error_of(errors: dict, metric: str) -> float:
    return errors["output_rel_l2" if metric == "output" else "gradient_rel_l2"]


def _search(measure: _Measurer, budget: float, metric: str, method: str) -> dict:
    """``plan``'s search for one method: the choice, its verified errors and
    the steps taken."""
    options = [precisions_for(layer, measure.group_size) for layer in measure.layers]
    choice = {i: opts[0] for i, opts in enumerate(options)}
    alone: dict[tuple[int, str], float] = {}

    def sensitivity(i: int) -> float:
        """The error of the model with only layer i quantized (as chosen)."""
        if (i, choice[i]) not in alone:
            errors = measure.simulated({i: choice[i]}, method)
            alone[i, choice[i]] = _error_of(errors, metric)
        return alone[i, choice[i]]

    steps = []

    def climb(errors_of):
        """Move the most sensitive layer up one precision while
        ``errors_of`` the whole model is over the budget; its last errors."""
        errors = errors_of(choice, method)
        while _error_of(errors, metric) > budget:
            movable = [i for i, p in choice.items() if p != "float32"]
            if not movable:
                break
            worst = max(movable, key=sensitivity)
            opts = options[worst]
            choice[worst] = opts[opts.index(choice[worst]) + 1]
            errors = errors_of(choice, method)
            steps.append({"layer": worst, "to": choice[worst], **errors})
        return errors

    climb(measure.simulated)
    errors = climb(measure.measured)  # verified on the quantized model itself
    layers, group_size = measure.layers, measure.group_size
    return {
        "method": method,
        "precisions": [choice[i] for i in range(len(layers))],
        "bytes": sum(
            layer_bytes(layer, choice[i], group_size) for i, layer in enumerate(layers)
        ),
        "model": errors,
        "steps": steps,
    }


def plan(model, x, budget: float, config: QuantConfig | None = None, *,
         metric="output", seed=0, data=None, **options):  # fmt: skip
    """The cheapest precision per layer (bytes of the stored weights) whose
    whole model keeps ``metric``'s relative L2 error within ``budget`` on
    ``x``: every layer starts at its cheapest precision; while the measured
    whole-model error is over the budget, the layer whose quantization alone
    costs the most (its sensitivity) moves one step up (int4 -> int8 ->
    float32), and the model is measured again. The search runs the float
    model with dequantized weights (one compiled function); the answer is
    then measured on the quantized model itself, and climbs further should
    that be over the budget. Returns the choice, its verified errors,
    bytes and the steps taken.

    ``method="gptq"`` or ``"awq"``: the layers as that method quantizes
    them, calibrated on ``data`` (default: ``x``), in the search and in the
    verification; the plan searches round-to-nearest too and keeps the one
    of fewer bytes (``"method"`` says which; ``"compared"``: the bytes of
    each), so a calibrated plan never costs more than RTN's. ``apply_plan``
    of a calibrated plan needs the same ``data``. ``config`` (or the
    keywords ``group_size``, ``method``) as ``evaluate``'s; its precision is
    the plan's to choose."""
    _, group_size, method = _weight_options(config, options, "plan")
    if metric not in METRICS:
        raise ValueError(f"plan: metric must be one of {METRICS}, got {metric!r}")
    if not budget >= 0:
        raise ValueError(f"plan: budget must be >= 0, got {budget!r}")
    if metric == "gradient" and jnp.issubdtype(_inputs(x).dtype, jnp.integer):
        raise ValueError(
            "plan: metric='gradient' needs float inputs; integer ones (indices) "
            "have no gradient: use metric='output'"
        )
    model = on_device(model)
    calibration = _check_method(method, model, data, x)
    measure = _Measurer(model, x, group_size, seed, calibration)
    results = [
        _search(measure, budget, metric, name)
        for name in dict.fromkeys((method, "rtn"))
    ]
    # the calibrated method where it is no dearer than round-to-nearest
    best = min(results, key=lambda r: (r["bytes"], r["method"] == "rtn"))
    full = sum(layer_bytes(layer, "float32", group_size) for layer in measure.layers)
    return {
        "budget": budget,
        "metric": metric,
        "group_size": group_size,
        **best,
        "float32_bytes": full,
        "compared": {r["method"]: r["bytes"] for r in results},
    }


def apply_plan(model, report: dict, data=None):
    """``model`` (float32, as given to ``plan``) with each quantizable layer
    stored at the precision ``report`` (``plan``'s result) chose for it: int8
    or int4 layers quantized now (``freeze``), float32 ones as they are.
    Eager. Save it with ``qarray.checkpoint.save_network`` (a ``Network``)
    or ``save_tree`` (any equinox model). A GPTQ plan (``report["method"]``)
    calibrates again on ``data``, the plan's calibration inputs."""
    precisions = report["precisions"]
    if len(precisions) != len(layers_of(model)):
        raise ValueError(
            f"apply_plan: the plan has {len(precisions)} layers, the model "
            f"{len(layers_of(model))} quantizable ones"
        )
    model = on_device(model)
    choice = dict(enumerate(precisions))
    method = report.get("method", "rtn")
    if method != "rtn":
        if data is None:
            raise ValueError(
                f"apply_plan: a {method} plan needs data, its calibration inputs"
            )
        return calibrated_choice(
            model, device_array(data), choice, report["group_size"], method
        )
    return freeze(with_precisions(model, choice, report["group_size"]))
