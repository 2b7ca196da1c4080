"""What a user would pick instead: torchao's int8 nn.Linear, eager and under
torch.compile, timed like ours (`make bench-peers`; its own venv, since
torch's PyPI wheel brings its CUDA libraries even for CPU use).

    .venv-peers/bin/python benchmarks/bench_peers.py --out benchmarks/peers.json

Same shapes, same data (NumPy's generator seeded as in compare_peers.py), the
same thread count as XLA's pool (the CPU count). Weights hot (the same call
repeated) and cold (a buffer of twice the last-level cache read between
calls, outside the timed region: the weights come from memory, as in a
many-layer model). Prints nothing but progress; compare_peers.py prints the
table next to ours. Imports no jax.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peer_shapes import SHAPES, flush_buffer, inputs  # noqa: E402


def timed(fn, reps: int, flush=None) -> float:
    """Median seconds of ``fn()``; ``flush()`` runs untimed before each."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "peers.json"))
    parser.add_argument("--reps", type=int, default=21)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    import torchao
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        quantize_,
    )

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    buffer = torch.from_numpy(flush_buffer())

    def flush():
        buffer.sum()

    w8a8 = Int8DynamicActivationInt8WeightConfig
    configs = {
        "torchao int8 weight-only": Int8WeightOnlyConfig,
        "torchao int8 dynamic activations (W8A8)": w8a8,
    }
    rows = []
    for m, k, n in SHAPES:
        x_np, w_np = inputs(m, k, n)
        x = torch.from_numpy(x_np)
        for name, config in configs.items():
            linear = torch.nn.Linear(k, n, bias=False)
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(w_np))
            quantize_(linear, config())
            compiled = torch.compile(linear)
            for mode, module in (("eager", linear), ("torch.compile", compiled)):
                with torch.inference_mode():
                    call = lambda module=module, x=x: module(x)  # noqa: E731
                    hot = timed(call, args.reps)
                    cold = timed(call, args.reps, flush)
                us = f"{1e6 * hot:.0f} / {1e6 * cold:.0f} us"
                print(f"{name} {mode} {(m, k, n)}: {us}", flush=True)
                rows.append(
                    {
                        "peer": f"{name}, {mode}",
                        "shape": [m, k, n],
                        "hot_us": 1e6 * hot,
                        "cold_us": 1e6 * cold,
                    }
                )
    report = {
        "torch": torch.__version__,
        "torchao": torchao.__version__,
        "threads": threads,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
