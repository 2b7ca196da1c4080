"""The batcher's tests' jobs and threads (tests/tesseract/test_batching.py,
test_batch_forming.py): jobs whose answers say how they were computed, run
on threads of their own."""

from __future__ import annotations

import threading
import time

from qarray.tesseract._batcher import Job


def jobs_recording(batcher, count, key="k", rows=1):
    calls = []

    def job(i):
        return Job(
            key,
            rows,
            alone=lambda: calls.append(("alone", i)) or ("alone", i),
            together=lambda jobs: (
                calls.append(("together", [j.payload for j in jobs]))
                or [("together", j.payload) for j in jobs]
            ),
            payload=i,
        )

    return [job(i) for i in range(count)], calls


def run_all(batcher, jobs):
    results = [None] * len(jobs)

    def go(i):
        results[i] = batcher.run(jobs[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    return threads, results


def busy(batcher):
    """A computation holding the batcher's only slot until released."""
    release, started = threading.Event(), threading.Event()

    def hold():
        started.set()
        release.wait(30)

    thread = threading.Thread(target=batcher.call, args=(hold,))
    thread.start()
    assert started.wait(30)
    return release, thread


def run_queued(batcher, jobs):
    """``jobs`` queued while the batcher's slot is held, then released:
    their results, once every thread is done."""
    release, holder = busy(batcher)
    threads, results = run_all(batcher, jobs)
    wait_queued(batcher, len(jobs))
    release.set()
    for t in [holder, *threads]:
        t.join(30)
    return results


def wait_forming(batcher):
    """Until a leader waits for more rows (``Batcher._take``)."""
    deadline = time.monotonic() + 30
    while not batcher._forming:
        assert time.monotonic() < deadline, "no batch formed"
        time.sleep(0.001)


def wait_queued(batcher, count):
    deadline = time.monotonic() + 30
    while len(batcher._queue) < count:
        assert time.monotonic() < deadline, "jobs never queued"
        time.sleep(0.001)
