"""What handing a request to a worker thread and its answer back costs: the
round trip every computational request makes in ``qarray-serve``
(``qarray/tesseract/_threads.py``), against the one it replaced.

    .venv/bin/python -m benchmarks.bench_handoff [--calls 5000] [--rounds 3]

Times ``await run(f)`` of a function that does nothing, from 1 and from 16
concurrent tasks on one event loop, interleaved round by round: ours
(``WorkerThreads``) and anyio's ``to_thread.run_sync`` with a
``CapacityLimiter`` (what ``ComputeRoutes`` used before). Prints wall and
CPU microseconds a call (medians of the rounds) and their ratio. Not a
`make bench` suite: the served effect is in ``benchmarks.load_profile``'s
per-thread CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import anyio
import anyio.to_thread

from qarray.tesseract._threads import WorkerThreads

THREADS = 64  # as ComputeRoutes sizes them for a batched model


def _nothing():
    return None


async def _anyio(calls: int, concurrent: int) -> None:
    limiter = anyio.CapacityLimiter(THREADS)

    async def task():
        for _ in range(calls // concurrent):
            await anyio.to_thread.run_sync(_nothing, limiter=limiter)

    await asyncio.gather(*(task() for _ in range(concurrent)))


def _ours(workers: WorkerThreads):
    async def run(calls: int, concurrent: int) -> None:
        async def task():
            for _ in range(calls // concurrent):
                await workers.run(_nothing)

        await asyncio.gather(*(task() for _ in range(concurrent)))

    return run


def measure(run, calls: int, concurrent: int) -> tuple[float, float]:
    """(wall, CPU) microseconds a call."""
    wall, cpu = time.perf_counter(), time.process_time()
    asyncio.run(run(calls, concurrent))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall / calls * 1e6, cpu / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.bench_handoff")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ways = {"anyio": _anyio, "ours": _ours(WorkerThreads(THREADS))}
    for concurrent in (1, 16):
        got = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, run in ways.items():
                got[name].append(measure(run, args.calls, concurrent))
        med = {
            name: tuple(statistics.median(v[i] for v in rows) for i in range(2))
            for name, rows in got.items()
        }
        (wall_a, cpu_a), (wall_o, cpu_o) = med["anyio"], med["ours"]
        print(
            f"{concurrent:2d} concurrent: anyio {wall_a:.1f} us wall / {cpu_a:.1f} us "
            f"CPU a call, ours {wall_o:.1f} / {cpu_o:.1f}; ours / anyio CPU "
            f"{cpu_o / cpu_a:.2f}x"
        )


if __name__ == "__main__":
    main()
