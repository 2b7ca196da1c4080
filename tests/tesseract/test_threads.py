"""WorkerThreads: the event loop's computational calls on at most `size`
threads (qarray/tesseract/_threads.py)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

from qarray.tesseract import _threads
from qarray.tesseract._threads import WorkerThreads


def test_calls_run_on_threads_and_answer_in_the_loop():
    workers = WorkerThreads(4)
    loop_thread = []

    async def main():
        loop_thread.append(threading.get_ident())
        return await asyncio.gather(
            *(
                workers.run(lambda i=i: (i * i, threading.get_ident()))
                for i in range(10)
            )
        )

    answers = asyncio.run(main())
    assert [a for a, _ in answers] == [i * i for i in range(10)]
    assert loop_thread[0] not in {t for _, t in answers}


def test_an_exception_reaches_the_caller():
    workers = WorkerThreads(2)

    def fail():
        raise KeyError("bad")

    async def main():
        with pytest.raises(KeyError, match="bad"):
            await workers.run(fail)
        return await workers.run(lambda: "after")  # the thread still serves

    assert asyncio.run(main()) == "after"


def test_at_most_size_calls_at_once_the_rest_wait_in_order():
    workers = WorkerThreads(3)
    lock = threading.Lock()
    running, most, started = [0], [0], []
    gate = threading.Event()

    def call(i):
        with lock:
            started.append(i)
            running[0] += 1
            most[0] = max(most[0], running[0])
        gate.wait(30)
        with lock:
            running[0] -= 1
        return i

    async def main():
        tasks = [
            asyncio.ensure_future(workers.run(lambda i=i: call(i))) for i in range(8)
        ]
        deadline = time.monotonic() + 30
        while len(started) < 3:  # the first three hold the threads
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert len(started) == 3 and workers.threads == 3
        gate.set()
        return await asyncio.gather(*tasks)

    assert asyncio.run(main()) == list(range(8))
    assert most[0] == 3
    assert sorted(started[:3]) == [0, 1, 2] and started[3:] == [3, 4, 5, 6, 7]


def test_threads_start_as_needed_and_retire_when_idle(monkeypatch):
    monkeypatch.setattr(_threads, "IDLE_S", 0.05)
    workers = WorkerThreads(8)

    async def main():
        for _ in range(5):  # one call at a time needs one thread
            await workers.run(lambda: None)
        return workers.threads

    assert asyncio.run(main()) == 1
    deadline = time.monotonic() + 30
    while workers.threads:
        assert time.monotonic() < deadline, "the idle thread never ended"
        time.sleep(0.01)
    # and a call after that starts one again
    assert asyncio.run(_one(workers)) == "again"


async def _one(workers):
    return await workers.run(lambda: "again")


def test_calls_see_the_callers_context():
    var = contextvars.ContextVar("var", default="unset")
    workers = WorkerThreads(1)

    async def main():
        var.set("the request's")
        return await workers.run(var.get)

    assert asyncio.run(main()) == "the request's"


def test_a_size_below_one_is_refused():
    with pytest.raises(ValueError, match="size >= 1"):
        WorkerThreads(0)


def test_answers_ready_together_reach_the_loop_in_one_wake_up():
    """Answers that come while the loop has not yet taken the earlier ones
    are handed back with them: one call_soon_threadsafe (a write to the
    loop's self-pipe), not one per answer."""
    workers = WorkerThreads(8)
    gate, done = threading.Event(), []

    def call(i):
        gate.wait(30)
        done.append(i)
        return i

    async def main():
        loop = asyncio.get_running_loop()
        wakes = []
        upstream = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), upstream(*a))[1]
        tasks = [
            asyncio.ensure_future(workers.run(lambda i=i: call(i))) for i in range(8)
        ]
        await asyncio.sleep(0.1)  # every call on its thread, at the gate
        gate.set()
        deadline = time.monotonic() + 30
        while len(done) < 8:  # the loop held: no answer is taken meanwhile
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)  # the last answer queued for the loop
        answers = await asyncio.gather(*tasks)
        # one more round: the hand-back above emptied, a new one starts
        answers.append(await workers.run(lambda: "again"))
        return answers, len(wakes)

    answers, wakes = asyncio.run(main())
    assert answers == [*range(8), "again"]
    assert wakes == 2, wakes
