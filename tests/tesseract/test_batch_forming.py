"""How a batch forms (qarray.tesseract._batcher): a leader waits briefly
for requests the server is still reading and for the clients the last batch
answered, each arrival restarting the wait up to ``forming_limit_s``; a lone
client, or one after an idle spell, never waits.

Covers: qarray/tesseract/_batcher.py"""

import threading
import time

import pytest

from qarray.tesseract.internal import Batcher
from support.batching import (
    busy,
    jobs_recording,
    run_all,
    run_queued,
    wait_forming,
    wait_queued,
)


def test_a_leader_waits_for_a_request_still_arriving():
    # a request read by the server but not yet queued (expect): the leader's
    # batch takes it instead of leaving it for the next (it stops waiting
    # when the request queues, long before the 30 s)
    batcher = Batcher(max_rows=8, max_running=1, arriving_wait_s=30)
    jobs, calls = jobs_recording(batcher, 2)
    arrival = batcher.expect()
    first = threading.Thread(target=batcher.run, args=(jobs[0],))
    first.start()
    time.sleep(0.001)  # the leader is waiting for the arrival

    def second():
        with batcher.arriving(arrival):
            batcher.run(jobs[1])

    other = threading.Thread(target=second)
    other.start()
    for t in (first, other):
        t.join(30)
    assert calls == [("together", [0, 1])]
    assert batcher._arriving == 0


def test_an_arrival_that_never_queues_ends_the_wait():
    batcher = Batcher(max_rows=8, max_running=1, arriving_wait_s=30)
    arrival = batcher.expect()
    batcher.settle(arrival)  # refused before its endpoint ran, say
    batcher.settle(arrival)  # idempotent
    assert batcher._arriving == 0
    jobs, _ = jobs_recording(batcher, 1)
    start = time.monotonic()
    assert batcher.run(jobs[0]) == ("alone", 0)
    assert time.monotonic() - start < 10  # no wait for it: not 30 s
    # and one whose endpoint fails before any job: the block settles it
    arrival = batcher.expect()
    with pytest.raises(ValueError), batcher.arriving(arrival):
        raise ValueError("a 422 before the batcher")
    assert batcher._arriving == 0 and not arrival.open


def test_a_leader_waits_for_the_clients_the_last_batch_answered():
    # under load the clients of the batch that just finished send again
    # while the next batch forms: its leader waits for them (up to
    # arriving_wait_s for each, long before the 30 s here) instead of
    # computing the first one's rows, then the others' in a batch of their
    # own. So with nothing queued when the batch ended: 16 clients all fit
    # one batch, and come back one after another
    batcher = Batcher(max_rows=8, max_running=1, arriving_wait_s=30, forming_limit_s=60)
    jobs, calls = jobs_recording(batcher, 5)
    release, holder = busy(batcher)
    first, _ = run_all(batcher, jobs[:2])  # the batch that will finish
    wait_queued(batcher, 2)
    release.set()
    for t in [holder, *first]:
        t.join(30)
    assert calls == [("together", [0, 1])]
    assert batcher._returning == 2 and not batcher._queue
    # the first client back (in-process: it counts as one of them) leads and
    # waits for the other
    back, _ = run_all(batcher, [jobs[2]])
    wait_forming(batcher)
    assert batcher._returning == 1 and calls == [("together", [0, 1])]
    other, _ = run_all(batcher, [jobs[3]])
    for t in [*back, *other]:
        t.join(30)
    assert calls[-1] == ("together", [2, 3])
    assert batcher._returning == 2  # and the batch's clients are expected again


def test_returning_clients_are_not_waited_for_after_an_idle_spell():
    # a burst's clients that do not send again: a request after
    # forming_limit_s does not wait for them (the wait would be 30 s here)
    batcher = Batcher(
        max_rows=8, max_running=1, arriving_wait_s=30, forming_limit_s=0.05
    )
    jobs, calls = jobs_recording(batcher, 3)
    run_queued(batcher, jobs[:2])
    assert calls == [("together", [0, 1])] and batcher._returning == 2
    time.sleep(0.2)
    start = time.monotonic()
    assert batcher.run(jobs[2]) == ("alone", 2)
    assert time.monotonic() - start < 10
    assert batcher._returning == 1  # its own client, from now on


def test_arrivals_extend_a_forming_batch_up_to_the_limit():
    # each arrival restarts the leader's wait for the next (arriving_wait_s),
    # so clients coming back one after another all join one batch, even when
    # that takes longer than one wait; past forming_limit_s it computes what
    # came
    batcher = Batcher(
        max_rows=8, max_running=1, arriving_wait_s=1.0, forming_limit_s=30
    )
    jobs, calls = jobs_recording(batcher, 7)
    run_queued(batcher, jobs[:4])
    assert calls == [("together", [0, 1, 2, 3])]
    # three of the four come back 0.6 s apart: 1.2 s in all, more than one
    # wait; the fourth never does
    threads = []
    for job in jobs[4:7]:
        threads += run_all(batcher, [job])[0]
        time.sleep(0.6)
    for t in threads:
        t.join(30)
    assert calls[1:] == [("together", [4, 5, 6])]


def test_a_lone_client_never_waits_for_itself():
    # one client: its next request is the one the last batch answered, and
    # it leads at once (the wait would be 30 s here)
    batcher = Batcher(max_rows=8, max_running=1, arriving_wait_s=30)
    jobs, calls = jobs_recording(batcher, 3)
    start = time.monotonic()
    for job in jobs:
        arrival = batcher.expect()
        with batcher.arriving(arrival):
            batcher.run(job)
    assert calls == [("alone", 0), ("alone", 1), ("alone", 2)]
    assert time.monotonic() - start < 10
