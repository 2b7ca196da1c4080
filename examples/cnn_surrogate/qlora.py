"""QLoRA over HTTP: the int4 CNN surrogate, resident in a Tesseract, adapted
to a shifted family of problems by training only its LoRA adapters through
tesseract-jax, next to full fine-tuning of the float32 model.

1. The base: the trained surrogate (surrogate.safetensors, source f = 1)
   stored int4 (G = 32; the first convolution int8) and served resident by
   qarray-serve for tesseract_api.py (QARRAY_MODEL), whose ``lora`` input
   takes rank-4 adapters of its nine convolutions.
2. The shifted family: the same log-conductivity fields under the heat
   source f(x, y) = 1 + 2 x (stronger to the right), solved by the NumPy
   solver; --train-count fields to adapt on, --test-count held out.
3. QLoRA: Adam on the adapters only (a small random, b zero: the adapted
   model starts as the base), each step one jax.jit(jax.value_and_grad)
   through apply_tesseract: an apply and a vector_jacobian_product with
   respect to ``lora.[i].a`` and ``lora.[i].b``; the int4 weights never
   travel.
4. Full fine-tuning: the float32 surrogate, every weight trained in JAX,
   the same steps, batches and optimiser.
5. Per variant: the test error on the shifted family against the solver,
   trainable parameters, wire bytes per step (base64 payload of the arrays
   sent and received), ms per step.

    .venv/bin/python examples/cnn_surrogate/qlora.py [--steps 400]

Writes --out/qlora.json and --out/qlora.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from heat_surrogate import GRID, Surrogate, dataset, predict, relative_l2  # noqa: E402
from pipeline import served  # noqa: E402

import qarray.nn as qnn  # noqa: E402
from qarray.checkpoint import load_tree, save_tree  # noqa: E402

RANK = 4  # tesseract_api.py's lora_rank
GROUP = 32
CENTRES = (np.arange(GRID) + 0.5) / GRID
SOURCE = np.broadcast_to(1.0 + 2.0 * CENTRES[None, :], (GRID, GRID))  # 1 + 2 x


def wire_bytes(*shapes) -> int:
    """Bytes of float32 arrays as base64 JSON (4 / 3 of their bytes, and a
    little per array for its shape and dtype)."""
    return sum(4 * math.ceil(4 * math.prod(s) / 3) + 80 for s in shapes)


def initial_adapters(base, seed: int) -> list[dict]:
    """qnn.lora's initialisation of the base's adapters: a small random, b 0."""
    adapted = qnn.lora(base, RANK, key=jax.random.key(seed))
    nodes = [n for n in jax.tree.leaves(adapted, is_leaf=_is_lora) if _is_lora(n)]
    return [{"a": n.a, "b": n.b} for n in nodes]


def _is_lora(node) -> bool:
    return isinstance(node, qnn.LoRA)


def with_adapters(base, adapters):
    """The base with the adapters, in-process (what the server computes)."""
    pairs = [(e["a"], e["b"]) for e in adapters]
    return qnn.with_adapters(base, pairs, alpha=float(RANK))


def fit(loss_and_grad, params, data, steps: int, batch: int, lr: float, seed: int):
    """Adam (cosine decay) on ``params``: (params, losses, seconds per step
    after the first, which compiles)."""
    log_k, u = data
    optimizer = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=0.05))
    state = optimizer.init(params)
    rng = np.random.default_rng(seed)
    losses, start = [], None
    for i in range(steps):
        pick = rng.integers(0, len(log_k), batch)
        value, grads = loss_and_grad(params, jnp.asarray(log_k[pick]),
                                     jnp.asarray(u[pick]))  # fmt: skip
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
        if i == 0:
            start = time.perf_counter()
        if i % max(1, steps // 10) == 0:
            print(f"  step {i:5d}  loss {losses[-1]:.3e}", flush=True)
    seconds = (time.perf_counter() - start) / max(1, steps - 1)
    return params, losses, seconds


def figure(path, curves: dict, fields: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(fields), figsize=(4 * (1 + len(fields)), 3.6))
    for name, losses in curves.items():
        axes[0].semilogy(losses, label=name)
    axes[0].set_xlabel("step")
    axes[0].set_title("training loss (relative MSE)")
    axes[0].legend()
    for ax, (name, field) in zip(axes[1:], fields.items(), strict=True):
        image = ax.imshow(field, origin="lower", cmap="inferno")
        ax.set_title(name, fontsize=9)
        ax.axis("off")
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=HERE / "surrogate.safetensors")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--train-count", type=int, default=256)
    parser.add_argument("--test-count", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, default=Path("qlora_results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = load_tree(args.model, Surrogate(jax.random.key(0)))
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
    rows["int4 base (before)"] = {
        "test error (shifted family)": relative_l2(predict(base, test_k), test_u),
        "trainable parameters": 0,
    }
    from tesseract_core import Tesseract
    from tesseract_jax import apply_tesseract

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        save_tree(scratch / "int4.safetensors", base)
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(served(scratch / "int4.safetensors", scratch))
            tess = stack.enter_context(Tesseract.from_url(url))

            def loss(adapters, log_k, u):
                pred = apply_tesseract(tess, {"log_k": log_k, "lora": adapters})["u"]
                return relative_mse(pred, u)

            print("QLoRA over HTTP (int4 base resident, adapters only):")
            adapters, curves["QLoRA (int4, HTTP)"], seconds = fit(
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
        rows["QLoRA (int4 base + adapters, HTTP)"] = {
            "test error (shifted family)": relative_l2(
                predict(adapted, test_k), test_u
            ),
            "trainable parameters": sum(math.prod(s) for s in adapter_shapes),
            # apply: fields and adapters up, u down; vjp: fields, adapters and
            # the cotangent up, the adapters' gradients down
            "wire bytes per step": wire_bytes(
                field_shape,
                *adapter_shapes,
                field_shape,
                field_shape,
                *adapter_shapes,
                field_shape,
                *adapter_shapes,
            ),
            "ms per step": 1e3 * seconds,
            "served vs in-process max |du|": agreement,
        }
    # the same step with the float32 weights on the wire instead (what a
    # Tesseract taking the weights in the request moves): for the ratio
    full_wire = wire_bytes(
        field_shape, *weights, field_shape,
        field_shape, *weights, field_shape, *weights,
    )  # fmt: skip
    rows["QLoRA (int4 base + adapters, HTTP)"]["wire bytes / full-weight step"] = (
        rows["QLoRA (int4 base + adapters, HTTP)"]["wire bytes per step"] / full_wire
    )

    @jax.jit
    def full_loss_and_grad(params, log_k, u):
        def loss(params):
            m = eqx.combine(params, static)
            return relative_mse(jax.vmap(m)(log_k[:, None])[:, 0], u)

        return jax.value_and_grad(loss)(params)

    params, static = eqx.partition(model, eqx.is_inexact_array)
    print("full fine-tuning, float32 in JAX:")
    params, curves["full fine-tune (float32)"], seconds = fit(
        full_loss_and_grad, params, train, args.steps, args.batch, args.lr, seed=1
    )
    tuned = eqx.combine(params, static)
    rows["full fine-tune (float32, in-process)"] = {
        "test error (shifted family)": relative_l2(predict(tuned, test_k), test_u),
        "trainable parameters": sum(math.prod(s) for s in weights),
        "wire bytes per step": full_wire,
        "ms per step": 1e3 * seconds,
    }
    before = rows["int4 base (before)"]["test error (shifted family)"]
    after = rows["QLoRA (int4 base + adapters, HTTP)"]["test error (shifted family)"]
    full = rows["full fine-tune (float32, in-process)"]["test error (shifted family)"]
    summary = {
        "QLoRA share of the full fine-tune's error reduction": (before - after)
        / (before - full),
        "rows": rows,
        "steps": args.steps,
        "rank": RANK,
    }
    for name, row in rows.items():
        print(name, {k: round(v, 5) for k, v in row.items()}, flush=True)
    print(f"QLoRA recovers {summary[next(iter(summary))]:.1%} of the full "
          "fine-tune's error reduction")  # fmt: skip
    figure(
        args.out / "qlora.png",
        curves,
        {
            "solver, f = 1 + 2x": test_u[0],
            "int4 base (trained on f = 1)": predict(base, test_k[:1])[0],
            "int4 base + QLoRA": predict(adapted, test_k[:1])[0],
        },
    )
    (args.out / "qlora.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
