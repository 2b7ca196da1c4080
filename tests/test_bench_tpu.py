"""benchmarks/bench_tpu.py on small shapes: every product row runs on this
backend (int4 x int4 on a TPU only) and reports finite ratios; the chip's
figures are what the benchmark measures there, not asserted here.

Covers: benchmarks/bench_tpu.py, benchmarks/bench_tpu_conv.py,
benchmarks/tpu_kernels.py, benchmarks/tpu_kernels_host.py"""

import json
import math

import jax

from benchmarks import bench_tpu, bench_tpu_conv


def test_every_row_reports_its_time_and_ratios(tmp_path):
    out = tmp_path / "tpu.json"
    report = bench_tpu.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    names = set(bench_tpu.products(256, 256))
    if jax.default_backend() != "tpu":
        names -= set(bench_tpu.TPU_ONLY)
    assert [row["m"] for row in report["rows"]] == [1, 8]
    for row in report["rows"]:
        assert set(row["ms"]) == names
        assert row["vs_bf16"]["bf16"] == row["vs_f32"]["f32"] == 1.0
        for ratios in (row["vs_bf16"], row["vs_f32"]):
            assert all(math.isfinite(r) and r > 0 for r in ratios.values())


def test_every_conv_row_reports_its_time_and_ratios(tmp_path):
    out = tmp_path / "conv.json"
    report = bench_tpu_conv.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    (row,) = report["rows"]
    assert row["shape"] == [2, 16, [12, 12], [3, 3]]
    assert "errors" not in row, row["errors"]
    assert set(row["ms"]) == set(bench_tpu_conv.products((3, 3)))
    assert row["vs_f32"]["f32"] == row["vs_bf16"]["bf16"] == 1.0
    for ratios in (row["vs_f32"], row["vs_bf16"]):
        assert all(math.isfinite(r) and r > 0 for r in ratios.values())


def test_the_kernel_sweep_records_each_variant(tmp_path):
    """benchmarks.tpu_kernels through its host runner (qarray's package root
    stubbed, as under a host's older JAX), in a process of its own: every
    variant of a family reports its time and its error against float32, or
    the error that refused it; the read-only kernel (no product) its time."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "sweep.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.tpu_kernels_host",
        "--k",
        "256",
        "--n",
        "256",
        "--calls",
        "1",
        "--repeats",
        "1",
        "--only",
        "vjp,read",
        "--out",
        str(out),
    ]
    subprocess.run(
        command,
        check=True,
        cwd=Path(__file__).parents[1],
        timeout=600,
        capture_output=True,
    )
    report = json.loads(out.read_text())
    families = [entry["family"] for entry in report["variants"]]
    assert families == ["read"] + ["vjp"] * 9  # the blocks cut to 256: one read
    for entry in report["variants"]:
        assert "error" not in entry, entry
        assert math.isfinite(entry["vs_bf16"]) and entry["vs_bf16"] > 0
        if entry["family"] == "vjp":
            assert entry["rel_err"] < 2.0**-8


def test_the_int4_sweeps_run_each_variant_within_their_precision(tmp_path):
    """tpu_kernels' int4_pair and int4_vjp families (the bytes kernel on
    int8_pair, the tile kernel's y_bar @ W) at K = N = 256, in Pallas'
    interpreter off the chip: each row of each variant reports a time and an
    error against float32 within its precision (two int8 parts of x: ~3e-5;
    one bf16 pass over y_bar and the weights: 2**-7)."""
    from benchmarks import tpu_kernels

    out = tmp_path / "int4.json"
    sizes = ["--k", "256", "--n", "256", "--calls", "1", "--repeats", "1"]
    report = tpu_kernels.main(
        [*sizes, "--only", "int4_pair,int4_vjp", "--out", str(out)]
    )
    by_family = {}
    for entry in report["variants"]:
        assert "error" not in entry, entry
        assert math.isfinite(entry["vs_bf16"]) and entry["vs_bf16"] > 0
        by_family.setdefault(entry["family"], []).append(entry)
        limit = 1e-4 if entry["family"] == "int4" else 2.0**-7
        assert entry["rel_err"] < limit, entry
    rows = tpu_kernels.FEW + tpu_kernels.MIDDLE
    assert len(by_family["int4"]) == 4 * len(rows)
    assert len(by_family["int4_vjp"]) == 3 * len((*tpu_kernels.FEW, 512))
