"""LoRA (suite ``lora``): a QLoRA training step over HTTP against the
full-weight QAT step on the same network and transport, and the memory of
training adapters in-process.

- Over HTTP (qarray-serve on loopback, base64 JSON, through tesseract-jax's
  ``apply_tesseract`` in a ``jax.jit(jax.value_and_grad)`` step, an Adam
  update between steps so that every request is new): a 3 x (1024, 1024)
  relu network, 128 rows. The baseline is the README's QAT loop, the float32
  weights and biases in every request (apply, then the VJP with respect to
  each of them); ours, the same network resident int8 (``QARRAY_MODEL``) and
  a request of x and rank-8 adapters (the VJP with respect to ``lora.[i].a``
  and ``.b``). Rows: wire bytes per step (requests and responses as sent,
  counted by the HTTP session) and ms per step, ours / the baseline's.
- In-process: ``eqx.filter_grad`` over the rank-8 adapters of a quantized
  4 x (4096, 4096) MLP (int8 and int4), 16 rows: the compiled step's
  arguments plus temporaries against the quantized model's and the
  adapters' bytes (no float copy of the frozen weights: a float32 copy of
  one layer alone would add 64 MiB).
"""

from __future__ import annotations

import json
import tempfile
from contextlib import ExitStack
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks._timing import interleaved
from benchmarks.bench_e2e import network
from support.server import ROOT, b64, serve

SHAPE = (128, 1024, 1024)
DEPTH = 3
RANK = 8


class _Counted:
    """A requests.Session that adds up the bytes of every body it sends and
    receives (what tesseract-jax's client puts on the wire)."""

    def __init__(self, session):
        self.session, self.sent, self.received = session, 0, 0

    def __getattr__(self, name):
        return getattr(self.session, name)

    def request(self, method, url, **kwargs):
        body = kwargs.get("data") or kwargs.get("json")
        if isinstance(body, str | bytes):
            self.sent += len(body)
        response = self.session.request(method, url, **kwargs)
        self.received += len(response.content)
        return response

    def post(self, url, **kwargs):
        return self.request("POST", url, **kwargs)


def _tesseract(url):
    from tesseract_core import Tesseract

    return Tesseract.from_url(url)


def _loop(tess, params, request_of, x, target):
    """A training step closure: value_and_grad through apply_tesseract, then
    Adam on ``params`` (new arrays, so a new request, every step)."""
    from tesseract_jax import apply_tesseract

    def loss(params, x, target):
        y = apply_tesseract(tess, request_of(params, x))["y"]
        return jnp.mean((y - target) ** 2)

    step = jax.jit(jax.value_and_grad(loss))
    optimizer = optax.adam(1e-4)
    state = {"params": params, "opt": optimizer.init(params)}
    x, target = jnp.asarray(x), jnp.asarray(target)

    def one():
        _, grads = step(state["params"], x, target)
        updates, state["opt"] = optimizer.update(grads, state["opt"])
        state["params"] = optax.apply_updates(state["params"], updates)

    return one


def _client_session(tess):
    """The requests.Session of a Tesseract.from_url client, counted (the
    client's private session: no public hook sees the bodies it sends)."""
    import requests

    client = getattr(tess, "_client", None)
    if not isinstance(getattr(client, "_session", None), requests.Session):
        raise RuntimeError(
            "tesseract_core's HTTP client no longer keeps a requests.Session in "
            "_session: bench_lora counts wire bytes there"
        )
    counted = _Counted(client._session)
    client._session = counted
    return counted


def http_rows(reps=11):
    from qarray.checkpoint import save_model

    rng = np.random.default_rng(0)
    x, layers = network(rng, SHAPE, DEPTH, "relu", layout="nk")
    target = rng.standard_normal((SHAPE[0], SHAPE[2])).astype(np.float32)
    static = [{"layout": "nk", "activation": layer["activation"]} for layer in layers]
    weights = [
        {"w": jnp.asarray(layer["w"]), "bias": jnp.asarray(layer["bias"])}
        for layer in layers
    ]
    k = SHAPE[1]
    adapters = [
        {
            "a": jnp.asarray(rng.uniform(-1, 1, (RANK, k)) / np.sqrt(k), jnp.float32),
            "b": jnp.zeros((SHAPE[2], RANK), jnp.float32),
        }
        for _ in range(DEPTH)
    ]
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        tmp = Path(tmp)
        save_model(tmp / "resident.safetensors", layers)  # int8 at load
        urls = {}
        for name, env in (
            ("qat", {}),
            ("qlora", {"QARRAY_MODEL": str(tmp / "resident.safetensors")}),
        ):
            (tmp / name).mkdir()
            urls[name] = stack.enter_context(
                serve(tmp / name, ROOT / "tesseract_api.py", env=env)
            )
        tess = {name: stack.enter_context(_tesseract(u)) for name, u in urls.items()}
        steps = {
            "qat": _loop(
                tess["qat"],
                weights,
                lambda p, x: {
                    "x": x,
                    "layers": [{**w, **s} for w, s in zip(p, static, strict=True)],
                },
                x,
                target,
            ),
            "qlora": _loop(
                tess["qlora"], adapters, lambda p, x: {"x": x, "lora": p}, x, target
            ),
        }
        sessions = {name: _client_session(t) for name, t in tess.items()}
        for name, step in steps.items():  # one step each, its bytes counted
            step()
            sessions[name].sent = sessions[name].received = 0
            step()
        wire = {n: s.sent + s.received for n, s in sessions.items()}
        times = interleaved(steps, reps)
    shape = (SHAPE[0], SHAPE[1], SHAPE[2])
    what = f"{DEPTH} x ({SHAPE[1]}, {SHAPE[2]}) relu, {SHAPE[0]} rows, rank {RANK}"
    baseline = (
        "the QAT step with the float32 weights in the request (apply + VJP "
        "w.r.t. every w and bias), same server and transport"
    )
    return [
        {
            "row": f"QLoRA step over HTTP, resident int8 ({what}): wire bytes",
            "shape": shape,
            "baseline": baseline,
            "ratio": wire["qlora"] / wire["qat"],
            "target": 0.05,
            "unit": "x the full-weight step's bytes (lower is better)",
            "lower_is_better": True,
            "bytes": wire["qlora"],
            "baseline_bytes": wire["qat"],
            # x in both requests, the cotangent of y and y itself: the same
            # in both steps, and alone over 5% of the full-weight step here
            "data_bytes": 4 * len(json.dumps(b64(x))),
        },
        {
            "row": f"QLoRA step over HTTP, resident int8 ({what}): time",
            "shape": shape,
            "baseline": baseline,
            "ratio": times["qlora"] / times["qat"],
            "target": 0.5,
            "unit": "x the full-weight step's time (lower is better)",
            "lower_is_better": True,
            "ms": 1e3 * times["qlora"],
            "baseline_ms": 1e3 * times["qat"],
        },
    ]


def _array_bytes(tree) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def memory_rows(width=4096, depth=4, rows=16):
    import qarray.nn as qnn

    keys = jax.random.split(jax.random.key(0), depth)
    mlp = eqx.nn.Sequential(
        [eqx.nn.Linear(width, width, key=k) for k in keys]
    )  # float32 init: quantized below, the float copy dropped
    x = jax.random.normal(jax.random.key(1), (rows, width))
    out = []
    for precision, group in (("int8", None), ("int4", 128)):
        base = qnn.quantize(mlp, precision=precision, group_size=group)
        adapted = qnn.lora(base, RANK, key=jax.random.key(2))
        params, frozen = eqx.partition(adapted, qnn.lora_spec(adapted))

        def loss(params, frozen, x):
            model = eqx.combine(params, frozen)
            return jnp.mean(jax.vmap(model)(x) ** 2)

        compiled = jax.jit(jax.grad(loss)).lower(params, frozen, x).compile()
        memory = compiled.memory_analysis()
        used = memory.argument_size_in_bytes + memory.temp_size_in_bytes
        model_bytes = _array_bytes(adapted)
        out.append(
            {
                "row": f"QLoRA in-process: grad over rank-{RANK} adapters of "
                f"{depth} x ({width}, {width}) {precision}, arguments + temporaries",
                "shape": (rows, width, width),
                "baseline": "the quantized model's and the adapters' bytes "
                f"({model_bytes / 2**20:.1f} MiB; float32 weights "
                f"{depth * width * width * 4 / 2**20:.0f} MiB)",
                "ratio": used / (model_bytes + x.nbytes),
                "target": 1.05,
                "unit": "x the model's bytes (lower is better)",
                "lower_is_better": True,
                "bytes": used,
                "temp_bytes": memory.temp_size_in_bytes,
            }
        )
    return out


def run(reps=11):
    return [*http_rows(reps), *memory_rows()]


if __name__ == "__main__":
    for row in run():
        print(f"{row['row']:<100} {row['ratio']:8.4f}  {row['unit']}")
