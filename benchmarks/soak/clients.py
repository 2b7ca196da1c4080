"""The client processes: requests sent, answers checked, latencies and
statuses recorded."""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import queue
import random
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import requests

from support.server import (
    decode,
)

from .networks import SPECS
from .settings import ENDPOINTS, MAX_ERROR_BODY, RETRIES, SHORT, TIMEOUT, WARMUP_TIMEOUT
from .traffic import Drawn, WrongAnswer, bad_requests, good_request


@dataclass
class Record:
    t: float  # when the answer came, seconds since start
    kind: str  # an endpoint, or "refused" for a bad request
    network: str
    status: int
    ms: float
    phase: str  # "warmup" or "timed"


@dataclass
class Run:
    """One client's tally (client processes send it back whole at the end)."""

    url: str
    t0: float  # time.monotonic() when the server was started (system-wide)
    stop: object  # a multiprocessing Event: set on the first failure
    records: list = field(default_factory=list)  # Record fields, as tuples
    failures: list = field(default_factory=list)
    worst: dict = field(default_factory=dict)  # (network, endpoint) -> fraction
    shed: dict = field(default_factory=lambda: {"count": 0, "gave_up": 0})
    bad: dict = field(default_factory=dict)  # case -> {status: count}
    rows: dict = field(default_factory=dict)  # network -> [rows, excused rows]
    wrong: list = field(default_factory=list)  # (payload, answer) of wrong answers
    phase: str = "warmup"
    deadline: float = math.inf  # time.monotonic() at which the timed phase ends

    def fail(self, message):
        self.failures.append(message)
        print(f"FAILURE: {message}", file=sys.stderr, flush=True)
        self.stop.set()

    def tally(self):
        keys = ("records", "failures", "worst", "shed", "bad", "rows", "wrong")
        return {k: getattr(self, k) for k in keys}


def merge(tallies):
    """The clients' tallies as one."""
    total = {"records": [], "failures": [], "worst": {}, "bad": {}, "rows": {}}
    total.update(shed={"count": 0, "gave_up": 0}, wrong=[])
    for tally in tallies:
        total["records"] += [Record(*r) for r in tally["records"]]
        total["failures"] += tally["failures"]
        total["wrong"] += tally["wrong"]
        for key, value in tally["worst"].items():
            total["worst"][key] = max(total["worst"].get(key, 0.0), value)
        for key in ("count", "gave_up"):
            total["shed"][key] += tally["shed"][key]
        for name, counts in tally["bad"].items():
            merged = total["bad"].setdefault(name, {})
            for status, n in counts.items():
                merged[status] = merged.get(status, 0) + n
        for name, (n, k) in tally["rows"].items():
            rows = total["rows"].setdefault(name, [0, 0])
            rows[0] += n
            rows[1] += k
    return argparse.Namespace(**total)


def post(run, session, endpoint, payload, kind, network):
    """POST with retries on load-shedding 503s; the final response or None."""
    body = json.dumps(payload).encode()
    for attempt in range(RETRIES + 1):
        start = time.perf_counter()
        try:
            response = session.post(
                f"{run.url}/{endpoint}",
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=TIMEOUT,
            )
        except requests.RequestException as error:
            run.fail(f"{network} {endpoint}: no answer ({error!r})"[:500])
            return None
        ms = (time.perf_counter() - start) * 1e3
        status = response.status_code
        t = time.monotonic() - run.t0
        run.records.append((t, kind, network, status, ms, run.phase))
        if status != 503:
            return response
        retry_after = response.headers.get("Retry-After")
        if retry_after is None or "QARRAY_MAX_INFLIGHT_BYTES" not in response.text:
            run.fail(
                f"{network} {endpoint}: a 503 that is not load shedding "
                f"(Retry-After {retry_after!r}): {response.text[:300]}"
            )
            return None
        run.shed["count"] += 1
        # the README's advice: wait Retry-After seconds, backing off
        wait = min(float(retry_after) * 2**attempt, 8.0) * random.uniform(0.5, 1.0)
        time.sleep(wait)
    run.shed["gave_up"] += 1
    return None


def do_good(run, session, request):
    kind, name = request.endpoint, request.drawn.spec.name
    response = post(run, session, kind, request.payload, kind, name)
    if response is None:
        return
    if response.status_code != 200:
        run.fail(
            f"{name} {SHORT[kind]}: status {response.status_code} for a valid "
            f"request: {response.text[:500]}"
        )
        return
    try:
        fraction = request.check(decode(response.json()))
    except WrongAnswer as error:
        if not run.wrong:
            run.wrong.append((request.payload, response.text))
        run.fail(f"wrong answer: {name} {SHORT[kind]}: {error}")
        return
    excused = request.drawn.excused
    key = (name, kind)
    run.worst[key] = max(run.worst.get(key, 0.0), fraction)
    rows = run.rows.setdefault(name, [0, 0])
    rows[0] += excused.size
    rows[1] += int(excused.sum())


def do_bad(run, session, case):
    name, endpoint, payload, fragments = case
    response = post(run, session, endpoint, payload, "refused", name)
    if response is None:
        return
    status = response.status_code
    counts = run.bad.setdefault(name, {})
    counts[str(status)] = counts.get(str(status), 0) + 1
    text = response.text
    missing = [f for f in fragments if f not in text]
    if not 400 <= status < 500 or missing or len(response.content) > MAX_ERROR_BODY:
        run.fail(
            f"bad request {name!r} ({endpoint}): status {status}, "
            f"{len(response.content)} bytes, missing {missing}: {text[:500]}"
        )


def warm_up(run, session, specs, rng, fault=None):
    """Every network x endpoint x gradient variant once, VJPs both after an
    apply of the same inputs (the residual cache's path) and on fresh ones,
    and every malformed request: XLA compiles here, not in the timed phase."""
    for i, spec in enumerate(specs):
        applied, fresh = Drawn.of(spec, rng), Drawn.of(spec, rng)
        faulty = fault == "wrong-answer" and i == 0
        steps = [(applied, "apply", "all")]
        steps += [(applied, "vector_jacobian_product", w) for w in ("all", "x")]
        steps += [(fresh, e, w) for e in ENDPOINTS[1:] for w in ("all", "x")]
        for drawn, endpoint, wrt in steps:
            if run.stop.is_set():
                return
            do_good(run, session, good_request(drawn, endpoint, rng, wrt, faulty))
    for case in bad_requests(rng):
        if not run.stop.is_set():
            do_bad(run, session, case)


def client(index, url, t0, names, seed, bad_share, fault, sync, out):
    """One client process (its own interpreter: the clients' reference checks
    do not queue on one GIL, so latencies are the server's and the CPUs').
    Warms up on its own connection (with several workers, each keeps the
    connections it accepted: every worker that serves the timed phase
    compiles here), waits for the others, then sends mixed traffic until the
    deadline; puts its tally on ``out``."""
    stop, warmed, go, deadline = sync
    run = Run(url, t0, stop)
    specs = [s for s in SPECS if s.name in names]
    rng = np.random.default_rng([seed, index])
    chooser = random.Random(seed * 1000 + index)
    last = None  # the previous apply's draw
    shift = index % len(specs)  # clients compile different programs at once
    try:
        with requests.Session() as session:
            order = specs[shift:] + specs[:shift]
            warm_up(run, session, order, rng, fault if index == 0 else None)
            warmed.wait()
            go.wait()
            run.phase, run.deadline = "timed", deadline.value
            while time.monotonic() < run.deadline and not stop.is_set():
                if chooser.random() < bad_share:
                    do_bad(run, session, chooser.choice(bad_requests(rng)))
                    continue
                endpoint = chooser.choice(ENDPOINTS)
                wrt = chooser.choice(("all", "x"))
                if endpoint == "apply" or not (last and chooser.random() < 0.4):
                    drawn = Drawn.of(chooser.choice(specs), rng)
                else:
                    drawn = last  # the apply's inputs again: the cache's path
                do_good(run, session, good_request(drawn, endpoint, rng, wrt))
                if endpoint == "apply":
                    last = drawn
    except threading.BrokenBarrierError:
        pass  # another client crashed: it said why
    except Exception:
        run.fail(f"client {index} crashed:\n{traceback.format_exc()}")
        warmed.abort()
        go.abort()
    finally:
        out.put(run.tally())


def drive(url, t0, specs, args):
    """Start the client processes, open the timed phase once all have warmed
    up, collect their tallies: (merged tally, timed_from, timed_to), times in
    seconds since t0."""
    ctx = multiprocessing.get_context("spawn")
    n = args.clients
    stop, out = ctx.Event(), ctx.Queue()
    warmed, go = ctx.Barrier(n + 1), ctx.Barrier(n + 1)
    deadline = ctx.Value("d", math.inf)
    names = [s.name for s in specs]
    procs = [
        ctx.Process(
            target=client,
            args=(i, url, t0, names, args.seed, args.bad_share),
            kwargs={
                "fault": args.inject_fault,
                "sync": (stop, warmed, go, deadline),
                "out": out,
            },
        )
        for i in range(n)
    ]
    for proc in procs:
        proc.start()
    wait = WARMUP_TIMEOUT
    try:
        warmed.wait(wait)
        deadline.value = time.monotonic() + args.seconds
        timed_from = time.monotonic() - t0
        go.wait(wait)
    except threading.BrokenBarrierError:
        timed_from = time.monotonic() - t0
    tallies = []
    for _ in procs:
        try:
            tallies.append(out.get(timeout=args.seconds + wait))
        except queue.Empty:
            break
    timed_to = time.monotonic() - t0
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    total = merge(tallies)
    if len(tallies) < n:
        total.failures.append(f"{n - len(tallies)} client processes sent no tally")
    return total, timed_from, timed_to
