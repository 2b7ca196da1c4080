"""A trained digit classifier served resident as int8, and saliency maps through it.

A float32 MLP (64 -> 64 relu -> 10, plain JAX + optax Adam) learns
scikit-learn's 8x8 digits (they ship with the package: no download). Its
weights are saved the way PyTorch saves an nn.Linear state dict with
safetensors (fc1.weight (out, in), fc1.bias, fc2.weight, fc2.bias; no torch
needed), converted to an int8 qarray model file by `qarray-serve convert`,
and served resident (QARRAY_MODEL): requests carry only x. The example
compares test accuracy float32 vs served int8, the wire bytes of an apply
with resident weights vs the same apply sending the weights, and the input
gradients (saliency maps) taken through tesseract-jax against the served
model vs the float32 model's.

By default it starts its own server (`qarray-serve serve` on a free loopback
port with QARRAY_MODEL, stopped by its PID at the end):

    .venv/bin/python examples/resident_saliency.py [--steps 600] [--workdir DIR]
        [--plot docs/resident_saliency.png] [--digits 6]

Against a server you run: write the model file once, serve it, pass --url
(the float32 weights are then read back from DIR/state_dict.safetensors):

    .venv/bin/python examples/resident_saliency.py --workdir /tmp/digits
    QARRAY_MODEL=/tmp/digits/model.safetensors make serve
    .venv/bin/python examples/resident_saliency.py --workdir /tmp/digits \\
        --url http://127.0.0.1:8000
"""

import argparse
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import requests
from safetensors.numpy import load_file, save_file
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tesseract_core import Tesseract
from tesseract_jax import apply_tesseract

from qarray.checkpoint import load_model

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("fc1", "fc2")  # nn.Linear(64, 64), nn.Linear(64, 10)
WIDTHS = (64, 64, 10)  # 8x8 pixels -> hidden -> 10 classes
ACTIVATIONS = ("relu", "none")


# --- 1. the float32 model, trained in plain JAX


def load_data(seed=0):
    """Digits scaled to [0, 1], split 75/25 (stratified, fixed seed)."""
    digits = load_digits()
    x = (digits.data / 16).astype(np.float32)
    return train_test_split(
        x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target
    )


def init_params(key):
    """He-normal weights (out, in) like nn.Linear.weight, zero biases."""
    params = {}
    for name, k, n in zip(NAMES, WIDTHS[:-1], WIDTHS[1:], strict=True):
        key, sub = jax.random.split(key)
        params[f"{name}.weight"] = jax.random.normal(sub, (n, k)) * np.sqrt(2 / k)
        params[f"{name}.bias"] = jnp.zeros(n, jnp.float32)
    return params


def logits(params, x):
    """The network: y = x @ W.T + b per layer (torch's F.linear)."""
    h = x
    for name, activation in zip(NAMES, ACTIVATIONS, strict=True):
        h = h @ params[f"{name}.weight"].T + params[f"{name}.bias"]
        h = jax.nn.relu(h) if activation == "relu" else h
    return h


def train(x_train, y_train, steps, batch=128, lr=3e-3, seed=0):
    """Adam on the cross-entropy, mini-batches drawn with a fixed seed."""
    optimizer = optax.adam(lr)
    params = init_params(jax.random.key(seed))
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, x, labels):
        def loss(params):
            return optax.softmax_cross_entropy_with_integer_labels(
                logits(params, x), labels
            ).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    rng = np.random.default_rng(seed)
    for i in range(1, steps + 1):
        idx = rng.choice(len(x_train), batch, replace=False)
        params, state, loss = step(params, state, x_train[idx], y_train[idx])
        if i == 1 or i % max(1, steps // 4) == 0 or i == steps:
            print(f"  step {i:4d}  loss {float(loss):.4f}")
    return params


def accuracy(y, labels) -> float:
    return float(np.mean(np.argmax(y, -1) == labels))


# --- 2-3. a PyTorch-style state dict, converted by qarray-serve convert


def executable(name: str) -> str:
    """A console script of this environment (beside the interpreter), or on PATH."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: install qarray (`make setup`)")
    return found


def convert(state_dict: Path, model: Path) -> list[float]:
    """Run `qarray-serve convert`, print its lines; each layer's weight error."""
    spec = ",".join(f"{n}:{a}" for n, a in zip(NAMES, ACTIVATIONS, strict=True))
    command = [executable("qarray-serve"), "convert", str(state_dict), str(model)]
    print(f"$ qarray-serve convert {state_dict.name} {model.name} --layers {spec}")
    result = subprocess.run(
        [*command, "--layers", spec], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"qarray-serve convert failed:\n{result.stderr}")
    for line in result.stdout.splitlines():
        print(f"  {line}")
    return [float(e) for e in re.findall(r"weight error (\S+)", result.stdout)]


# --- 4. the server: ours (started here, stopped by PID) or one given by --url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def own_server(model: Path, scratch: Path, timeout=180):
    """`qarray-serve serve` on a free loopback port with QARRAY_MODEL; yields
    (url, pid). The process is stopped by its PID when the block exits."""
    port = free_port()
    (scratch / "outputs").mkdir(exist_ok=True)
    env = {
        **os.environ,
        "QARRAY_MODEL": str(model),
        "TESSERACT_API_PATH": str(ROOT / "tesseract_api.py"),
        "TESSERACT_NAME": "qarray",
        "TESSERACT_OUTPUT_FORMAT": "json+base64",
        "TESSERACT_OUTPUT_PATH": str(scratch / "outputs"),
    }
    log_path = scratch / "server.log"
    command = [executable("qarray-serve"), "serve", "--host", "127.0.0.1"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*command, "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=scratch,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(
                    f"the server exited with {proc.returncode}:\n"
                    + log_path.read_text()[-3000:]
                )
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the server was not healthy after {timeout} s")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


def encode(array) -> dict:
    """An array in tesseract's base64 JSON encoding."""
    array = np.asarray(array, order="C")
    return {
        "object_type": "array",
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "data": {
            "buffer": base64.b64encode(array.tobytes()).decode(),
            "encoding": "base64",
        },
    }


def decode(obj):
    """Every array in a response (base64 or JSON lists) as NumPy, recursively."""
    if isinstance(obj, dict) and obj.get("object_type") == "array":
        data = obj["data"]
        if data["encoding"] == "base64":
            raw = np.frombuffer(base64.b64decode(data["buffer"]), obj["dtype"])
        else:
            raw = np.asarray(data["buffer"], obj["dtype"])
        return raw.reshape(obj["shape"])
    if isinstance(obj, dict):
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj


def encode_tree(value):
    """Every NumPy array in nested dicts and lists encoded."""
    if isinstance(value, dict):
        return {k: encode_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encode_tree(v) for v in value]
    return encode(value) if isinstance(value, np.ndarray) else value


def apply_body(x, layers=None) -> bytes:
    """The JSON body of an apply: only x (the resident model runs), or x and
    the layers to run."""
    inputs = {"x": x} if layers is None else {"x": x, "layers": layers}
    return json.dumps({"inputs": encode_tree(inputs)}).encode()


def post_apply(url, body: bytes) -> np.ndarray:
    response = requests.post(
        f"{url}/apply",
        data=body,
        headers={"Content-Type": "application/json"},
        timeout=120,
    )
    if response.status_code >= 400:
        raise SystemExit(f"apply refused ({response.status_code}): {response.text}")
    return decode(response.json())["y"]


def served_predict(url, x, batch) -> np.ndarray:
    """The served int8 network's logits, `batch` rows per request of only x."""
    return np.concatenate(
        [post_apply(url, apply_body(x[i : i + batch])) for i in range(0, len(x), batch)]
    )


# --- 6. saliency maps: d logit[predicted class] / d x


def saliency(logits_fn, x, classes):
    """Input gradients of each row's logit for its class. The rows of the
    network are independent, so the gradient of the sum is, row by row, each
    digit's own gradient: one batched call (one vector_jacobian_product
    request to the server) gives them all."""

    def picked(x):
        return jnp.take_along_axis(logits_fn(x), classes[:, None], axis=1).sum()

    return np.asarray(jax.jit(jax.grad(picked))(jnp.asarray(x)))


def cosine(a, b) -> np.ndarray:
    """Row-wise cosine similarity."""
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


# --- 7. the figure


def plot(path, acc_float, acc_int8, errors, images, labels, sal_f32, sal_int8, cos):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(images)
    fig = plt.figure(figsize=(3.2 + 1.35 * n, 4.4))
    grid = fig.add_gridspec(1, 2, width_ratios=(2.3, 1.35 * n), wspace=0.15)
    ax = fig.add_subplot(grid[0])
    bars = ax.bar(
        ["float32\n(plain JAX)", "int8\n(served,\nresident)"],
        [acc_float, acc_int8],
        color=["0.6", "tab:blue"],
        width=0.6,
    )
    ax.bar_label(bars, fmt="%.3f", padding=2)
    ax.set(ylim=(0, 1.08), ylabel="test accuracy", title="digits test accuracy")
    named = (f"{name} {e:.1e}" for name, e in zip(NAMES, errors, strict=True))
    ax.set_xlabel("int8 weight error\n" + ", ".join(named), fontsize=8)
    ax.grid(axis="y", alpha=0.3)

    cells = grid[1].subgridspec(3, n, hspace=0.08, wspace=0.08)
    rows = ("digit", "saliency\nfloat32", "saliency\nint8 served")
    for j in range(n):
        bound = np.abs(np.concatenate([sal_f32[j], sal_int8[j]])).max()
        for i, image in enumerate((images[j], sal_f32[j], sal_int8[j])):
            cell = fig.add_subplot(cells[i, j])
            if i == 0:
                cell.imshow(image.reshape(8, 8), cmap="gray_r", vmin=0, vmax=1)
                cell.set_title(f"label {labels[j]}\ncos {cos[j]:.5f}", fontsize=8)
            else:
                cell.imshow(image.reshape(8, 8), cmap="RdBu_r", vmin=-bound, vmax=bound)
            cell.set(xticks=[], yticks=[])
            if j == 0:
                cell.set_ylabel(rows[i], fontsize=8)
    fig.suptitle(
        "A digits MLP served resident as int8 (QARRAY_MODEL, requests carry only x): "
        "d logit[class] / d x through tesseract-jax",
        fontsize=9,
    )
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def request_layers(resident, params):
    """The same network as a request's ``layers``: the model file's int8
    weights (w_q), and the float32 ones (w, quantized by the server)."""
    as_w_q, as_w = [], []
    for name, layer, activation in zip(NAMES, resident, ACTIVATIONS, strict=True):
        common = {"layout": "nk", "activation": activation}
        w_q = {"qvalue": layer.qvalue, "scale": layer.scale}
        as_w_q.append({"w_q": w_q, "bias": layer.bias} | common)
        weight, bias = params[f"{name}.weight"], params[f"{name}.bias"]
        as_w.append({"w": weight, "bias": bias} | common)
    return as_w_q, as_w


def wire_bytes(url, x, as_w_q, as_w) -> dict:
    """Request bytes of one apply of x: only x (resident), with the int8
    layers, with the float32 layers. All three must give the same y."""
    bodies = {"x": apply_body(x), "w_q": apply_body(x, as_w_q)}
    bodies["w"] = apply_body(x, as_w)
    ys = {k: post_apply(url, body) for k, body in bodies.items()}
    same = max(float(np.abs(y - ys["x"]).max()) for y in ys.values())
    size = {k: len(body) for k, body in bodies.items()}
    print(
        f"wire bytes per apply of {len(x)} digit(s): only x (resident) "
        f"{size['x']:,}; with int8 w_q layers {size['w_q']:,} "
        f"({size['w_q'] / size['x']:.2f}x); with float32 w layers {size['w']:,} "
        f"({size['w'] / size['x']:.2f}x); same y: max |dy| {same:.1e}"
    )
    return size


@contextlib.contextmanager
def server(url, model, scratch):
    """(url, pid): the server given by --url (pid None), or one of ours."""
    if url:
        yield url.rstrip("/"), None
        return
    with own_server(model, scratch) as (url, pid):
        print(f"serving {model.name} resident at {url} (server pid {pid})")
        yield url, pid
    print(f"stopped the server (pid {pid})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url",
        help="a server with QARRAY_MODEL=DIR/model.safetensors (default: start one)",
    )
    parser.add_argument("--steps", type=int, default=600, help="Adam steps")
    parser.add_argument("--batch", type=int, default=128, help="rows per apply")
    parser.add_argument("--digits", type=int, default=6, help="saliency maps")
    parser.add_argument(
        "--workdir", help="where the state dict and model file go (default: temp)"
    )
    parser.add_argument("--plot", default=str(ROOT / "docs" / "resident_saliency.png"))
    args = parser.parse_args()
    start = time.perf_counter()
    x_train, x_test, y_train, y_test = load_data()
    print(
        f"digits: {len(x_train)} train / {len(x_test)} test images, network "
        f"{' -> '.join(map(str, WIDTHS))} ({', '.join(ACTIVATIONS)})"
    )

    with tempfile.TemporaryDirectory(prefix="resident-saliency-") as scratch:
        workdir = Path(args.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        state_dict = workdir / "state_dict.safetensors"
        model = workdir / "model.safetensors"

        # 1-2. train (or, against a given server, read back the weights its
        # model file was converted from) and save as PyTorch's state_dict()
        if args.url and state_dict.exists():
            params = load_file(str(state_dict))
            print(f"float32 weights read from {state_dict}")
        else:
            print(f"training float32 in plain JAX: Adam, {args.steps} steps")
            trained = train(x_train, y_train, args.steps)
            params = {name: np.asarray(value) for name, value in trained.items()}
            # what safetensors.torch.save_file(model.state_dict(), ...) writes
            save_file(params, str(state_dict), metadata={"format": "pt"})
            print(f"saved the state dict ({', '.join(params)}) to {state_dict}")
        y_float = np.asarray(logits(params, x_test))
        acc_float = accuracy(y_float, y_test)
        print(f"float32 test accuracy: {acc_float:.3f}")

        # 3. int8, one scale per output channel; the file's network in JAX
        errors = convert(state_dict, model)
        resident = load_model(model)
        int8_params = {}
        for name, layer in zip(NAMES, resident, strict=True):
            int8_params[f"{name}.weight"] = layer.qvalue * layer.scale[:, None]
            int8_params[f"{name}.bias"] = layer.bias

        # 4. served resident: every request below carries only x, except the
        # two that measure what sending the weights would cost
        with server(args.url, model, Path(scratch)) as (url, _):
            # 5. test accuracy, `batch` digits per request
            y_int8 = served_predict(url, x_test, args.batch)
            acc_int8 = accuracy(y_int8, y_test)
            agree = accuracy(y_int8, np.argmax(y_float, -1))
            local = np.asarray(logits(int8_params, x_test))
            drift = float(np.abs(y_int8 - local).max())
            print(
                f"served int8 test accuracy: {acc_int8:.3f} (float32 {acc_float:.3f});"
                f" same class as float32 on {agree:.1%} of the test digits; served y "
                f"vs the model file's int8 network in JAX: max |dy| {drift:.1e}"
            )
            if drift > 1e-3 * max(1.0, float(np.abs(local).max())):
                raise SystemExit(
                    f"the server at {url} does not serve {model}: start it with "
                    f"QARRAY_MODEL={model}"
                )
            layers = request_layers(resident, params)
            wire = {n: wire_bytes(url, x_test[:n], *layers) for n in (1, args.batch)}

            # 6. saliency through tesseract-jax, against the served model: one
            # test digit per class, gradient of the class the server predicts
            picks = np.array(
                [np.flatnonzero(y_test == c)[0] for c in range(min(args.digits, 10))]
            )
            x_pick = x_test[picks]
            classes = jnp.asarray(np.argmax(y_int8[picks], -1))
            tess = Tesseract.from_url(url)
            sal_int8 = saliency(
                lambda x: apply_tesseract(tess, {"x": x})["y"], x_pick, classes
            )
        sal_f32 = saliency(lambda x: logits(params, x), x_pick, classes)
        sal_local = saliency(lambda x: logits(int8_params, x), x_pick, classes)
        cos = cosine(sal_int8, sal_f32)
        exact = float(np.abs(sal_int8 - sal_local).max() / np.abs(sal_local).max())
        print(
            f"saliency of {len(picks)} test digits (labels "
            f"{', '.join(map(str, y_test[picks]))}; served int8 predicts "
            f"{', '.join(map(str, np.asarray(classes)))}): cosine similarity served "
            f"int8 vs float32 min {cos.min():.5f}, mean {cos.mean():.5f}; vs the "
            f"model file's int8 network in JAX: max relative diff {exact:.1e}"
        )

    # 7. the figure
    labels = y_test[picks]
    plot(args.plot, acc_float, acc_int8, errors, x_pick, labels, sal_f32, sal_int8, cos)
    print(f"plot saved to {args.plot}")
    batch = wire[args.batch]
    print(
        f"summary: test accuracy float32 {acc_float:.3f}, served int8 (resident) "
        f"{acc_int8:.3f}; weight error {', '.join(f'{e:.1e}' for e in errors)}; "
        f"wire bytes per apply of {args.batch} digits {batch['x']:,} (only x) vs "
        f"{batch['w_q']:,} (int8 weights sent), of 1 digit {wire[1]['x']:,} vs "
        f"{wire[1]['w_q']:,}; saliency cosine min {cos.min():.5f}; "
        f"{time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
