"""Quantization-aware training of a digit classifier through the served Tesseract.

A 2-layer relu network (64 -> 64 -> 10, weights stored (out, in) like
PyTorch's nn.Linear: layout "nk") classifies scikit-learn's 8x8 digits (1797
images that ship with the package: no download). The Tesseract quantizes its
weights to int8 on every forward pass; tesseract-jax's apply_tesseract makes
the served network a JAX function, so jax.jit(jax.value_and_grad(loss)) gets
its gradients from the Tesseract's vector_jacobian_product (straight-through
for the weights) and optax's Adam updates the float32 master weights. A float32
model in plain JAX, with the same initialization, optimizer and mini-batches,
is the baseline. Finally the trained weights come back as int8 (return_w_q)
and are served as such.

Start the server first (`make serve`), then:

    .venv/bin/python examples/qat_pipeline.py [--url ...] [--steps 300]
        [--plot qat_pipeline.png] [--quantize-activations]
"""

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tesseract_core import Tesseract
from tesseract_jax import apply_tesseract

WIDTHS = (64, 64, 10)  # 8x8 pixels -> hidden -> 10 classes
ACTIVATIONS = ("relu", "none")
INT4_GROUP = 16


def load_data(seed=0):
    """Digits scaled to [0, 1], split 75/25 (stratified)."""
    digits = load_digits()
    x = (digits.data / 16).astype(np.float32)
    return train_test_split(
        x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target
    )


def init_params(key):
    """He-normal weights (N, K) and zero biases, per layer."""
    params = []
    for k, n in itertools.pairwise(WIDTHS):
        key, sub = jax.random.split(key)
        w = jax.random.normal(sub, (n, k), jnp.float32) * np.sqrt(2 / k)
        params.append({"w": w, "bias": jnp.zeros(n, jnp.float32)})
    return params


def served_logits(tess, params, x, quantize_activations=False, precision="int8"):
    """The network as the Tesseract computes it: int8 (or int4) weights, and
    int8 activations with ``quantize_activations``."""
    layers = [
        {**p, "layout": "nk", "activation": activation, **_precision(precision)}
        for p, activation in zip(params, ACTIVATIONS, strict=True)
    ]
    request = {"x": x, "layers": layers, "quantize_activations": quantize_activations}
    return apply_tesseract(tess, request)["y"]


def _precision(precision):
    """A layer's precision fields: int4 in groups of 16 inputs (K = 64)."""
    if precision == "int4":
        return {"precision": "int4", "group_size": INT4_GROUP}
    return {}


def float_logits(params, x):
    """The same network in plain float32 JAX."""
    h = x
    for p, activation in zip(params, ACTIVATIONS, strict=True):
        h = h @ p["w"].T + p["bias"]
        h = jax.nn.relu(h) if activation == "relu" else h
    return h


class Model:
    """A network, its optimizer state and its history: one training step and
    one evaluation, both jitted (for the served model, each a round trip)."""

    def __init__(self, logits, params, optimizer, x_test, y_test):
        def loss(params, x, labels):
            return optax.softmax_cross_entropy_with_integer_labels(
                logits(params, x), labels
            ).mean()

        @jax.jit
        def step(params, state, x, labels):
            value, grads = jax.value_and_grad(loss)(params, x, labels)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        @jax.jit
        def accuracy(params):
            return jnp.mean(jnp.argmax(logits(params, x_test), -1) == y_test)

        self.params, self.state = params, optimizer.init(params)
        self._step, self._accuracy = step, accuracy
        self.losses, self.accuracies = [], []

    def step(self, x, labels):
        self.params, self.state, loss = self._step(self.params, self.state, x, labels)
        self.losses.append(float(loss))

    def evaluate(self):
        self.accuracies.append(float(self._accuracy(self.params)))
        return self.accuracies[-1]


def train(url, steps=300, batch=128, lr=1e-2, eval_every=20, seed=0,
          quantize_activations=False, log=print, precision="int8"):  # fmt: skip
    """Train the served (int8 or int4) and the float32 model side by side."""
    x_train, x_test, y_train, y_test = load_data(seed)
    tess = Tesseract.from_url(url)
    init = init_params(jax.random.key(seed))
    optimizer = optax.adam(lr)
    served = Model(
        lambda p, x: served_logits(tess, p, x, quantize_activations, precision),
        init,
        optimizer,
        x_test,
        y_test,
    )
    baseline = Model(float_logits, init, optimizer, x_test, y_test)
    label = "int8 x int8" if quantize_activations else f"{precision} weights"
    log(
        f"digits: {len(x_train)} train / {len(x_test)} test images, network "
        f"{' -> '.join(map(str, WIDTHS))}, Adam lr {lr}, batch {batch}; "
        f"{label} (served) vs float32 (plain JAX)"
    )
    rng = np.random.default_rng(seed)
    eval_steps = []
    for step in range(1, steps + 1):
        idx = rng.choice(len(x_train), batch, replace=False)
        served.step(x_train[idx], y_train[idx])
        baseline.step(x_train[idx], y_train[idx])
        if step % eval_every == 0 or step == steps:
            eval_steps.append(step)
            log(
                f"step {step:4d}  loss {served.losses[-1]:.4f} (float32 "
                f"{baseline.losses[-1]:.4f})  test accuracy {served.evaluate():.3f} "
                f"(float32 {baseline.evaluate():.3f})"
            )
    return served, baseline, np.array(eval_steps), (x_test, y_test)


def export_int8(
    tess, params, x_test, y_test, quantize_activations=False, precision="int8"
):
    """The trained weights as int8 (or int4: return_w_q), served back as w_q:
    the deployed model. Returns (its test accuracy, bytes of the weights)."""
    layers = [
        {**jax.tree.map(np.asarray, p), "layout": "nk", "activation": activation}
        | _precision(precision)
        for p, activation in zip(params, ACTIVATIONS, strict=True)
    ]
    common = {"x": x_test, "quantize_activations": quantize_activations}
    out = tess.apply({**common, "layers": layers, "return_w_q": True})
    deployed = [
        {k: v for k, v in layer.items() if k != "w"} | {"w_q": got["w_q"]}
        for layer, got in zip(layers, out["layers"], strict=True)
    ]
    y = tess.apply({**common, "layers": deployed})["y"]
    size = sum(got["w_q"]["qvalue"].nbytes for got in out["layers"])
    return float(np.mean(np.argmax(y, -1) == y_test)), size


def plot(served, baseline, eval_steps, label, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = np.arange(1, len(served.losses) + 1)
    # float32 drawn wide underneath: where the curves agree, it frames int8's
    for model, name, style in (
        (baseline, "float32 (plain JAX)", {"color": "0.65", "lw": 3.5}),
        (served, f"{label} (served Tesseract)", {"color": "tab:blue", "lw": 1}),
    ):
        ax1.semilogy(steps, model.losses, label=name, **style)
        ax2.plot(eval_steps, model.accuracies, "o-", ms=3, label=name, **style)
    ax1.set(xlabel="step", ylabel="cross-entropy (mini-batch)", title="training loss")
    ax2.set(
        xlabel="step",
        ylabel="test accuracy",
        title=f"test accuracy: {label} {served.accuracies[-1]:.3f}, "
        f"float32 {baseline.accuracies[-1]:.3f}",
        ylim=(max(0.0, min(served.accuracies + baseline.accuracies) - 0.02), 1.0),
    )
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Quantization-aware training through the served Tesseract, optax Adam")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--plot", default="qat_pipeline.png")
    parser.add_argument(
        "--quantize-activations",
        action="store_true",
        help="int8 x int8 products (activations quantized too)",
    )
    parser.add_argument(
        "--precision",
        choices=("int8", "int4"),
        default="int8",
        help=f"the served weights: int8 per row, or int4 per {INT4_GROUP} inputs",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    served, baseline, eval_steps, (x_test, y_test) = train(
        args.url,
        steps=args.steps,
        eval_every=args.eval_every,
        quantize_activations=args.quantize_activations,
        precision=args.precision,
    )
    seconds = time.perf_counter() - start
    label = "int8 x int8" if args.quantize_activations else f"{args.precision} weights"
    deployed, size = export_int8(
        Tesseract.from_url(args.url),
        served.params,
        x_test,
        y_test,
        args.quantize_activations,
        args.precision,
    )
    plot(served, baseline, eval_steps, label, args.plot)
    print(
        f"{label} (served): loss {served.losses[0]:.4f} -> {served.losses[-1]:.4f}; "
        f"float32: loss {baseline.losses[0]:.4f} -> {baseline.losses[-1]:.4f}"
    )
    print(
        f"test accuracy after {args.steps} steps: {label} (served) "
        f"{served.accuracies[-1]:.3f}, float32 {baseline.accuracies[-1]:.3f}; "
        f"exported {args.precision} weights ({size} bytes) served as w_q: "
        f"{deployed:.3f}"
    )
    print(f"trained in {seconds:.1f} s; plot saved to {args.plot}")


if __name__ == "__main__":
    main()
