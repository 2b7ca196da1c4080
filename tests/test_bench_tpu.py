"""benchmarks/bench_tpu.py on small shapes: every product row runs on this
backend (int4 x int4 on a TPU only) and reports finite ratios; the chip's
figures are what the benchmark measures there, not asserted here.

Covers: benchmarks/bench_tpu.py"""

import json
import math

import jax

from benchmarks import bench_tpu


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
