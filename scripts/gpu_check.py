"""The GPU check (`make gpu-check`): qarray's library tests on the GPU and the
product rows on the device, in a few minutes, as a small JSON report.

    python scripts/gpu_check.py [--out gpu_check.json] [--platform gpu]

Needs a machine with an NVIDIA GPU and jax's CUDA plugin in this Python (the
lent machines carry jax 0.11.2); nothing is installed. Rows, ratios to
float32 on the device in one interleaved run: float32 x @ w (the baseline),
bf16 x @ w (float32 accumulation), qarray.linear_q weight-only (the dequantize
formulation XLA fuses on GPU) and W8A8 (int8 x int8 -> int32). ``--platform
cpu`` runs the same steps on the CPU (to check the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (512, 4096, 4096), (4096, 4096, 4096)]


def run_tests(platform: str) -> dict:
    """tests/qarray on the device (one device: the 8-device sharding tests
    are left out), counted from pytest's summary line."""
    env = {**os.environ, "QARRAY_TEST_PLATFORM": platform, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/qarray",
        "--ignore=tests/qarray/test_sharding.py",
    ]
    start = time.monotonic()
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=360
    )
    counts = {
        word: int(n)
        for n, word in re.findall(
            r"(\d+) (passed|failed|error|errors|skipped)", result.stdout
        )
    }
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", result.stdout, re.M)
    return {
        "returncode": result.returncode,
        "seconds": round(time.monotonic() - start, 1),
        "counts": counts,
        "failures": failures[:50],
        "tail": result.stdout[-3000:] + result.stderr[-2000:],
    }


def run_rows(reps: int = 15) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT))
    import qarray as qa
    from benchmarks._timing import interleaved
    from qarray import _kernels

    f32 = jax.jit(lambda x, w: x @ w.T)
    bf16 = jax.jit(
        lambda x, w: jax.lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
    )
    ours = jax.jit(
        lambda x, q, s, a: qa.linear_q(x, qa.pack(q, s), a), static_argnums=3
    )
    rows = []
    for m, k, n in SHAPES:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)  # (out, in)
        q, s = jax.block_until_ready(qa.unpack(qa.quantize(w)))
        wb, xb = w.astype(jnp.bfloat16), x.astype(jnp.bfloat16)
        times = interleaved(
            {
                "float32": lambda x=x, w=w: f32(x, w),
                "bf16": lambda xb=xb, wb=wb: bf16(xb, wb),
                "weight-only": lambda x=x, q=q, s=s: ours(x, q, s, "float32"),
                "W8A8": lambda x=x, q=q, s=s: ours(x, q, s, "int8"),
            },
            reps=reps,
        )
        platform = jax.default_backend()
        for name in ("bf16", "weight-only", "W8A8"):
            activations = "int8" if name == "W8A8" else "float32"
            strategy = (
                "bf16"
                if name == "bf16"
                else _kernels.choose_strategy(m, k, n, activations, platform, "nk")
            )
            rows.append(
                {
                    "row": f"{name} ({strategy})",
                    "shape": [m, k, n],
                    "ratio_to_float32": times["float32"] / times[name],
                    "ms": 1e3 * times[name],
                    "float32_ms": 1e3 * times["float32"],
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "gpu_check.json"))
    parser.add_argument("--platform", default="gpu", choices=("gpu", "cpu"))
    args = parser.parse_args()
    if args.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    backend = jax.default_backend()
    if args.platform == "gpu" and backend != "gpu":
        print(
            f"gpu-check: jax sees no GPU (backend {backend!r}, devices "
            f"{jax.devices()}): run it where jax's CUDA plugin and a GPU are",
            file=sys.stderr,
        )
        return 2
    started = time.monotonic()
    report = {
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "tests": run_tests(args.platform),
        "rows": run_rows(),
    }
    report["seconds"] = round(time.monotonic() - started, 1)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "tests"}, indent=2))
    print(f"tests: {report['tests']['counts']} in {report['tests']['seconds']} s")
    print(f"wrote {args.out}")
    return 0 if report["tests"]["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
