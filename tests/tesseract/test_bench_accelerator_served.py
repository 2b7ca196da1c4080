"""benchmarks/bench_accelerator_served.py runs (its --quick sizes, on the CPU)
and reports what the TPU run is read for: the device, the apply rows against
dense, and a VJP row whose hits and misses the residual cache counted."""

import json
import os
import subprocess
import sys

from support.server import ROOT


def test_the_quick_run_reports_every_row(tmp_path):
    out = tmp_path / "served.json"
    # on the CPU: under QARRAY_TEST_PLATFORM=tpu this process holds the chip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    command = [sys.executable, "-m", "benchmarks.bench_accelerator_served"]
    sizes = ["--quick", "--width", "64", "--rows", "1,8", "--reps", "3"]
    result = subprocess.run(
        [*command, *sizes, "--out", str(out)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["platform"], report["device"]) == ("cpu", "cpu:0")
    rows = report["rows"]
    assert [r["shape"] for r in rows] == [[1, 64, 64], [8, 64, 64]] + [[8, 64, 64]] * 2
    assert all(r["ratio"] > 0 and r["ms"] > 0 for r in rows)
    assert [r["target"] for r in rows] == [1.0, 1.0, 0.7, None]
    calls = report["reps"] + report["warmup"]
    assert rows[2]["cache_counts"] == {"hits": calls, "misses": calls}
    assert all(r["y_error_vs_dense"] < 0.05 for r in rows[:2])  # int8 weights
    assert "| ratio |" in result.stdout
