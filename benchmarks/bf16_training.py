"""bfloat16 training with int8 weights against float32, after the same steps.

Issue 60's check: quantization-aware training (int8 weights, quantized on
every call, straight-through gradients) run in bfloat16 ends within 2% of
the float32 run's loss. Two of the examples' models, in process (no
server), each trained from the same initialisation on the same mini-batches
in three runs (``RUNS``): float32; bfloat16 throughout (parameters, Adam's
moments, activations); bfloat16 activations with float32 parameters (mixed
precision, the usual recipe: a bfloat16 parameter drops an update below
half its last place, 2**-9 to 2**-8 of itself, as Adam's late steps are).

- digits: examples/qat_pipeline.py's classifier (64 -> 64 -> 10, relu,
  weights (out, in), He-normal init, Adam lr 1e-2, batches of 128 of
  scikit-learn's digits, its split), its layers ``qarray.nn.Linear`` of the
  parameters (what the served network computes); loss: cross-entropy.
- fno: examples/neural_operator's FNO quantized by ``qnn.quantize(model,
  trainable=True)`` (int8 spectral weights and 1 x 1 convolutions) on the
  heat-equation fields of examples/cnn_surrogate, trained by that example's
  ``train`` (Adam, cosine decay from 3e-3, batches of 16); loss: relative MSE.

Each run's final loss is the loss over its whole training set, the model
computing in its run's dtype (the loss summed in float32); a bfloat16 run's
relative difference is ``|loss - float32's| / float32's``. Seconds per step:
the median after the first (compiling) step. The defaults are small (half a
minute on a 2-core CPU, where the FNO is still in its steep descent and a
few steps' drift moves the final loss by percents); on an accelerator, train
the FNO further (``--fno-steps 200 --fno-fields 128``); the digits classifier's
300 steps are its example's (by 1000 it has memorised its training set, and a
near-zero loss moves by percents with a few steps' drift).

    python -m benchmarks.bf16_training [--steps N] [--fno-steps N]
        [--fno-fields N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import qarray.nn as qnn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# each run: (the computation's dtype, the parameters'): float32, bfloat16
# throughout, and bfloat16 with float32 master weights (mixed precision)
RUNS = {
    "float32": ("float32", "float32"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "bfloat16, float32 parameters": ("bfloat16", "float32"),
}
TARGET = 0.02  # the issue's: bf16's final loss within 2% of float32's


def _load(path: Path, name: str):
    """An example's script as a module named ``name`` (the examples are not
    a package, and two of their scripts are called pipeline.py)."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses, equinox's modules, look it up)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _examples():
    """(qat_pipeline.py, cnn_surrogate/pipeline.py, neural_operator/fno.py):
    what the runs reuse (the cnn pipeline brings heat_surrogate's data,
    prediction and error)."""
    return (
        _load(EXAMPLES / "qat_pipeline.py", "qat_pipeline"),
        _load(EXAMPLES / "cnn_surrogate" / "pipeline.py", "cnn_pipeline"),
        _load(EXAMPLES / "neural_operator" / "fno.py", "fno"),
    )


def _seconds_per_step(stamps: list[float]) -> float:
    """The median interval between steps, the first (compiling) one left out."""
    gaps = np.diff(stamps)[1:]
    return float(statistics.median(gaps)) if len(gaps) else float("nan")


def _compare(runs: dict) -> dict:
    """The runs, and each one's final loss relative to float32's."""
    f32 = runs["float32"]["final_loss"]
    for name, result in runs.items():
        if name != "float32":
            difference = abs(result["final_loss"] - f32) / abs(f32)
            result["relative_loss_difference"] = difference
            result["within_target"] = bool(difference <= TARGET)
    return runs


def digits(steps: int, seed: int = 0, batch: int = 128, lr: float = 1e-2) -> dict:
    """examples/qat_pipeline.py's classifier trained in process, each run of
    ``RUNS`` from its initialisation on its mini-batches."""
    qat, cnn, _ = _examples()
    x_train, x_test, y_train, y_test = qat.load_data(seed)
    init = qat.init_params(jax.random.key(seed))
    # the example's mini-batches, drawn once: every run sees the same ones
    rng = np.random.default_rng(seed)
    batches = [rng.choice(len(x_train), batch, replace=False) for _ in range(steps)]

    def logits(params, x, dtype):
        """The network as the Tesseract computes it (int8 weights quantized
        on every call, layout "nk"), in ``dtype``; float32 logits for the
        loss."""
        h, params = jnp.asarray(x).astype(dtype), cnn.as_dtype(params, dtype)
        for p, activation in zip(params, qat.ACTIVATIONS, strict=True):
            h = qnn.Linear(p["w"], p["bias"])(h)
            h = jax.nn.relu(h) if activation == "relu" else h
        return h.astype(jnp.float32)

    runs = {}
    for name, (dtype, param_dtype) in RUNS.items():
        model = qat.Model(
            functools.partial(logits, dtype=dtype),
            cnn.as_dtype(init, param_dtype),
            optax.adam(lr),
            x_test,
            y_test,
        )
        stamps = []
        for idx in batches:
            model.step(x_train[idx], y_train[idx])  # blocks: it reads the loss
            stamps.append(time.perf_counter())
        final = optax.softmax_cross_entropy_with_integer_labels(
            jax.jit(logits, static_argnums=2)(model.params, x_train, dtype), y_train
        ).mean()
        runs[name] = {
            "dtype": dtype,
            "parameters_dtype": str(model.params[0]["w"].dtype),
            "steps": steps,
            "first_loss": model.losses[0],
            "last_batch_loss": model.losses[-1],
            "final_loss": float(final),
            "test_accuracy": model.evaluate(),
            "seconds_per_step": _seconds_per_step(stamps),
        }
    return _compare(runs)


def fno(steps: int, fields: int = 64, seed: int = 0, lr: float = 3e-3) -> dict:
    """examples/neural_operator's FNO trained quantization-aware by the
    example's ``train`` on ``fields`` solved heat-equation fields, each run
    of ``RUNS``."""
    _, cnn, fno_module = _examples()
    log_k, u = cnn.dataset(np.random.default_rng(seed), fields)
    scale = float(np.sqrt((u**2).mean()))
    runs = {}
    for name, (dtype, param_dtype) in RUNS.items():
        stamps = []

        def on_step(i, loss, stamps=stamps):
            jax.block_until_ready(loss)
            stamps.append(time.perf_counter())

        model = cnn.train(
            log_k,
            u,
            steps,
            seed,
            model_class=fno_module.FNO,
            lr=lr,
            dtype=dtype,
            param_dtype=param_dtype,
            qat=True,
            on_step=on_step,
        )
        trained_in = str(model.lift.weight.dtype)
        model = cnn.as_dtype(model, dtype)  # evaluated as it computed
        pred = cnn.predict(model, jnp.asarray(log_k, dtype))
        final = np.mean((np.asarray(pred, np.float64) - u) ** 2) / scale**2
        runs[name] = {
            "dtype": dtype,
            "parameters_dtype": trained_in,
            "steps": steps,
            "fields": fields,
            "final_loss": float(final),
            "relative_l2": cnn.relative_l2(pred, u),
            "seconds_per_step": _seconds_per_step(stamps),
        }
    return _compare(runs)


def run(steps: int = 300, fno_steps: int = 30, fno_fields: int = 64) -> dict:
    device = jax.devices()[0]
    return {
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "default_matmul_precision": jax.config.jax_default_matmul_precision,
        "target": f"bfloat16 final loss within {TARGET:.0%} of float32's",
        "tasks": {
            "digits": digits(steps),
            "fno": fno(fno_steps, fno_fields),
        },
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="digits: steps")
    parser.add_argument("--fno-steps", type=int, default=30, help="fno: steps")
    parser.add_argument("--fno-fields", type=int, default=64, help="fno: fields")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = run(args.steps, args.fno_steps, args.fno_fields)
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    for task, runs in results["tasks"].items():
        f32 = runs["float32"]["final_loss"]
        for name, result in runs.items():
            if name != "float32":
                print(
                    f"{task}, {name}: final loss {result['final_loss']:.4g} against "
                    f"float32's {f32:.4g}, {result['relative_loss_difference']:.2%} "
                    f"apart (target {TARGET:.0%}: "
                    f"{'met' if result['within_target'] else 'missed'})"
                )
    return results


if __name__ == "__main__":
    main()
