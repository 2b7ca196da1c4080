"""QLoRA over HTTP for the Fourier neural operator: the int4 FNO, resident
in a Tesseract, adapted to a shifted family of problems by training only its
LoRA adapters through tesseract-jax, next to full fine-tuning of the float32
model (examples/cnn_surrogate/qlora.py, for the FNO).

1. The base: the trained FNO (fno.safetensors, source f = 1) stored int4
   (spectral rows and 1 x 1 convolutions in groups of GROUP; the 3-channel
   lift int8), served resident by qarray-serve for tesseract_api.py
   (QARRAY_MODEL), whose ``lora`` input takes rank-RANK adapters of its
   four SpectralConv layers and eight 1 x 1 convolutions. A spectral
   adapter is ``a (rank, C, *modes)`` then ``b (N, rank)``, complex, ``b``
   shared by the modes (qarray/nn/_lora.py says why).
2. The shifted family: the same log-conductivity fields under the heat
   source f(x, y) = 1 + 2 x (stronger to the right), solved by the NumPy
   solver; --train-count fields to adapt on, --test-count held out.
3. QLoRA: Adam on the adapters only (a small random, b zero: the adapted
   model starts as the base), each step one jax.jit(jax.value_and_grad)
   through apply_tesseract: an apply and a vector_jacobian_product with
   respect to ``lora.[i].a`` and ``lora.[i].b``; the int4 weights never
   travel.
4. Full fine-tuning: the float32 FNO, every weight trained in JAX, the same
   steps, batches and optimiser.
5. Per variant: the test error on the shifted family against the solver,
   trainable parameters, wire bytes per step, ms per step; the share of the
   full fine-tune's error reduction QLoRA recovers.

    .venv/bin/python examples/neural_operator/qlora.py --out fno_qlora_results  # ~4 min

Writes --out/qlora.json, --out/qlora.md and --out/qlora.png.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import sys
import tempfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fno import FNO, GRID  # noqa: E402


def _cnn_qlora():
    """examples/cnn_surrogate/qlora.py: its training loop, wire bytes,
    figure and server serve this example too."""
    path = HERE.parent / "cnn_surrogate" / "qlora.py"
    spec = importlib.util.spec_from_file_location("cnn_qlora", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cnn = _cnn_qlora()
from heat_surrogate import dataset, predict, relative_l2  # noqa: E402

import qarray.nn as qnn  # noqa: E402
from qarray.checkpoint import load_tree, save_tree  # noqa: E402

RANK = 1  # tesseract_api.py's lora_rank
GROUP = 20  # pipeline.py's GROUP_SIZE: int4 spectral rows (2 * WIDTH = 40)
CENTRES = (np.arange(GRID) + 0.5) / GRID
SOURCE = np.broadcast_to(1.0 + 2.0 * CENTRES[None, :], (GRID, GRID))  # 1 + 2 x
QLORA = "QLoRA (int4 base + adapters, HTTP)"
FULL = "full fine-tune (float32, in-process)"
BASE = "int4 base (before)"


def initial_adapters(base, seed: int) -> list[dict]:
    """qnn.lora's initialisation of the base's adapters: a small random, b 0."""
    adapted = qnn.lora(base, RANK, key=jax.random.key(seed))
    nodes = jax.tree.leaves(adapted, is_leaf=cnn._is_lora)
    return [{"a": n.a, "b": n.b} for n in nodes if cnn._is_lora(n)]


def with_adapters(base, adapters):
    """The base with the adapters, in-process (what the server computes)."""
    pairs = [(e["a"], e["b"]) for e in adapters]
    return qnn.with_adapters(base, pairs, alpha=float(RANK))


def table(summary: dict) -> str:
    rows = summary["rows"]
    lines = [
        "| variant | trainable parameters | test rel. L2 (shifted family) "
        "| wire bytes per step | ms per step |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        wire = row.get("wire bytes per step")
        ms = row.get("ms per step")
        lines.append(
            f"| {name} | {row['trainable parameters']:,} "
            f"| {row['test error (shifted family)']:.4f} "
            f"| {'' if wire is None else f'{wire:,}'} "
            f"| {'' if ms is None else f'{ms:.0f}'} |"
        )
    lines.append("")
    lines.append(
        f"QLoRA: {summary['QLoRA trainable share']:.1%} of the full fine-tune's "
        f"trainable parameters, {summary['QLoRA share of the error reduction']:.1%} "
        f"of its error reduction ({summary['steps']} steps, rank {summary['rank']})."
    )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=HERE / "fno.safetensors")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--train-count", type=int, default=256)
    parser.add_argument("--test-count", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-2, help="QLoRA's Adam")
    parser.add_argument("--full-lr", type=float, default=1e-3, help="full's Adam")
    parser.add_argument("--out", type=Path, default=Path("fno_qlora_results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = load_tree(args.model, FNO(jax.random.key(0)))
    base = qnn.quantize(model, precision="int4", group_size=GROUP)
    train = dataset(np.random.default_rng(11), args.train_count, source=SOURCE)
    test_k, test_u = dataset(np.random.default_rng(12), args.test_count, source=SOURCE)
    scale = float(np.sqrt((train[1] ** 2).mean()))
    rows, curves = {}, {}

    def relative_mse(pred, u):
        return jnp.mean((pred - u) ** 2) / scale**2

    field_shape = (args.batch, GRID, GRID)
    weights = [a.shape for a in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    adapters = initial_adapters(base, seed=0)
    adapter_shapes = [a.shape for e in adapters for a in (e["a"], e["b"])]
    rows[BASE] = {
        "test error (shifted family)": relative_l2(predict(base, test_k), test_u),
        "trainable parameters": 0,
    }
    from tesseract_core import Tesseract
    from tesseract_jax import apply_tesseract

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        save_tree(scratch / "int4.safetensors", base)
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(
                cnn.served(
                    scratch / "int4.safetensors", scratch, HERE / "tesseract_api.py"
                )
            )
            tess = stack.enter_context(Tesseract.from_url(url))

            def loss(adapters, log_k, u):
                pred = apply_tesseract(tess, {"log_k": log_k, "lora": adapters})["u"]
                return relative_mse(pred, u)

            print("QLoRA over HTTP (int4 base resident, adapters only):")
            adapters, curves["QLoRA (int4, HTTP)"], seconds = cnn.fit(
                jax.jit(jax.value_and_grad(loss)), adapters, train, args.steps,
                args.batch, args.lr, seed=1,
            )  # fmt: skip
            # the server's answer and the in-process adapted model agree
            served_u = apply_tesseract(
                tess, {"log_k": jnp.asarray(test_k[:4]), "lora": adapters}
            )["u"]
        adapted = with_adapters(base, adapters)
        local_u = predict(adapted, test_k[:4])
        agreement = float(np.max(np.abs(np.asarray(served_u) - local_u)))
        rows[QLORA] = {
            "test error (shifted family)": relative_l2(
                predict(adapted, test_k), test_u
            ),
            "trainable parameters": sum(math.prod(s) for s in adapter_shapes),
            # apply: fields and adapters up, u down; vjp: fields, adapters and
            # the cotangent up, the adapters' gradients down
            "wire bytes per step": cnn.wire_bytes(
                *(field_shape, *adapter_shapes, field_shape),
                *(field_shape, *adapter_shapes, field_shape, *adapter_shapes),
            ),
            "ms per step": 1e3 * seconds,
            "served vs in-process max |du|": agreement,
        }
    # the same step with the float32 weights on the wire instead (what a
    # Tesseract taking the weights in the request moves): for the ratio
    full_wire = cnn.wire_bytes(
        field_shape, *weights, field_shape,
        field_shape, *weights, field_shape, *weights,
    )  # fmt: skip
    rows[QLORA]["wire bytes / full-weight step"] = (
        rows[QLORA]["wire bytes per step"] / full_wire
    )

    @jax.jit
    def full_loss_and_grad(params, log_k, u):
        def loss(params):
            m = eqx.combine(params, static)
            return relative_mse(jax.vmap(m)(log_k[:, None])[:, 0], u)

        return jax.value_and_grad(loss)(params)

    params, static = eqx.partition(model, eqx.is_inexact_array)
    print("full fine-tuning, float32 in JAX:")
    params, curves["full fine-tune (float32)"], seconds = cnn.fit(
        full_loss_and_grad, params, train, args.steps, args.batch, args.full_lr,
        seed=1,
    )  # fmt: skip
    tuned = eqx.combine(params, static)
    rows[FULL] = {
        "test error (shifted family)": relative_l2(predict(tuned, test_k), test_u),
        "trainable parameters": sum(math.prod(s) for s in weights),
        "wire bytes per step": full_wire,
        "ms per step": 1e3 * seconds,
    }
    before = rows[BASE]["test error (shifted family)"]
    after = rows[QLORA]["test error (shifted family)"]
    full = rows[FULL]["test error (shifted family)"]
    summary = {
        "QLoRA share of the error reduction": (before - after) / (before - full),
        "QLoRA trainable share": rows[QLORA]["trainable parameters"]
        / rows[FULL]["trainable parameters"],
        "rows": rows,
        "steps": args.steps,
        "rank": RANK,
    }
    for name, row in rows.items():
        print(name, {k: round(v, 5) for k, v in row.items()}, flush=True)
    print(table(summary))
    cnn.figure(
        args.out / "qlora.png",
        curves,
        {
            "solver, f = 1 + 2x": test_u[0],
            "int4 FNO (trained on f = 1)": predict(base, test_k[:1])[0],
            "int4 FNO + QLoRA": predict(adapted, test_k[:1])[0],
        },
    )
    (args.out / "qlora.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "qlora.md").write_text(table(summary))
    return summary


if __name__ == "__main__":
    main()
