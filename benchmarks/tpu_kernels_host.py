"""``benchmarks.tpu_kernels`` with whatever JAX the host has, where the
host's libtpu is older than qarray's JAX.

A TPU host's own libtpu refuses the Mosaic modules a newer JAX writes
(``Failed to parse the Mosaic module: unknown attribute code``), so Pallas
kernels built by qarray's pinned JAX do not compile there, while the host's
own (older) JAX and libtpu compile the same kernel source. qarray/_tpu and
qarray/_numerics need no hijax: this runs them under the host's JAX with
qarray's package root stubbed (its ``__init__`` imports the hijax types),
the weights quantized by ``_numerics`` as ``qa.quantize`` does.

    python3 -m benchmarks.tpu_kernels_host [tpu_kernels' arguments]

(the host's ``python3``, from the project's root). docs/accelerators.md says
which figures were measured this way.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stub_qarray() -> None:
    """``import qarray._tpu`` without running ``qarray/__init__``."""
    if "qarray" not in sys.modules:
        package = types.ModuleType("qarray")
        package.__path__ = [str(ROOT / "qarray")]
        sys.modules["qarray"] = package


def weights(k: int, n: int) -> dict:
    """bench_tpu's weights, quantized without the hijax types."""
    import jax.numpy as jnp
    import numpy as np

    from qarray import _numerics

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32) / np.sqrt(k)
    return {
        "bf16": w.astype(jnp.bfloat16),
        "f32": w,
        "q8": _numerics.quantize_rows(w),
        "q4": _numerics.quantize_groups(w, min(128, k)),
    }


def main(argv=None) -> dict:
    stub_qarray()
    from benchmarks import bench_tpu

    bench_tpu.weights = weights
    from benchmarks import tpu_kernels

    tpu_kernels.weights = weights
    return tpu_kernels.main(argv)


if __name__ == "__main__":
    main()
