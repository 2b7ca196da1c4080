"""Worker threads for the event loop's computational requests.

``WorkerThreads.run(fn)`` awaits ``fn()`` computed on one of at most
``size`` threads (started as calls need them, each retired after
``IDLE_S`` without work); calls beyond ``size`` wait their turn in order.
It does what ``anyio.to_thread.run_sync`` with a ``CapacityLimiter`` did for
``ComputeRoutes`` with less of Python's machinery a call: one C queue
(``queue.SimpleQueue``) to the threads and at most one
``call_soon_threadsafe`` back, where anyio took a capacity limiter, a
``queue.Queue`` (a Python ``Condition``) and an event per call. Under load
every request makes this round trip, on the same cores as its computation
(``python -m benchmarks.bench_handoff``; docs/performance-notes.md, ninth
pass). Answers that come while the loop has not yet taken the previous ones
go with them: one wake-up of the loop for a batch's sixteen answers, not
sixteen (each a write to its self-pipe and a turn of the loop, between
threads taking the GIL in turn; tenth pass).

``fn`` runs in a copy of the caller's ``contextvars`` context, as anyio ran
it. A caller cancelled while its call runs stops waiting; the thread finishes
the call and its answer is dropped.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any

# a thread with nothing to do for this long ends (anyio's workers: 10 s)
IDLE_S = 10.0


class WorkerThreads:
    """At most ``size`` threads computing the calls of ``run`` (module doc)."""

    def __init__(self, size: int, name: str = "qarray-endpoint"):
        if size < 1:
            raise ValueError(f"WorkerThreads needs size >= 1, got {size}")
        self.size = size
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0  # started and not ended
        self._pending = 0  # calls queued or running
        # answers not yet handed to their loop, by loop; a loop is in it
        # while a hand-back of its answers is scheduled
        self._answers: dict[asyncio.AbstractEventLoop, list] = {}

    @property
    def threads(self) -> int:
        """Threads alive now (tests, metrics)."""
        return self._threads

    async def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()``'s result (its exception raised), computed on a thread."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._pending += 1
            start = self._pending > self._threads and self._threads < self.size
            if start:
                self._threads += 1
        if start:
            threading.Thread(target=self._work, name=self.name, daemon=True).start()
        self._calls.put((loop, future, contextvars.copy_context(), fn))
        return await future

    def _work(self) -> None:
        while True:
            try:
                call = self._calls.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    # every call queued has a thread to take it: this one ends
                    if self._pending < self._threads:
                        self._threads -= 1
                        return
                continue
            loop, future, context, fn = call
            del call
            try:
                result, error = context.run(fn), None
            except BaseException as raised:  # given to the caller, as anyio did
                result, error = None, raised
            with self._lock:
                self._pending -= 1
                waiting = self._answers.get(loop)
                if waiting is None:  # no hand-back scheduled: this one's
                    self._answers[loop] = [(future, result, error)]
                else:
                    waiting.append((future, result, error))
            if waiting is None:
                try:
                    loop.call_soon_threadsafe(self._hand_back, loop)
                except RuntimeError:  # the loop closed while it ran: nobody waits
                    with self._lock:
                        self._answers.pop(loop, None)
            del loop, future, context, fn, result, error, waiting

    def _hand_back(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: every answer for it so far to its caller."""
        with self._lock:
            answers = self._answers.pop(loop, ())
        for future, result, error in answers:
            if future.cancelled():  # its caller stopped waiting
                continue
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
