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


def run_tests(platform: str, seconds: float) -> dict:
    """tests/qarray on the device (one device: the 8-device sharding tests
    are left out), counted from pytest's verbose lines; where the time runs
    out first, what ran by then is counted and ``timed_out`` says so (each
    test compiles its own programs, which is slow on a GPU)."""
    env = {**os.environ, "QARRAY_TEST_PLATFORM": platform, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-p",
        "no:cacheprovider",
        "tests/qarray",
        "--ignore=tests/qarray/test_sharding.py",
    ]
    start = time.monotonic()
    timed_out = False
    try:
        result = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds
        )
        stdout, stderr, returncode = result.stdout, result.stderr, result.returncode
    except subprocess.TimeoutExpired as stopped:
        timed_out = True
        stdout = _text(stopped.stdout)
        stderr = _text(stopped.stderr)
        returncode = None
    outcomes = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", stdout, re.M)
    counts: dict[str, int] = {}
    for _, outcome in outcomes:
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    return {
        "returncode": returncode,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - start, 1),
        "counts": counts,
        "failures": [
            name for name, outcome in outcomes if outcome in ("FAILED", "ERROR")
        ][:50],
        "tail": stdout[-3000:] + stderr[-2000:],
    }


def _text(output: bytes | str | None) -> str:
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def run_rows(reps: int = 15) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT))
    import qarray as qa
    from benchmarks._timing import interleaved
    from qarray import _formulations

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
                else _formulations.choose_strategy(m, k, n, activations, platform, "nk")
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
    parser.add_argument(
        "--test-seconds",
        type=float,
        default=300.0,
        help="time for the library tests; what ran by then is counted",
    )
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
        # the rows first: they are short and are reported whatever the tests do
        "rows": run_rows(),
    }
    report["tests"] = run_tests(args.platform, args.test_seconds)
    report["seconds"] = round(time.monotonic() - started, 1)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "tests"}, indent=2))
    print(f"tests: {report['tests']['counts']} in {report['tests']['seconds']} s")
    print(f"wrote {args.out}")
    tests = report["tests"]
    return (
        0
        if tests["returncode"] == 0 or (tests["timed_out"] and not tests["failures"])
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
