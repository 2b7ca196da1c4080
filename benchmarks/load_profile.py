"""Where a served request's CPU goes, level by level: the profile behind
docs/performance-notes.md's serving-under-load table (issue 43).

    .venv/bin/python -m benchmarks.load_profile [--kind apply|vjp]
        [--clients 1,16,64] [--seconds 5] [--env NAME=VALUE ...]

Serves the `load` suite's model (4 relu layers 4096 wide, int8, resident;
``qarray-serve``, one worker), drives each level with ``wrk`` (one-row
requests over base64), and prints req/s, p50 and p99, the CPU each thread of
the server spent per request (``/proc/PID/task/*/stat`` before and after:
``qarray-serve`` is the event loop and the endpoint threads, ``XLAExecute``
a compiled call's thread, ``XLAEigen`` the pool qarray's kernels run on) and
the rows of each computed call (``GET /metrics``). Not a `make bench` suite:
ours alone, one run a level (the suite compares with stock dense).
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks import bench_load
from benchmarks.wrk import run_wrk
from support.server import serve, server_processes

WIDTH, DEPTH = 4096, 4


def thread_ticks(pids) -> dict[tuple, int]:
    """CPU ticks (user + system) of every thread of ``pids``."""
    ticks = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                name = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended
                continue
            ticks[pid, task.name, name] = int(fields[11]) + int(fields[12])
    return ticks


def _group(name: str) -> str:
    """XLA's threads by pool (``tf_XLAEigen``...), the rest by name."""
    return name.removeprefix("tf_").split("-")[0] if name.startswith("tf_") else name


def profile_level(url, pids, endpoint, bodies, clients, seconds) -> dict:
    for _ in range(bench_load.WARM_ROUNDS):  # until the batch sizes are compiled
        warm = run_wrk(url, f"/{endpoint}", bodies, clients, 2.0)
        if warm["p99_ms"] < bench_load.WARM_TAIL * warm["p50_ms"]:
            break
    before, rows_before = thread_ticks(pids), bench_load.batch_rows(url)
    stats = run_wrk(url, f"/{endpoint}", bodies, clients, seconds)
    after, rows_after = thread_ticks(pids), bench_load.batch_rows(url)
    requests = max(stats["rps"] * seconds, 1)
    us = Counter()
    for key, ticks in after.items():  # 100 ticks a second
        us[_group(key[2])] += (ticks - before.get(key, 0)) * 1e4 / requests
    return {
        **stats,
        "us_per_request": dict(us.most_common()),
        "batches": bench_load._histogram(rows_before, rows_after),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.load_profile")
    parser.add_argument("--kind", choices=("apply", "vjp"), default="apply")
    parser.add_argument("--clients", default="1,16,64")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for ours")
    args = parser.parse_args()
    endpoint = "apply" if args.kind == "apply" else "vector_jacobian_product"
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        model, _ = bench_load._model_files(tmp, DEPTH, WIDTH)
        env = {"QARRAY_MODEL": str(model), **dict(e.split("=", 1) for e in args.env)}
        with serve(Path(tempfile.mkdtemp(dir=tmp)), bench_load.OURS, env=env) as url:
            pids = [p.pid for p in server_processes(url)]
            for clients in (int(c) for c in args.clients.split(",")):
                bodies = [
                    bench_load._body(rng, args.kind, 1, WIDTH, WIDTH)
                    for _ in range(max(clients, 16))
                ]
                level = profile_level(
                    url, pids, endpoint, bodies, clients, args.seconds
                )
                cpu = ", ".join(
                    f"{k} {v:.0f}" for k, v in level["us_per_request"].items() if v > 20
                )
                batches = level["batches"] or {}
                print(
                    f"{args.kind} {clients:3d} clients: {level['rps']:.0f} req/s, "
                    f"p50 {level['p50_ms']:.1f} ms, p99 {level['p99_ms']:.1f} ms, "
                    f"non-2xx {level['non_2xx']}; us a request: {cpu}; "
                    f"rows a call {batches.get('mean_rows', 0):.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
