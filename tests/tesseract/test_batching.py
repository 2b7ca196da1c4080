"""Dynamic batching (qarray.tesseract._batcher and _row_merging): the
batcher's scheduling, and concurrent requests on a resident model merged
into one call, each answer equal to the request's answer alone and to the
NumPy network. How a batch forms: test_batch_forming.py.

Covers: qarray/tesseract/_batcher.py, qarray/tesseract/_row_merging.py,
qarray/tesseract/_metrics.py"""

import importlib.util
import os
import sys
import threading

import equinox as eqx
import jax
import numpy as np
import pytest
import requests

from qarray.checkpoint import save_model, save_tree
from qarray.tesseract import ModelTesseract
from qarray.tesseract._batcher import Job, Wake
from qarray.tesseract.internal import Batcher
from support import network as net
from support.batching import (
    busy,
    jobs_recording,
    run_all,
    run_queued,
    wait_queued,
)
from support.server import ROOT, b64, decode, serve

RTOL = ATOL = 2e-4


# --- the batcher alone, with jobs whose answers say how they were computed


def test_batcher_merges_what_queued_while_busy():
    batcher = Batcher(max_rows=3, max_running=1)
    jobs, calls = jobs_recording(batcher, 5)
    results = run_queued(batcher, jobs)
    # in arrival order, at most max_rows rows a call: 3, then the other 2
    merged = [c[1] for c in calls if c[0] == "together"]
    assert sorted(map(sorted, merged)) == [[0, 1, 2], [3, 4]] or sorted(
        map(len, merged)
    ) == [2, 3]
    assert sorted(results) == [("together", i) for i in range(5)]
    assert batcher.batches == 2 and batcher.merged_jobs == 5


def test_batcher_keeps_keys_apart_and_never_merges_none():
    batcher = Batcher(max_rows=8, max_running=1)
    a, _ = jobs_recording(batcher, 2, key="a")
    b, _ = jobs_recording(batcher, 2, key="b")
    lone, _ = jobs_recording(batcher, 2, key=None)
    jobs = [a[0], b[0], lone[0], a[1], b[1], lone[1]]
    results = run_queued(batcher, jobs)
    assert [r[0] for r in results] == [
        "together", "together", "alone", "together", "together", "alone",
    ]  # fmt: skip
    assert batcher.batches == 2


def test_batcher_lone_job_computes_alone_without_waiting():
    batcher = Batcher(max_rows=64, wait_ms=0)
    jobs, calls = jobs_recording(batcher, 1)
    assert batcher.run(jobs[0]) == ("alone", 0)
    assert calls == [("alone", 0)]


def test_batcher_waits_for_more_rows_then_goes():
    # a leader waits up to wait_ms for rows: a job that comes within it joins
    batcher = Batcher(max_rows=4, wait_ms=1000)
    jobs, calls = jobs_recording(batcher, 2)
    threads, _ = run_all(batcher, jobs[:1])
    wait_queued(batcher, 1)
    threads += run_all(batcher, jobs[1:])[0]
    for t in threads:
        t.join(30)
    assert [c[0] for c in calls] == ["together"]
    # and stops waiting once max_rows rows are there (a 60 s wait would hang)
    batcher = Batcher(max_rows=2, wait_ms=60_000)
    jobs, calls = jobs_recording(batcher, 2)
    threads, _ = run_all(batcher, jobs)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert [c[0] for c in calls] == ["together"]


def test_batcher_failed_merge_answers_each_alone_with_its_own_error():
    batcher = Batcher(max_rows=8, max_running=1)
    release, holder = busy(batcher)

    def alone(i):
        if i == 1:
            raise ValueError("request 1 is bad")
        return i

    def together(jobs):
        raise RuntimeError("the merged call failed")

    jobs = [Job("k", 1, (lambda i=i: alone(i)), together) for i in range(3)]
    errors = {}

    def go(i):
        try:
            errors[i] = batcher.run(jobs[i])
        except ValueError as error:
            errors[i] = str(error)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    wait_queued(batcher, 3)
    release.set()
    for t in [holder, *threads]:
        t.join(30)
    assert errors == {0: 0, 1: "request 1 is bad", 2: 2}
    assert batcher.fallbacks == 1 and batcher.batches == 0


def test_wake_wakes_its_waiter_once_set_and_stays_set_until_cleared():
    wake = Wake()
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: (wake.wait(), woke.set()))
    waiter.start()
    assert not woke.wait(0.2)  # unset: the waiter sleeps
    wake.set()
    wake.set()  # a second set (answered, then chosen to lead) is one wake-up
    waiter.join(10)
    assert woke.is_set()
    wake.wait()  # still set: returns at once
    wake.clear()
    wake.clear()
    again = threading.Thread(target=wake.wait)
    again.start()
    again.join(0.2)
    assert again.is_alive()  # cleared: waits for the next set
    wake.set()
    again.join(10)
    assert not again.is_alive()


def test_leaf_names_are_found_once_per_request_structure(monkeypatch):
    """MergedRows reads which leaves are rows once per request structure
    (the paths of a request with adapters differ from one without), and
    keeps a bounded number of structures."""
    from qarray.tesseract import _row_merging

    walks = []
    upstream = jax.tree_util.tree_flatten_with_path
    monkeypatch.setattr(
        jax.tree_util,
        "tree_flatten_with_path",
        lambda tree: (walks.append(1), upstream(tree))[1],
    )
    merged = _row_merging.MergedRows(Batcher(max_rows=8), None, ["x"], tuple)
    x = np.ones((2, 3), np.float32)
    adapter = {"a": np.ones((1, 3), np.float32), "b": np.ones((4, 1), np.float32)}
    plain = {"x": x, "lora": None, "flag": False}
    with_lora = {"x": x, "lora": [adapter, None], "flag": False}
    for request in (plain, with_lora, plain, with_lora):
        job = merged.job("apply", request, lambda: None)
        assert job.rows == 2
    assert len(walks) == 2
    plan = job.key[0]
    assert plan.row_leaf == (False, False, True)  # lora.[0].a, lora.[0].b, x
    assert len(job.payload.arrays) == 3
    monkeypatch.setattr(_row_merging, "_STRUCTURES_KEPT", 2)
    for flag in range(5):  # each a structure of its own (a static leaf)
        merged.job("apply", {**plain, "flag": flag}, lambda: None)
        assert len(merged._names) <= 2


# --- the resident network: merged requests against alone and NumPy


def _load_api(name, environ):
    """tesseract_api.py as a fresh module under ``environ``."""
    saved = {k: os.environ.get(k) for k in environ}
    os.environ.update(environ)
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tesseract_api.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def resident(tmp_path_factory):
    rng = np.random.default_rng(3)
    layers = [
        net.make_layer(rng, 6, 5, "nk", "w", True, "gelu"),
        net.make_layer(rng, 5, 4, "kn", "w_q", True, "relu"),
        net.make_layer(rng, 4, 3, "nk", "w_q", False, "none"),
    ]
    path = tmp_path_factory.mktemp("batching") / "model.safetensors"
    save_model(path, layers)
    api = _load_api("batching_api", {"QARRAY_MODEL": str(path)})
    return api, layers, path


def _merged(batcher, calls):
    """Each call's answer, the calls queued together behind a busy batcher
    so that they merge; asserts they merged into one batch."""
    before = batcher.batches
    release, holder = busy(batcher)
    results, errors = [None] * len(calls), []

    def go(i):
        try:
            results[i] = calls[i]()
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    wait_queued(batcher, len(calls))
    release.set()
    for t in [holder, *threads]:
        t.join(60)
    assert not errors, errors
    assert batcher.batches == before + 1, "the requests did not merge"
    return results


def _requests(rng, rows=(1, 3, 2, 1)):
    xs = [net.normal(rng, (n, 6)) for n in rows]
    lora = [
        [
            {"a": net.normal(rng, (2, 6)), "b": net.normal(rng, (5, 2)), "alpha": 3.0},
            None,
            {"a": net.normal(rng, (2, 4)), "b": net.normal(rng, (3, 2)), "alpha": None},
        ]
        for _ in rows
    ]
    return xs, lora


def test_merged_applies_equal_each_alone_and_numpy(resident, rng):
    api, layers, _ = resident
    xs, lora = _requests(rng)
    for adapters in (None, lora):
        calls = [
            (lambda i=i, a=adapters: api.apply(api.InputSchema(
                x=xs[i], lora=None if a is None else a[i])))
            for i in range(len(xs))
        ]  # fmt: skip
        merged = _merged(api.RUNTIME.batcher, calls)
        for i, out in enumerate(merged):
            assert out["layers"] is None  # per-layer outputs only when asked
            alone = calls[i]()  # nothing else queued: computed alone
            np.testing.assert_allclose(out["y"], alone["y"], rtol=1e-5, atol=1e-5)
            want, _ = net.forward_one(
                xs[i], layers, lora=None if adapters is None else adapters[i]
            )
            np.testing.assert_allclose(out["y"], want, rtol=RTOL, atol=ATOL)


def test_merged_vjps_and_jvps_equal_each_alone_and_numpy(resident, rng):
    api, layers, _ = resident
    xs, lora = _requests(rng)
    gs = [net.normal(rng, (x.shape[0], 3)) for x in xs]
    paths = {"x", "lora.[0].a", "lora.[0].b", "lora.[2].a"}
    vjps = [
        (lambda i=i: api.vector_jacobian_product(
            api.InputSchema(x=xs[i], lora=lora[i]), paths, {"y"}, {"y": gs[i]}))
        for i in range(len(xs))
    ]  # fmt: skip
    for i, out in enumerate(_merged(api.RUNTIME.batcher, vjps)):
        want = net.vjp_one(xs[i], layers, gs[i], lora=lora[i])
        alone = vjps[i]()
        assert set(out) == paths
        for path in paths:
            np.testing.assert_allclose(out[path], alone[path], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(out[path], want[path], rtol=RTOL, atol=ATOL)
    tangents = [net.normal(rng, x.shape) for x in xs]
    jvps = [
        (lambda i=i: api.jacobian_vector_product(
            api.InputSchema(x=xs[i]), {"x"}, {"y"}, {"x": tangents[i]}))
        for i in range(len(xs))
    ]  # fmt: skip
    eps = 1e-3
    for i, out in enumerate(_merged(api.RUNTIME.batcher, jvps)):
        alone = jvps[i]()
        np.testing.assert_allclose(out["y"], alone["y"], rtol=1e-4, atol=1e-4)
        # the straight-through JVP is the dense network's: central differences
        hi, _ = net.forward_one(xs[i] + eps * tangents[i], layers)
        lo, _ = net.forward_one(xs[i] - eps * tangents[i], layers)
        np.testing.assert_allclose(
            out["y"], (hi - lo) / (2 * eps), rtol=2e-2, atol=2e-2
        )


def test_requests_that_cannot_merge_compute_alone(resident, rng):
    api, layers, _ = resident
    x = net.normal(rng, (2, 6))
    calls = [
        lambda: api.apply(api.InputSchema(x=x, return_weight_error=True)),
        lambda: api.apply(api.InputSchema(x=x[0])),  # one example, no rows
        lambda: api.apply(api.InputSchema(x=x, layers=layers)),  # its own weights
    ]
    before = api.RUNTIME.batcher.batches
    release, holder = busy(api.RUNTIME.batcher)
    threads, results = [], [None] * 3
    for i, call in enumerate(calls):
        threads.append(
            threading.Thread(target=lambda i=i, c=call: results.__setitem__(i, c()))
        )
        threads[-1].start()
    wait_queued(api.RUNTIME.batcher, 3)
    release.set()
    for t in [holder, *threads]:
        t.join(60)
    assert api.RUNTIME.batcher.batches == before
    want, _ = net.forward_one(x, layers)
    np.testing.assert_allclose(results[0]["y"], want, rtol=RTOL, atol=ATOL)
    assert len(results[0]["layers"]) == 3
    np.testing.assert_allclose(results[1]["y"], want[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(results[2]["y"], want, rtol=RTOL, atol=ATOL)


# --- ModelTesseract with batch inputs


class _Mlp(eqx.Module):
    """Three Linear layers (ModelTesseract's models keep functions static)."""

    layers: tuple

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        widths = [(8, 16), (16, 16), (16, 3)]
        self.layers = tuple(
            eqx.nn.Linear(i, o, key=k) for (i, o), k in zip(widths, keys, strict=True)
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def _forward(model, inputs):
    return {"y": jax.vmap(model)(inputs["x"])}


def test_model_tesseract_merges_rows_with_per_request_adapters(tmp_path, rng):
    path = tmp_path / "mlp.safetensors"
    save_tree(path, _Mlp(jax.random.key(1)))
    tess = ModelTesseract(
        _Mlp(jax.random.key(0)),
        _forward,
        model_file=path,
        environ={},
        lora_rank=2,
        batch_inputs=["x"],
    )

    class Inputs(dict):  # what the endpoints read of a validated request
        def model_dump(self):
            return dict(self)

    xs = [net.normal(rng, (n, 8)) for n in (2, 1, 3)]
    adapters = [
        [
            None
            if s is None
            else {"a": net.normal(rng, s[0]), "b": net.normal(rng, s[1])}
            for s in [tess.lora_shapes[0], None, tess.lora_shapes[2]]
        ]
        for _ in xs
    ]
    calls = [
        (lambda i=i: tess.apply(Inputs(x=xs[i], lora=adapters[i])))
        for i in range(len(xs))
    ]
    merged = _merged(tess.runtime.batcher, calls)
    for i, out in enumerate(merged):
        np.testing.assert_allclose(out["y"], calls[i]()["y"], rtol=1e-5, atol=1e-5)


# --- served: a bad request inside a busy batch


def test_served_batch_isolates_a_bad_request(tmp_path, resident, rng):
    _, layers, path = resident
    env = {"QARRAY_MODEL": str(path), "QARRAY_BATCH_WAIT_MS": "300"}
    xs = [net.normal(rng, (n, 6)) for n in (1, 2, 1, 3, 1, 1)]
    bad = net.normal(rng, (1, 7))  # the model takes 6 features
    with serve(tmp_path, env=env) as url:
        answers = [None] * (len(xs) + 1)

        def post(i, x):
            answers[i] = requests.post(
                f"{url}/apply", json={"inputs": {"x": b64(x)}}, timeout=120
            )

        threads = [
            threading.Thread(target=post, args=(i, x)) for i, x in enumerate([*xs, bad])
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert answers[-1].status_code == 422
    assert "x" in answers[-1].text and len(answers[-1].content) < 2000
    for x, answer in zip(xs, answers, strict=False):
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["layers"] is None
        want, _ = net.forward_one(x, layers)
        np.testing.assert_allclose(decode(body["y"]), want, rtol=RTOL, atol=ATOL)


def test_batcher_wakes_only_the_answered_threads_and_the_next_leader():
    # every waiting thread sleeps on its own job's event: a finished batch
    # sets the events of its jobs and of the next leader, no other
    batcher = Batcher(max_rows=2, max_running=1)
    jobs, _ = jobs_recording(batcher, 6)
    sets = []
    for job in jobs:  # count the wake-ups each job's thread gets
        original = job.wake.set
        job.wake.set = lambda original=original, job=job: (
            sets.append(job.payload),
            original(),
        )
    results = run_queued(batcher, jobs)
    assert sorted(results) == [("together", i) for i in range(6)]
    assert batcher.batches == 3
    # 6 answers and at most one promotion per batch (a notify_all would have
    # woken every queued thread at each of the 4 computations: 15 and more)
    assert len(sets) <= 6 + 3, sets


def test_a_batch_starts_while_the_previous_ones_answers_are_handed_back():
    # the next leader is chosen when a batch's answers are set, before the
    # threads of that batch go on with their responses: a thread that takes
    # its time after its answer (encoding a response) delays no batch
    batcher = Batcher(max_rows=1, max_running=1)
    release, holder = busy(batcher)
    second_started = threading.Event()
    encoding_done = threading.Event()

    def first():
        return "first"

    def second():
        second_started.set()
        return "second"

    out = {}

    def client_first():
        out["first"] = batcher.run(Job("k", 1, first))
        # the response of the first request: still being written while the
        # second request's batch must already compute
        out["overlap"] = second_started.wait(30)
        encoding_done.set()

    def client_second():
        out["second"] = batcher.run(Job("k", 1, second))

    threads = [threading.Thread(target=client_first)]
    threads[0].start()
    wait_queued(batcher, 1)
    threads.append(threading.Thread(target=client_second))
    threads[1].start()
    wait_queued(batcher, 2)
    release.set()
    for t in [holder, *threads]:
        t.join(30)
    assert out == {"first": "first", "second": "second", "overlap": True}
    assert encoding_done.is_set()


def test_a_leader_that_raises_frees_its_slot():
    batcher = Batcher(max_rows=4, max_running=1)

    def boom():
        raise KeyboardInterrupt  # not an Exception: the slot must still free

    with pytest.raises(KeyboardInterrupt):
        batcher.run(Job(None, 1, boom))
    assert batcher.run(Job(None, 1, lambda: "next")) == "next"
    assert batcher._running == 0


def test_metrics_report_rows_per_computed_call():
    from qarray.tesseract._metrics import parse, render

    batcher = Batcher(max_rows=3, max_running=1)
    jobs, _ = jobs_recording(batcher, 5)
    run_queued(batcher, jobs)
    seen = parse(render(batcher, "available (test)"))
    # the holder alone (1 row), then 3 rows and 2 rows merged
    assert seen["calls"] == 3 and seen["rows_total"] == 6
    assert seen["rows"]["1"] == 1 and seen["rows"]["2"] == 2
    assert seen["rows"]["4"] == 3 and seen["rows"]["+Inf"] == 3
    assert seen["merged_requests"] == 5 and seen["fallbacks"] == 0
    assert seen["kernels"] == "available (test)" and seen["pid"] == os.getpid()


def test_served_metrics_count_a_merged_batch(resident, tmp_path, rng):
    _, _, path = resident
    with serve(tmp_path, env={"QARRAY_MODEL": str(path)}) as url:
        before = requests.get(f"{url}/metrics", timeout=30)
        assert before.status_code == 200
        assert before.headers["content-type"].startswith("text/plain")
        x = rng.standard_normal((3, 6)).astype(np.float32)
        requests.post(f"{url}/apply", json={"inputs": {"x": b64(x)}}, timeout=60)
        from qarray.tesseract._metrics import parse

        after = parse(requests.get(f"{url}/metrics", timeout=30).text)
        assert after["calls"] >= 1 and after["rows_total"] >= 3
        assert requests.post(f"{url}/metrics", timeout=30).status_code == 405
