"""A Fourier neural operator end to end: data, float32 training, int8 and int4
serving, and an inverse problem through the served Tesseract.

1. Data: log-conductivity fields and the NumPy solver's temperatures, the heat
   (Darcy) problem of examples/cnn_surrogate (heat_surrogate.py).
2. Training: the FNO (fno.py) in float32 with optax (Adam, cosine decay); the
   weights saved keyed by the model's pytree paths (fno.safetensors, what
   tesseract_api.py serves), and the int4 model stored as well
   (fno_int4.safetensors: spectral rows in groups of GROUP_SIZE).
3. Test error (relative L2 against the solver) of float32, int8 and int4, and
   the weight bytes of each.
4. The inverse problem of the CNN example: recover log_k from a measured u* by
   Adam through the served int8 and int4 operators (tesseract-jax: apply and
   vector_jacobian_product per step) and through the float32 model in JAX:
   the recovered fields' error, the solver's temperatures for them against
   u*, ms per step.

    .venv/bin/python examples/neural_operator/pipeline.py            # full: ~6 min
    .venv/bin/python examples/neural_operator/pipeline.py --quick    # a minute
    ... --model examples/neural_operator/fno.safetensors             # skip training

Writes --out/results.json, --out/table.md and --out/neural_operator.png.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fno import FNO, GRID  # noqa: E402

import qarray.nn as qnn  # noqa: E402
from qarray.checkpoint import load_tree, save_tree  # noqa: E402


def _cnn_pipeline():
    """examples/cnn_surrogate/pipeline.py: its data, inverse problem, server
    and figure serve this example too."""
    path = HERE.parent / "cnn_surrogate" / "pipeline.py"
    spec = importlib.util.spec_from_file_location("cnn_pipeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cnn = _cnn_pipeline()
from heat_surrogate import GRID as HEAT_GRID  # noqa: E402
from heat_surrogate import dataset, predict, relative_l2, solve  # noqa: E402

assert GRID == HEAT_GRID
GROUP_SIZE = 20  # int4: entries per scale of a spectral row (2 * WIDTH = 40)


def table(results: dict) -> str:
    """The closing table: per precision, test error, bytes, inverse problem."""
    rows = [
        "| model | test rel. L2 vs solver | weight bytes | inverse: log k rel. L2 "
        "| inverse: solver u rel. L2 | ms per step |",
        "|---|---|---|---|---|---|",
    ]
    runs = {
        "float32": "float32, in JAX",
        "int8": "int8, served",
        "int4": "int4, served",
    }
    for precision, run in runs.items():
        rows.append(
            f"| {precision} | {results[f'test relative L2, {precision}']:.4f} "
            f"| {results[f'model bytes, {precision}']:,} "
            f"| {results[f'inverse, {run}: log k relative L2']:.4f} "
            f"| {results[f'inverse, {run}: solver u relative L2']:.4f} "
            f"| {results[f'inverse, {run}: ms per step']:.1f} |"
        )
    return "\n".join(rows) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small data, few steps")
    parser.add_argument("--model", type=Path, help="a trained model file: no training")
    parser.add_argument("--save", type=Path, help="where to write the trained model")
    parser.add_argument("--steps", type=int, default=None, help="training steps")
    parser.add_argument("--inverse-steps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("neural_operator_results"))
    cnn.add_dtype_flag(parser)
    args = parser.parse_args(argv)
    steps = args.steps or (60 if args.quick else 3000)
    inverse_steps = args.inverse_steps or (15 if args.quick else 300)
    train_count, test_count = (64, 16) if args.quick else (2000, 200)
    args.out.mkdir(parents=True, exist_ok=True)

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    test_k, test_u = dataset(rng, test_count)
    if args.model:
        model = load_tree(args.model, FNO(jax.random.key(0)))
        model_file = args.model
    else:
        train_k, train_u = dataset(rng, train_count)
        seconds = time.perf_counter() - t0
        print(f"data: {train_count} + {test_count} solves in {seconds:.1f} s")
        t0 = time.perf_counter()
        model = cnn.train(
            train_k, train_u, steps, model_class=FNO, lr=3e-3, dtype=args.dtype
        )
        model = cnn.as_dtype(model, "float32")
        print(f"training: {steps} steps in {time.perf_counter() - t0:.1f} s")
        model_file = args.save or args.out / "fno.safetensors"
        save_tree(model_file, model)
    quantized = {
        "int8": qnn.quantize(model),
        "int4": qnn.quantize(model, precision="int4", group_size=GROUP_SIZE),
    }
    int4_file = args.out / "fno_int4.safetensors"
    save_tree(int4_file, quantized["int4"])
    results = {}
    for precision, m in {"float32": model, **quantized}.items():
        results[f"test relative L2, {precision}"] = relative_l2(
            predict(m, test_k), test_u
        )
        results[f"model bytes, {precision}"] = cnn.nbytes(m)
    log_k_star, u_star = test_k[0], solve(test_k[0]).astype(np.float32)

    from tesseract_core import Tesseract
    from tesseract_jax import apply_tesseract

    recovered, curves = {}, {}
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        runs = {}
        for precision, file in (("int8", model_file), ("int4", int4_file)):
            url = stack.enter_context(
                cnn.served(file, scratch, HERE / "tesseract_api.py")
            )
            tess = stack.enter_context(Tesseract.from_url(url))
            runs[f"{precision}, served"] = lambda f, t=tess: apply_tesseract(
                t, {"log_k": f}
            )["u"]
        runs["float32, in JAX"] = lambda f: jax.vmap(model)(f[:, None])[:, 0]
        for name, fn in runs.items():
            f, losses, seconds = cnn.invert(fn, u_star, inverse_steps)
            recovered[name], curves[name] = f, losses
            results[f"inverse, {name}: log k relative L2"] = relative_l2(
                f[None], log_k_star[None]
            )
            results[f"inverse, {name}: solver u relative L2"] = relative_l2(
                solve(f)[None], u_star[None]
            )
            results[f"inverse, {name}: ms per step"] = 1e3 * seconds
            results[f"inverse, {name}: final loss"] = losses[-1]
    cnn.figure(args.out / "neural_operator.png", log_k_star, u_star, recovered, curves)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "table.md").write_text(table(results))
    for key, value in results.items():
        print(f"{key:<62} {value:.4g}")
    print(table(results))
    return results


if __name__ == "__main__":
    main()
