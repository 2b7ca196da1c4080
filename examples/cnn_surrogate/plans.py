"""Mixed-precision plans for the CNN surrogate, served resident, next to
float32, all-int8 and all-int4: weight bytes, the surrogate's error against
the solver, and the inverse problem solved through each served model.

1. ``qarray-serve plan surrogate.safetensors data.npz --like
   heat_surrogate.py:Surrogate --budget B`` at two budgets (output relative
   L2 against float32 on 32 fields): each writes a tree model file whose
   layers are int4, int8 or float32.
   With ``--methods rtn,gptq``, each budget planned with each method
   (GPTQ calibrated on 128 training fields, ``--method gptq --data``).
2. Each model file (the plans, all-int8, all-int4 with groups of 32: the
   first convolution, K = 9, stays int8; all-int4 by GPTQ and by AWQ on the
   same 128 fields) served by qarray-serve for
   tesseract_api.py (QARRAY_MODEL); float32 runs in JAX, as the trained model.
3. Per model: its test error against the solver (200 held-out fields), and
   the inverse problem of pipeline.py through it (tesseract-jax: apply +
   vector_jacobian_product per Adam step).

    .venv/bin/python examples/cnn_surrogate/plans.py [--budgets 0.02,0.01]

Writes --out/plans.json and --out/cnn_plans.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from heat_surrogate import Surrogate, dataset, predict, relative_l2, solve  # noqa: E402
from pipeline import invert, nbytes, served  # noqa: E402

import qarray.nn as qnn  # noqa: E402
from qarray.checkpoint import load_quantized, load_tree, save_tree  # noqa: E402

GROUP = 32  # divides the inner convolutions' K = 32 * 9


def make_plan(model_file: Path, data: Path, budget: float, out: Path,
              method: str = "rtn", calibration: Path | None = None):  # fmt: skip
    """qarray-serve plan on the float32 file; its JSON report and seconds."""
    serve = Path(sys.executable).with_name("qarray-serve")
    calibrated = [] if method == "rtn" else ["--method", method, "--data", calibration]
    start = time.perf_counter()
    subprocess.run(
        [
            str(serve), "plan", str(model_file), str(data),
            "--like", f"{HERE / 'heat_surrogate.py'}:Surrogate",
            "--budget", str(budget), "--group-size", str(GROUP),
            "--out", str(out), "--json", str(out.with_suffix(".json")),
            *map(str, calibrated),
        ],
        check=True,
    )  # fmt: skip
    report = json.loads(out.with_suffix(".json").read_text())
    return {**report, "command_seconds": time.perf_counter() - start}


def figure(path, rows: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    metrics = [
        ("test relative L2 vs the solver", "surrogate error (200 fields)"),
        ("inverse: log k relative L2", "inverse problem: recovered log k error"),
    ]
    # one marker (and legend entry) for models that coincide
    points: dict[tuple, list[str]] = {}
    for name, row in rows.items():
        where = (row["weight bytes"], *(row[key] for key, _ in metrics))
        points.setdefault(where, []).append(name)
    for (size, *values), names in points.items():
        for ax, value in zip(axes, values, strict=True):
            ax.scatter(size, value, s=40, label=" = ".join(names))
    for ax, (_, title) in zip(axes, metrics, strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("weight bytes (log)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7)
    fig.subplots_adjust(bottom=0.3)
    fig.suptitle("CNN surrogate: uniform precisions and qarray-serve plan's mixes")
    fig.savefig(path, dpi=100)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=HERE / "surrogate.safetensors")
    parser.add_argument("--budgets", default="0.02,0.01")
    parser.add_argument("--methods", default="rtn", help="plan methods: rtn,gptq")
    parser.add_argument("--inverse-steps", type=int, default=300)
    parser.add_argument("--test-count", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("cnn_plans_results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    skeleton = Surrogate(jax.random.key(0))
    model = load_tree(args.model, skeleton)
    test_k, test_u = dataset(np.random.default_rng(0), args.test_count)
    plan_k, _ = dataset(np.random.default_rng(7), 32)  # the plans' data
    calibration_k, _ = dataset(np.random.default_rng(1), 128)  # GPTQ's, AWQ's
    log_k_star, u_star = test_k[0], solve(test_k[0]).astype(np.float32)

    from tesseract_core import Tesseract
    from tesseract_jax import apply_tesseract

    rows, plans = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        np.savez(scratch / "data.npz", x=plan_k[:, None].astype(np.float32))
        calibration = calibration_k[:, None].astype(np.float32)
        np.savez(scratch / "calibration.npz", x=calibration)
        files = {}
        int4 = {"precision": "int4", "group_size": GROUP}
        for i, (name, variant) in enumerate((
            ("all int8", qnn.quantize(model)),
            (f"all int4 (G={GROUP})", qnn.quantize(model, **int4)),
            (f"all int4 (G={GROUP}), GPTQ",
             qnn.quantize(model, **int4, method="gptq", data=calibration)),
            (f"all int4 (G={GROUP}), AWQ",
             qnn.quantize(model, **int4, method="awq", data=calibration)),
        )):  # fmt: skip
            files[name] = scratch / f"variant_{i}.safetensors"
            save_tree(files[name], variant)
        for budget in (float(b) for b in args.budgets.split(",")):
            for method in args.methods.split(","):
                name = f"plan, budget {budget:g}" + (
                    f", {method.upper()}" if method != "rtn" else ""
                )
                files[name] = scratch / f"plan_{budget:g}_{method}.safetensors"
                plans[name] = make_plan(args.model, scratch / "data.npz", budget,
                                        files[name], method,
                                        scratch / "calibration.npz")  # fmt: skip

        def measure(name, loaded, surrogate_fn):
            f, losses, seconds = invert(surrogate_fn, u_star, args.inverse_steps)
            rows[name] = {
                "weight bytes": nbytes(loaded),
                "test relative L2 vs the solver": relative_l2(
                    predict(loaded, test_k), test_u
                ),
                "inverse: log k relative L2": relative_l2(f[None], log_k_star[None]),
                "inverse: solver u relative L2": relative_l2(
                    solve(f)[None], u_star[None]
                ),
                "inverse: ms per step": 1e3 * seconds,
                "inverse: final loss": losses[-1],
            }
            print(name, {k: round(v, 5) for k, v in rows[name].items()}, flush=True)

        measure("float32", model, lambda f: jax.vmap(model)(f[:, None])[:, 0])
        for name, file in files.items():
            loaded = load_quantized(file, skeleton)  # what the server loads
            with contextlib.ExitStack() as stack:
                url = stack.enter_context(served(file, scratch))
                tess = stack.enter_context(Tesseract.from_url(url))
                measure(name, loaded, lambda f, t=tess: apply_tesseract(
                    t, {"log_k": f})["u"])  # fmt: skip
            if name in plans:
                rows[name]["precisions"] = plans[name]["precisions"]
                rows[name]["plan"] = {
                    k: plans[name][k] for k in ("model", "bytes", "command_seconds")
                }
    figure(args.out / "cnn_plans.png", rows)
    (args.out / "plans.json").write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
