"""The CNN surrogate end to end: data, float32 training, int8 serving, and an
inverse problem solved by gradient descent through the served Tesseract.

1. Data: log-conductivity fields and the NumPy solver's temperatures
   (heat_surrogate.py).
2. Training: the surrogate in float32 with optax (Adam, cosine decay); the
   weights are saved keyed by the model's pytree paths (surrogate.safetensors,
   what tesseract_api.py serves).
3. Test error (relative L2 against the solver) of the float32 model and of
   its int8 copy (qarray.nn.quantize).
4. The inverse problem: given a measured temperature field u* (the solver's,
   for a held-out log_k*), recover log_k by Adam on
   ||surrogate(log_k) - u*||^2 / ||u*||^2 + a smoothness penalty, through the
   served int8 surrogate (tesseract-jax: apply + vector_jacobian_product per
   step) and through the float32 model in JAX; the recovered fields' error
   against log_k*, and the solver's temperatures for them against u*.

    .venv/bin/python examples/cnn_surrogate/pipeline.py            # full: ~5 min
    .venv/bin/python examples/cnn_surrogate/pipeline.py --quick    # a minute
    ... --model examples/cnn_surrogate/surrogate.safetensors       # skip training

Without --url a qarray-serve for tesseract_api.py is started on a free
loopback port and stopped at the end. Writes --out/results.json and
--out/cnn_surrogate.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
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
from heat_surrogate import (  # noqa: E402
    GRID,
    Surrogate,
    dataset,
    predict,
    relative_l2,
    solve,
)

import qarray.nn as qnn  # noqa: E402
from qarray.checkpoint import load_tree, save_tree  # noqa: E402


def as_dtype(model, dtype):
    """``model`` with every float array in ``dtype`` (a float model, or a
    trainable quantized one: a stored layer's scales stay float32)."""
    return jax.tree.map(
        lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model
    )


def train(
    log_k, u, steps: int, seed: int = 0, batch: int = 16, model_class=Surrogate,
    lr=2e-3, *, dtype="float32", param_dtype=None, qat: bool = False,
    on_step=None,
):  # fmt: skip
    """``model_class(key, u_scale=...)`` (the surrogate) trained with Adam,
    cosine decay from ``lr``, on the relative MSE. ``dtype``: the
    computation's (activations, and the parameters as the forward pass sees
    them; the loss in float32); ``param_dtype``: the parameters' as trained
    and returned (default ``dtype``; "float32" with a bfloat16 ``dtype``:
    mixed precision, float32 master weights). ``qat``: quantization-aware
    (``qnn.quantize(trainable=True)``: int8 weights, quantized on every
    call). ``on_step(i, loss)`` after every step (default: the loss printed
    ten times)."""
    param_dtype = dtype if param_dtype is None else param_dtype
    scale = float(np.sqrt((u**2).mean()))
    model = model_class(jax.random.key(seed), u_scale=scale)
    model = qnn.quantize(model, trainable=True) if qat else model
    model = as_dtype(model, param_dtype)
    optimizer = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=0.02))
    state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state, x, y):
        def loss(m):
            pred = jax.vmap(as_dtype(m, dtype))(x[:, None].astype(dtype))[:, 0]
            return jnp.mean((pred.astype(jnp.float32) - y) ** 2) / scale**2

        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, state = optimizer.update(grads, state)
        # in the parameters' dtype: equinox adds float32 updates as they come
        return as_dtype(eqx.apply_updates(model, updates), param_dtype), state, value

    rng = np.random.default_rng(seed)
    for i in range(steps):
        pick = rng.integers(0, len(log_k), batch)
        model, state, value = step(model, state, log_k[pick], u[pick])
        if on_step is not None:
            on_step(i, value)
        elif i % max(1, steps // 10) == 0:
            print(f"  step {i:5d}  loss {float(value):.3e}", flush=True)
    return model


def add_dtype_flag(parser) -> None:
    """``--dtype``: the training's (the trained model is then served as
    float32 and int8, the Tesseract's contract)."""
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="parameters and activations while training (the loss float32)",
    )


def nbytes(model) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def smoothness(f):
    return jnp.mean(jnp.diff(f, axis=-1) ** 2) + jnp.mean(jnp.diff(f, axis=-2) ** 2)


def invert(surrogate_fn, u_star, steps: int, weight: float = 0.05, lr: float = 0.05):
    """log_k from u* by Adam through ``surrogate_fn`` ((1, G, G) -> (1, G, G)):
    (recovered field, losses, seconds per step after the first)."""
    target = jnp.asarray(u_star[None])
    norm = float(jnp.mean(target**2))

    def loss(f):
        misfit = jnp.mean((surrogate_fn(f) - target) ** 2) / norm
        return misfit + weight * smoothness(f)

    grad_fn = jax.jit(jax.value_and_grad(loss))
    optimizer = optax.adam(lr)
    f = jnp.zeros((1, GRID, GRID), jnp.float32)
    state = optimizer.init(f)
    losses, start = [], None
    for i in range(steps):
        value, g = grad_fn(f)
        updates, state = optimizer.update(g, state)
        f = optax.apply_updates(f, updates)
        losses.append(float(value))
        if i == 0:
            start = time.perf_counter()
    seconds = (time.perf_counter() - start) / max(steps - 1, 1)
    return np.asarray(f[0]), losses, seconds


@contextlib.contextmanager
def served(model_file: Path, scratch: Path, api: Path = HERE / "tesseract_api.py"):
    """qarray-serve for ``api`` (this folder's tesseract_api.py) with
    QARRAY_MODEL=model_file; each request's run folder goes to ``scratch``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "TESSERACT_API_PATH": str(api),
        "QARRAY_MODEL": str(model_file),
        "TESSERACT_OUTPUT_FORMAT": "json+base64",
        "TESSERACT_OUTPUT_PATH": str(scratch),
    }
    serve = Path(sys.executable).with_name("qarray-serve")
    proc = subprocess.Popen(
        [str(serve), "serve", "--host", "127.0.0.1", "--port", str(port)], env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        import requests

        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"qarray-serve exited with {proc.returncode}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/health", timeout=1).ok:
                    break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def figure(path, log_k_star, u_star, recovered, curves):
    """The true and recovered fields side by side, and the loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("true log k", log_k_star), ("measured u*", u_star)]
    panels += [(f"recovered log k, {name}", f) for name, f in recovered.items()]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(3.8 * (len(panels) + 1), 3.6))
    for ax, (title, field) in zip(axes, panels, strict=False):
        im = ax.imshow(field, cmap="viridis")
        ax.set_title(title, fontsize=9)
        ax.axis("off")
        fig.colorbar(im, ax=ax, fraction=0.046)
    for name, losses in curves.items():
        axes[-1].semilogy(losses, label=name)
    axes[-1].set_title("inverse problem: loss")
    axes[-1].set_xlabel("Adam step")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small data, few steps")
    parser.add_argument("--model", type=Path, help="a trained model file: no training")
    parser.add_argument("--save", type=Path, help="where to write the trained model")
    parser.add_argument("--url", help="a running Tesseract (else one is started)")
    parser.add_argument("--steps", type=int, default=None, help="training steps")
    parser.add_argument("--inverse-steps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("cnn_surrogate_results"))
    add_dtype_flag(parser)
    args = parser.parse_args(argv)
    steps = args.steps or (60 if args.quick else 3000)
    inverse_steps = args.inverse_steps or (15 if args.quick else 300)
    train_count, test_count = (64, 16) if args.quick else (2000, 200)
    args.out.mkdir(parents=True, exist_ok=True)

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    test_k, test_u = dataset(rng, test_count)
    if args.model:
        model = load_tree(args.model, Surrogate(jax.random.key(0)))
        model_file = args.model
    else:
        train_k, train_u = dataset(rng, train_count)
        seconds = time.perf_counter() - t0
        print(f"data: {train_count} + {test_count} solves in {seconds:.1f} s")
        t0 = time.perf_counter()
        model = as_dtype(train(train_k, train_u, steps, dtype=args.dtype), "float32")
        print(f"training: {steps} steps in {time.perf_counter() - t0:.1f} s")
        model_file = args.save or args.out / "surrogate.safetensors"
        save_tree(model_file, model)
    int8 = qnn.quantize(model)
    results = {
        "test relative L2, float32": relative_l2(predict(model, test_k), test_u),
        "test relative L2, int8": relative_l2(predict(int8, test_k), test_u),
        "model bytes, float32": nbytes(model),
        "model bytes, int8": nbytes(int8),
    }
    log_k_star, u_star = test_k[0], solve(test_k[0]).astype(np.float32)

    from tesseract_core import Tesseract
    from tesseract_jax import apply_tesseract

    recovered, curves = {}, {}
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory())
        url = args.url or stack.enter_context(served(model_file, Path(scratch)))
        tess = stack.enter_context(Tesseract.from_url(url))
        runs = {
            "int8, served (tesseract-jax)": lambda f: apply_tesseract(
                tess, {"log_k": f}
            )["u"],
            "float32, in JAX": lambda f: jax.vmap(model)(f[:, None])[:, 0],
        }
        for name, fn in runs.items():
            f, losses, seconds = invert(fn, u_star, inverse_steps)
            recovered[name], curves[name] = f, losses
            results[f"inverse, {name}: log k relative L2"] = relative_l2(
                f[None], log_k_star[None]
            )
            results[f"inverse, {name}: solver u relative L2"] = relative_l2(
                solve(f)[None], u_star[None]
            )
            results[f"inverse, {name}: ms per step"] = 1e3 * seconds
            results[f"inverse, {name}: final loss"] = losses[-1]
    figure(args.out / "cnn_surrogate.png", log_k_star, u_star, recovered, curves)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    for key, value in results.items():
        print(f"{key:<62} {value:.4g}")
    return results


if __name__ == "__main__":
    main()
