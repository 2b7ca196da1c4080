"""apply over HTTP: qarray's Tesseract vs a trivial one, served the same way."""

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import requests

from support.server import ROOT, b64, serve


def _median_latency(session, url, payload, reps):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        response = session.post(f"{url}/apply", json=payload, timeout=60)
        times.append(time.perf_counter() - start)
        response.raise_for_status()
    return statistics.median(times)


def run(reps=200):
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "ours").mkdir()
        (tmp / "trivial").mkdir()
        with (
            serve(tmp / "ours") as ours,
            serve(
                tmp / "trivial", api_path=ROOT / "benchmarks/trivial_api.py"
            ) as floor,
        ):
            session = requests.Session()
            rng = np.random.default_rng(0)
            for label, (m, k, n), target in (
                ("tiny payload", (1, 4, 4), 1.3),
                ("256 x 256 payload", (256, 256, 256), None),
            ):
                x = rng.standard_normal((m, k)).astype(np.float32)
                w = rng.standard_normal((k, n)).astype(np.float32)
                ours_payload = {"inputs": {"x": b64(x), "layers": [{"w": b64(w)}]}}
                floor_payload = ours_payload
                for _ in range(20):  # warm-up: compile, connections
                    session.post(f"{ours}/apply", json=ours_payload, timeout=60)
                    session.post(f"{floor}/apply", json=floor_payload, timeout=60)
                t_ours, t_floor = [], []
                for _ in range(5):  # interleaved blocks
                    t_ours.append(
                        _median_latency(session, ours, ours_payload, reps // 5)
                    )
                    t_floor.append(
                        _median_latency(session, floor, floor_payload, reps // 5)
                    )
                ours_s, floor_s = statistics.median(t_ours), statistics.median(t_floor)
                rows.append(
                    {
                        "row": f"HTTP apply latency, {label} (base64)",
                        "shape": (m, k, n),
                        "baseline": "trivial Tesseract (same request, returns x), "
                        "served the same way",
                        "ratio": ours_s / floor_s,
                        "target": target,
                        "unit": "x the floor's latency (lower is better)",
                        "lower_is_better": True,
                        "ms": 1e3 * ours_s,
                        "baseline_ms": 1e3 * floor_s,
                    }
                )
    return rows
