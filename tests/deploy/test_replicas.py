"""`qarray-serve serve --num-workers 2` with the residual cache.

Each worker process keeps its own cache (tesseract-core's module-level LRU),
and uvicorn's workers share the listening socket: a keep-alive connection
stays with the worker that accepted it. So an apply and its vjp on one
connection hit the cache; on two connections they may reach two workers, and
the vjp then misses and recomputes: slower, never wrong. The forward-pass
counter (tests/tesseract/counting_api.py) tells a hit (no pass) from a miss.
"""

import threading

import numpy as np
import pytest
import requests

from support import network as net
from support.server import ROOT, b64, decode, encode, serve

RTOL = ATOL = 2e-4
TIMEOUT = 60
CLIENTS = 8


def serve_two_workers(tmp):
    """`serve --num-workers 2` with the counting API; yields (url, counter)."""
    counter = tmp / "forward_passes"
    counter.touch()
    env = {
        "QARRAY_TEST_FORWARD_COUNTER": str(counter),
        "QARRAY_VJP_CACHE_SIZE": "8",
        "QARRAY_VJP_CACHE_MIN_FLOPS": "0",  # cache every (nonlinear) network
    }
    api = ROOT / "tests/tesseract/counting_api.py"
    with serve(tmp, api_path=api, env=env, workers=2) as url:
        yield url, counter


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    yield from serve_two_workers(tmp_path_factory.mktemp("two-workers"))


@pytest.fixture
def fresh_two_workers(tmp_path):
    """Workers no earlier test has sent applies to: a worker that has served
    ``QARRAY_VJP_CACHE_SIZE`` applies with no VJP since stops storing
    pullbacks (inference traffic), which the fresh-connection test leaves
    behind on the worker its applies reached."""
    yield from serve_two_workers(tmp_path)


def passes(counter) -> int:
    return len(counter.read_text())


class Pair:
    """One network's apply and vjp requests, and the NumPy answers."""

    def __init__(self, rng):
        # activations without a kink (relu) or a saturating derivative (tanh's
        # 1 - tanh^2 cancels in float32): gradients well within RTOL of the
        # float64 reference for any draw
        self.inputs = net.three_layer(rng, "kn", activations=("silu", "gelu", "none"))
        self.payload = encode(self.inputs)
        self.paths = net.diff_paths(self.inputs)
        self.y = net.forward(self.inputs)
        self.g = net.normal(rng, self.y.shape)

    def apply(self, client):
        response = client.post(
            f"{client.url}/apply", json={"inputs": self.payload}, timeout=TIMEOUT
        )
        assert response.status_code == 200, response.text[:2000]
        y = decode(response.json())["y"]
        np.testing.assert_allclose(y, self.y, rtol=RTOL, atol=ATOL)

    def vjp(self, client):
        request = {
            "inputs": self.payload,
            "vjp_inputs": self.paths,
            "vjp_outputs": ["y"],
            "cotangent_vector": {"y": b64(self.g)},
        }
        response = client.post(
            f"{client.url}/vector_jacobian_product", json=request, timeout=TIMEOUT
        )
        assert response.status_code == 200, response.text[:2000]
        got = decode(response.json())
        want = net.vjp(self.inputs, self.g)
        for path in self.paths:
            np.testing.assert_allclose(
                got[path], want[path], rtol=RTOL, atol=ATOL, err_msg=path
            )


def connection(url):
    """A keep-alive connection (requests.Session) to url."""
    session = requests.Session()
    session.url = url
    return session


def test_one_connection_keeps_apply_and_vjp_on_one_worker(two_workers, rng):
    url, counter = two_workers
    pairs = [Pair(rng) for _ in range(4)]
    with connection(url) as client:
        before = passes(counter)
        for pair in pairs:
            pair.apply(client)
            pair.vjp(client)
        hits = len(pairs) - (passes(counter) - before - len(pairs))
    print(f"\none keep-alive connection, 2 workers: {hits}/{len(pairs)} cache hits")
    assert hits == len(pairs)  # one forward pass per apply; every vjp from the cache


def test_vjp_on_another_connection_misses_and_recomputes(two_workers, rng):
    """apply on one connection, its vjp on a fresh one: 10 pairs, then more
    until a vjp has reached the other worker. Such a vjp misses the cache,
    recomputes the forward pass and is still right."""
    url, counter = two_workers
    outcomes = []
    with connection(url) as first:
        while len(outcomes) < 10 or ("miss" not in outcomes and len(outcomes) < 200):
            pair = Pair(rng)
            pair.apply(first)
            before = passes(counter)
            with connection(url) as fresh:
                pair.vjp(fresh)
            outcomes.append("miss" if passes(counter) > before else "hit")
    hits = outcomes.count("hit")
    print(f"\nvjp on a fresh connection, 2 workers: {hits}/{len(outcomes)} hits")
    assert "miss" in outcomes, "every fresh connection reached the same worker"


def test_concurrent_clients_get_correct_answers(fresh_two_workers, rng):
    """8 clients at once, each on its own connection with its own networks:
    every answer right, and (keep-alive) every vjp a cache hit."""
    url, counter = fresh_two_workers
    work = [[Pair(rng) for _ in range(3)] for _ in range(CLIENTS)]
    failures = []

    def client_loop(pairs):
        try:
            with connection(url) as client:
                for pair in pairs:
                    pair.apply(client)
                    pair.vjp(client)
        except Exception as exc:  # reported below, with the client's index
            failures.append(exc)

    before = passes(counter)
    threads = [threading.Thread(target=client_loop, args=(p,)) for p in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    applies = sum(len(p) for p in work)
    misses = passes(counter) - before - applies
    print(f"\n{CLIENTS} concurrent clients, 2 workers: {applies - misses}/{applies}")
    assert misses == 0  # each worker's cache (8 entries) holds every open pair
