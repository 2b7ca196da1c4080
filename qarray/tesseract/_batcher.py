"""Dynamic batching: concurrent jobs on a resident model computed together.

A Tesseract's endpoint functions run on worker threads (``qarray-serve``
calls them off the event loop). Each turns its request into a ``Job`` and
calls ``Batcher.run(job)``, which blocks that thread until the job's answer
is there. Whichever waiting thread finds a free compute slot leads: it takes
the oldest queued job and every queued job with the same ``key`` (same
endpoint, same trailing shapes, same requested paths) up to ``max_rows``
rows, computes them in one call and hands each its answer (leader and
followers: a request alone on an idle server computes on its own thread,
with no hand-off and no wait). At most ``max_running`` batches compute at
once: the concurrency bound counts batches, not requests. A merged call that
fails falls back to each job alone, so one request never fails another.
What a job computes, alone or merged, is its maker's (``_row_merging``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


class Wake:
    """A wake-up for the one thread that waits on it: ``threading.Event``'s
    ``set``, ``wait`` and ``clear``, on a bare lock held while unset. An
    Event is a Condition, which makes, queues and notifies a lock for every
    wait: a part of each answer's hand-back under load. ``set`` and
    ``clear`` run under the batcher's lock; ``wait`` and ``clear`` on the
    waiting thread alone."""

    def __init__(self):
        self._unset = threading.Lock()
        self._unset.acquire()
        self._is_set = False

    def set(self) -> None:
        if not self._is_set:
            self._is_set = True
            self._unset.release()

    def wait(self) -> None:
        """Until ``set`` (at once when it was); it stays set."""
        self._unset.acquire()
        self._unset.release()

    def clear(self) -> None:
        if self._is_set:
            self._unset.acquire()  # free since set: does not block
            self._is_set = False


@dataclass(eq=False)
class Job:
    """One request's work: ``alone()`` computes its answer by itself;
    ``together(jobs)`` the answers of several jobs of the same ``key`` in one
    call (``key`` None: never merged)."""

    key: Hashable | None
    rows: int
    alone: Callable[[], Any]
    together: Callable[[list[Job]], list] | None = None
    payload: Any = None  # what ``together`` reads of this job
    done: bool = field(default=False, init=False)
    result: Any = field(default=None, init=False)
    error: BaseException | None = field(default=None, init=False)
    # set (under the batcher's lock) when the job is done or its thread is
    # to lead the next batch: a wake-up for this thread alone
    wake: Wake = field(default_factory=Wake, init=False)
    leads: bool = field(default=False, init=False)


class Arrival:
    """A request ``Batcher.expect`` counts until it queues its job."""

    __slots__ = ("open",)

    def __init__(self):
        self.open = True


# the longest a leader waits for the next of the requests the server is
# still reading or validating (``Batcher.expect``), or of the clients the last
# batch answered: their rows join its batch rather than the next, and the
# product of the bigger batch costs less a row (``make bench``, suite load:
# the rows a call at 16 clients); a lone client is never expected while a
# batch forms, so it never waits
ARRIVING_WAIT_S = 0.005
# the longest a batch forms while its requests keep arriving (each arrival
# restarts the wait above): 16 clients coming back one after another take
# longer than one ARRIVING_WAIT_S to be read and validated, and a batch that
# stopped at the first gap computed two-thirds of them
# (docs/performance-notes.md, ninth pass). Also how long after a batch its
# clients count as returning: after an idle spell nobody waits for them
FORMING_LIMIT_S = 0.02


class Batcher:
    """Runs jobs, merging those queued together (module doc).

    ``max_rows``: rows of one merged call at most (1: every job alone);
    ``wait_ms``: how long a leader waits for more rows before computing
    (0: it takes what queued while the previous batch computed);
    ``max_running``: batches computing at once; ``context()``: a context
    manager every computation runs in (e.g. ``jax.set_mesh(mesh)``, which
    holds for the thread that sets it only); ``arriving_wait_s``: how long
    a leader waits for the next request still arriving (``expect``) or
    returning (a client the last batch answered); ``forming_limit_s``: how
    long a batch forms at most while they keep coming, and how long after a
    batch its clients count as returning.

    Each waiting thread sleeps on its own job's ``Wake``: a finished batch wakes
    the threads of its jobs and, when a compute slot is free, the thread of
    the oldest queued job to lead the next one; nothing wakes every waiter
    (64 clients would make every batch wake 64 threads, each taking the GIL
    in turn: a serial cost per batch that grew with the clients).
    """

    def __init__(
        self,
        max_rows: int,
        wait_ms: float = 0.0,
        max_running: int = 1,
        context: Callable[[], Any] = contextlib.nullcontext,
        arriving_wait_s: float = ARRIVING_WAIT_S,
        forming_limit_s: float = FORMING_LIMIT_S,
    ):
        self.max_rows = max_rows
        self.wait_s = wait_ms / 1000
        self.arriving_wait_s = arriving_wait_s
        self.forming_limit_s = forming_limit_s
        self.max_running = max_running
        self.context = context
        # the lock of the queue and the counts; a leader waiting out wait_ms
        # waits on it for arrivals
        self._cond = threading.Condition()
        self._queue: list[Job] = []
        self._running = 0  # batches computing, and leaders chosen to compute
        self._forming = False  # a leader is waiting for more rows
        # requests the server has read and validated, not yet queued
        # (``expect`` / ``arriving``): a leader waits for them, briefly
        self._arriving = 0
        # requests the last batch answered whose next requests have not come
        # yet: under load their clients send again while the next batch
        # forms, and a leader waits for them too rather than compute part of
        # the clients' rows, then the rest; until _returning_until (the
        # batch's end + forming_limit_s)
        self._returning = 0
        self._returning_until = 0.0
        self._mine = threading.local()  # .arrival: the request this thread serves
        # merged calls so far, the jobs they answered, and merged calls that
        # failed and fell back to each job alone (tests, benchmarks)
        self.batches = self.merged_jobs = self.fallbacks = 0
        # computed calls by their rows (a merged batch, or a job alone):
        # what GET /metrics reports as a histogram
        self.rows_seen: Counter[int] = Counter()

    def run(self, job: Job) -> Any:
        """``job``'s answer (its exception raised), once a batch computed it."""
        with self._cond:
            arrival = getattr(self._mine, "arrival", None)
            if arrival is None:  # not expected (in-process): it returned now
                self._returning = max(self._returning - 1, 0)
            self._close(arrival)
            self._queue.append(job)
            if self._forming:
                self._cond.notify_all()  # only a forming leader waits on it
            lead = self._running < self.max_running and not self._forming
            if lead:
                self._running += 1
        while True:
            if lead:
                self._lead()
            with self._cond:
                if not job.done and not job.leads:
                    # its batch's leader or the next one's promotion sets it
                    self._cond.release()
                    try:
                        job.wake.wait()
                    finally:
                        self._cond.acquire()
                job.wake.clear()
                # a thread chosen to lead holds a reserved slot: it leads
                # (or hands the slot back) even when another batch answered it
                lead, job.leads = job.leads, False
                if job.done and not lead:
                    break
        if job.error is not None:
            raise job.error
        return job.result

    def expect(self) -> Arrival:
        """A request is read, validated and on its way to a worker thread
        (the server's event loop calls this): a leader about to compute
        waits for it up to ``arriving_wait_s`` (its rows join the batch
        instead of the next one). Its endpoint runs ``with
        arriving(arrival)``; ``settle`` (idempotent) ends the wait for a
        request that never gets there."""
        with self._cond:
            self._arriving += 1
            self._returning = max(self._returning - 1, 0)
        return Arrival()

    @contextlib.contextmanager
    def arriving(self, arrival: Arrival):
        """Around the endpoint of an expected request (its thread): its
        first job, or the end of the block, ends the wait for it."""
        self._mine.arrival = arrival
        try:
            yield
        finally:
            self._mine.arrival = None
            self.settle(arrival)

    def settle(self, arrival: Arrival) -> None:
        with self._cond:
            self._close(arrival)

    def _close(self, arrival: Arrival | None) -> None:
        """``arrival`` has come or will not (lock held)."""
        if arrival is not None and arrival.open:
            arrival.open = False
            self._arriving -= 1
            if self._forming:
                self._cond.notify_all()  # only a forming leader waits on it

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, a computation that never merges, in its turn."""
        return self.run(Job(None, 1, fn))

    def _lead(self) -> None:
        """Take the next batch and compute it, in a slot the caller reserved
        (``_running`` counts it); then wake the next leader."""
        with self._cond:
            batch = self._take()
        try:
            answers, merged = self._compute(batch) if batch else ([], None)
        except BaseException as error:  # every job gets it; the slot is freed
            answers, merged = [(None, error)] * len(batch), None
        with self._cond:
            self._running -= 1
            if len(batch) > 1:
                self.batches += merged is not None
                self.merged_jobs += len(batch) if merged is not None else 0
                self.fallbacks += merged is None
            if merged is not None:
                self.rows_seen[sum(job.rows for job in batch)] += 1
            else:
                self.rows_seen.update(job.rows for job in batch)
            for job, (result, error) in zip(batch, answers, strict=True):
                job.result, job.error, job.done = result, error, True
                job.wake.set()
            # their clients may be back soon (under load: whether or not
            # others queued meanwhile; all of them fit the batch at 16)
            self._returning = sum(job.key is not None for job in batch)
            self._returning_until = time.monotonic() + self.forming_limit_s
            self._promote()

    def _promote(self) -> None:
        """Reserve free slots for the oldest queued jobs' threads and wake
        them to lead (lock held)."""
        if self._forming:
            return
        for job in self._queue:
            if self._running >= self.max_running:
                break
            if not job.leads:
                job.leads = True
                self._running += 1
                job.wake.set()

    def _take(self) -> list[Job]:
        """The next batch, out of the queue (lock held): after up to
        ``wait_ms``, or while requests are still arriving or the last
        batch's clients may be about to send again (up to
        ``arriving_wait_s`` for the next of them, ``forming_limit_s`` in
        all), for more rows."""
        fixed = self.wait_s > 0
        if self._returning and time.monotonic() > self._returning_until:
            self._returning = 0  # an idle spell: they are not coming back
        if (fixed or self._arriving or self._returning) and (
            self._rows_like_head() < self.max_rows
        ):
            self._forming = True
            start = time.monotonic()
            deadline = start + (self.wait_s if fixed else self.arriving_wait_s)
            limit = start + self.forming_limit_s
            try:
                while self._rows_like_head() < self.max_rows:
                    left = deadline - time.monotonic()
                    if left <= 0 or not (fixed or self._arriving or self._returning):
                        break
                    # woken: a job queued or an arrival settled; the next
                    # may follow as closely
                    if self._cond.wait(left) and not fixed:
                        later = min(limit, time.monotonic() + self.arriving_wait_s)
                        deadline = max(deadline, later)
            finally:
                self._forming = False
        self._returning = 0  # those not back yet join the next batch
        if not self._queue:
            return []
        head = self._queue[0]
        batch, rows = [head], head.rows
        if head.key is not None and self.max_rows > 1:
            for job in self._queue[1:]:
                if job.key == head.key and rows + job.rows <= self.max_rows:
                    batch.append(job)
                    rows += job.rows
        for job in batch:
            self._queue.remove(job)
        return batch

    def _rows_like_head(self) -> int:
        if not self._queue or self._queue[0].key is None:
            return self.max_rows  # nothing to wait for
        key = self._queue[0].key
        return sum(job.rows for job in self._queue if job.key == key)

    def _compute(self, batch: list[Job]) -> tuple[list, list | None]:
        """Each job's (result, error), computed with the lock released, and
        the merged call's answers (None where each job ran alone)."""
        merged = None
        with self.context():
            if len(batch) > 1:
                try:
                    merged = [(r, None) for r in batch[0].together(batch)]
                except Exception:  # each alone: one's error stays its own
                    pass
            answers = merged or [_alone(job) for job in batch]
        return answers, merged


def _alone(job: Job) -> tuple[Any, BaseException | None]:
    try:
        return job.alone(), None
    except BaseException as error:  # raised again in the job's own thread
        return None, error
