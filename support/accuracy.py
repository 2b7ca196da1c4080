"""How close to float64 a float32 computation through ``tanh`` can be on the
platform the tests run on, for the tests whose networks apply it.

JAX's numerical-accuracy table (https://docs.jax.dev/en/latest/accuracy.html,
float32) bounds ``jax.lax.tanh`` by 5 ULP on x86 CPUs and 5.5 on NVIDIA GPUs,
but by 1365.5 ULP on TPU v2-v5e (about 1.6e-4 relative) and 92 on v5p; its
derivative ``1 - tanh(z)**2`` loses more where tanh nears +-1. No matmul
precision changes that (the suite asks for "highest" off CPU), and JAX offers
no more accurate tanh there. On a TPU v5e, with every product at "highest",
the served three-layer relu/tanh network's gradients and a scanned tanh
conv_q's weight gradient came within 1e-3 of float64 and no closer, where the
same tests pass 2e-4 on CPU: plain ``lax.conv_general_dilated`` with the
dequantized weights is as far off there (docs/accelerators.md).

Where a network quantizes its activations to int8 after tanh, that error can
move an activation across a rounding boundary of its int8 grid: a result
that carries the quantized activation (a weight's gradient) is then off by
one step of it, at most 1/127 of tanh's range.
"""

import jax

# above the 1e-3 seen on the chip (docs/accelerators.md), below what a wrong
# product would give (an int8 rounding off is ~1e-2)
TPU_TANH_TOLERANCE = 2e-3


def through_tanh(tolerance: float) -> float:
    """``tolerance`` for a result computed through float32 tanh: as given
    where tanh is within a few ULP, at least ``TPU_TANH_TOLERANCE`` on a TPU."""
    if jax.default_backend() == "tpu":
        return max(tolerance, TPU_TANH_TOLERANCE)
    return tolerance


# one int8 step of an activation in [-1, 1] (module doc), with room for the
# float32 error around it
TPU_INT8_STEP_AFTER_TANH = 1.2 / 127


def for_network(inputs: dict, tolerance: float) -> float:
    """``tolerance`` for a request's network (support/network.py): through
    tanh where any of its layers applies it, and one int8 step of a tanh
    output on a TPU where the request quantizes activations too."""
    layers = inputs.get("layers") or []
    if not any(layer.get("activation") == "tanh" for layer in layers):
        return tolerance
    if inputs.get("quantize_activations") and jax.default_backend() == "tpu":
        return max(tolerance, TPU_INT8_STEP_AFTER_TANH)
    return through_tanh(tolerance)
