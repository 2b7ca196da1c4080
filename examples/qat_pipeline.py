"""Quantization-aware training through the served Tesseract, with tesseract-jax.

A linear model y = x @ W + b whose weights are int8-quantized on every forward
pass (inside the Tesseract) is fitted to a teacher by gradient descent. JAX
differentiates through the HTTP endpoint: apply_tesseract's gradients come from
the Tesseract's vector_jacobian_product (straight-through for W).

Start the server first (`make serve`), then:

    .venv/bin/python examples/qat_pipeline.py [--url ...] [--steps 60] [--plot qat.png]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from tesseract_core import Tesseract
from tesseract_jax import apply_tesseract


def train(url, steps=60, lr=0.05, seed=0, log=print):
    """Fit W, b by Adam; returns per-step (loss, weight_error) arrays."""
    rng = np.random.default_rng(seed)
    k, n, m = 32, 8, 128
    x = rng.standard_normal((m, k)).astype(np.float32)
    teacher = rng.standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
    target = x @ teacher + 0.1

    tess = Tesseract.from_url(url)

    def loss_fn(params):
        out = apply_tesseract(tess, {"x": x, "w": params["w"], "bias": params["b"]})
        loss = jnp.mean((out["y"] - target) ** 2)
        return loss, out["weight_error"]

    step_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    params = {
        "w": jnp.zeros((k, n), jnp.float32) + 1e-3,
        "b": jnp.zeros(n, jnp.float32),
    }
    moments = jax.tree.map(lambda p: (jnp.zeros_like(p), jnp.zeros_like(p)), params)
    losses, errors = [], []
    for step in range(1, steps + 1):
        (loss, weight_error), grads = step_fn(params)
        params, moments = adam_update(params, grads, moments, step, lr)
        losses.append(float(loss))
        errors.append(float(weight_error))
        if step == 1 or step % 10 == 0 or step == steps:
            log(f"step {step:4d}  loss {loss:.5f}  weight error {weight_error:.4f}")
    return np.array(losses), np.array(errors)


def adam_update(params, grads, moments, step, lr, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step on pytrees; moments is a pytree of (mean, variance) pairs."""
    is_pair = lambda t: isinstance(t, tuple)  # noqa: E731
    moments = jax.tree.map(
        lambda g, mv: (b1 * mv[0] + (1 - b1) * g, b2 * mv[1] + (1 - b2) * g * g),
        grads,
        moments,
        is_leaf=is_pair,
    )
    correct1, correct2 = 1 - b1**step, 1 - b2**step
    params = jax.tree.map(
        lambda p, mv: p - lr * (mv[0] / correct1) / (jnp.sqrt(mv[1] / correct2) + eps),
        params,
        moments,
        is_leaf=is_pair,
    )
    return params, moments


def plot(losses, errors, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = np.arange(1, len(losses) + 1)
    ax1.semilogy(steps, losses)
    ax1.set(xlabel="step", ylabel="MSE loss", title="QAT through the served Tesseract")
    ax2.plot(steps, errors, color="tab:orange")
    ax2.set(xlabel="step", ylabel="||w - W|| / ||w||", title="int8 weight error")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--plot", default="qat_pipeline.png")
    args = parser.parse_args()
    losses, errors = train(args.url, steps=args.steps)
    plot(losses, errors, args.plot)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; plot saved to {args.plot}")


if __name__ == "__main__":
    main()
