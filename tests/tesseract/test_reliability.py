"""The served Tesseract under fuzzing, concurrent load and faults."""

import collections
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests

from support import network as net
from support.server import (
    SERVE,
    b64,
    decode,
    encode,
    free_port,
    serve,
    server_rss,
    stop,
    wait_healthy,
)

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
RTOL = ATOL = 2e-4
# resident memory the server may add over 2,000 distinct requests (see README)
RSS_GROWTH_BOUND_MB = 150
ENDPOINTS = (
    "apply",
    "abstract_eval",
    "jacobian",
    "jacobian_vector_product",
    "vector_jacobian_product",
)


def assert_close(got, want, msg=""):
    """float32 against the float64 reference: RTOL, and ATOL relative to the
    answer's scale (a JVP sums terms of that size, each rounded in float32)."""
    atol = ATOL * max(1.0, float(np.max(np.abs(want), initial=0)))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol, err_msg=msg)


def test_fuzzing_finds_no_server_errors(tmp_path):
    """schemathesis against /openapi.json: every POST endpoint, bounded examples."""
    with serve(tmp_path, env={"QARRAY_MAX_ELEMENTS": "100000"}) as url:
        result = subprocess.run(
            [
                str(SCHEMATHESIS),
                "run",
                f"{url}/openapi.json",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "25",
                "--seed",
                "7",
                "--phases",
                "examples,coverage,fuzzing",
                "--request-timeout",
                "30",
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
        )
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        port = url.rsplit(":", 1)[1]
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-5000:]
    # what the server saw: every endpoint, many requests, no 5xx
    log = (tmp_path / f"server-{port}.log").read_text()
    answered = re.findall(r'"POST /(\w+) HTTP/1.1" (\d+)', log)
    for endpoint in ENDPOINTS:
        assert sum(e == endpoint for e, _ in answered) >= 100, endpoint
    assert not [a for a in answered if a[1].startswith("5")]


# --- fuzzing the network contract: schemathesis cannot make a request whose
# shapes chain (it gets only 4xx), so mutate valid networks instead; every
# answer is a 4xx or right


def _random_network(rng):
    """1-3 layers of widths 1-3, random layouts, kinds, biases, activations;
    half of them with batch axes (2,) or (1,) on x and some layers."""
    batch = [(), (), (2,), (1,)][rng.integers(4)]
    widths = [int(w) for w in rng.integers(1, 4, size=rng.integers(2, 5))]
    layers = []
    for k, n in itertools.pairwise(widths):
        layers.append(
            net.make_layer(
                rng,
                k,
                n,
                layout=str(rng.choice(["kn", "nk"])),
                kind=str(rng.choice(["w", "w_q"])),
                bias=bool(rng.random() < 0.6),
                activation=str(rng.choice(net.ACTIVATIONS)),
                batch=batch if rng.random() < 0.5 else (),
            )
        )
    x_lead = (2,) if batch else ()
    inputs = {"x": net.normal(rng, (*x_lead, int(rng.integers(1, 4)), widths[0]))}
    inputs["layers"] = layers
    if rng.random() < 0.3:
        inputs["quantize_activations"] = True
    if rng.random() < 0.3:
        inputs["return_w_q"] = True
    return inputs


def _features(inputs):
    """What a request exercises, for the fuzzer's coverage check."""
    out = {f"x-rank-{inputs['x'].ndim}"}
    out |= {k for k in ("quantize_activations", "return_w_q") if inputs.get(k)}
    for layer in inputs["layers"]:
        weights = layer.get("w", layer.get("w_q", {}).get("qvalue"))
        out |= {layer["layout"], "w" if "w" in layer else "w_q", layer["activation"]}
        out |= {"bias"} if "bias" in layer else set()
        out |= {"batched-weights"} if weights.ndim > 2 else set()
    return out


def _array_slots(inputs):
    """(container, key) of every array in a request."""
    slots = [(inputs, "x")] if isinstance(inputs.get("x"), np.ndarray) else []
    for layer in inputs.get("layers", []):
        for key in ("w", "bias"):
            if isinstance(layer.get(key), np.ndarray):
                slots.append((layer, key))
        if isinstance(layer.get("w_q"), dict):
            slots += [(layer["w_q"], k) for k in ("qvalue", "scale")]
    return slots


def _mutate(rng, inputs):
    """One random change (or none, where the one drawn does not apply); returns
    whether the request still means the network it meant (its answer stays
    checkable against the reference)."""
    slots = _array_slots(inputs)
    container, key = slots[rng.integers(len(slots))]
    a = container[key]
    layer = inputs["layers"][rng.integers(len(inputs["layers"]))]
    kind = rng.integers(14)
    if kind == 0:  # one axis one longer, or empty
        shape = list(a.shape) or [1]
        axis = rng.integers(len(shape))
        shape[axis] = 0 if rng.random() < 0.3 else shape[axis] + 1
        container[key] = np.resize(a, shape).astype(a.dtype)
    elif kind == 1:  # an axis more or fewer
        fewer = np.asarray(a[0]) if a.ndim else a
        container[key] = a[None] if rng.random() < 0.5 else fewer
    elif kind == 2:
        layer.pop(str(rng.choice(["w", "w_q", "bias", "layout", "activation"])), None)
    elif kind == 3:
        target = layer if rng.random() < 0.5 else inputs
        target[str(rng.choice(["activations", "scale", "w_t", "bias2"]))] = 1
    elif kind == 4:
        layer["layout"] = str(rng.choice(["nk_", "KN", "", "kn nk"]))
    elif kind == 5:
        layer["activation"] = str(rng.choice(["softmax", "ReLU", "", "none "]))
    elif kind == 6 and a.dtype.kind == "f" and a.size:
        a.flat[rng.integers(a.size)] = rng.choice([np.nan, np.inf, -np.inf])
    elif kind == 7 and a.dtype == np.int8 and a.size:
        a.flat[rng.integers(a.size)] = -128
    elif kind == 8 and key == "scale" and a.size:
        a.flat[rng.integers(a.size)] = -1
    elif kind == 9:  # dtypes that do not cast without loss
        bad = ["complex64", "float32"] if a.dtype == np.int8 else ["complex64"]
        container[key] = a.astype(str(rng.choice(bad)))
    elif kind == 10:  # dtypes that do, for these values
        wider = ["int16", "int32"] if a.dtype == np.int8 else ["float64", "float16"]
        container[key] = a.astype(str(rng.choice(wider)))
        return container[key].dtype != np.float16  # float16 rounds the values
    elif kind == 11:
        layers = inputs["layers"]
        choice = rng.integers(3)
        if choice == 0:
            layers.append(dict(layers[-1]))
        elif choice == 1 and len(layers) > 1:
            layers.pop(rng.integers(len(layers)))
        else:
            layers.reverse()
            return len(layers) == 1  # a single layer reversed: the same network
    elif kind == 12:
        container[key] = a.tolist()  # JSON lists: the same values
    elif kind == 13:
        inputs["layers"] = []
    else:
        return True  # nothing changed
    return kind == 12


def _as_served(inputs):
    """The request as the server decodes it: float32 arrays, int8 qvalues."""
    out = {k: v for k, v in inputs.items() if k != "layers"}
    out["x"] = np.asarray(inputs["x"], np.float32)
    out["layers"] = []
    for layer in inputs["layers"]:
        one = dict(layer)
        for key in ("w", "bias"):
            if key in one:
                one[key] = np.asarray(one[key], np.float32)
        if "w_q" in one:
            one["w_q"] = {
                "qvalue": np.asarray(one["w_q"]["qvalue"], np.int8),
                "scale": np.asarray(one["w_q"]["scale"], np.float32),
            }
        out["layers"].append(one)
    return out


def _fuzz_request(rng, inputs):
    """(endpoint, payload, check, valid): check(decoded answer) for a 200, or
    None where the reference does not apply; valid: the request is well formed
    (it must get a 200)."""
    endpoint = str(rng.choice(ENDPOINTS))
    paths = net.diff_paths(inputs)
    if rng.random() < 0.2:  # mostly all of them: each set of paths compiles anew
        paths = [str(rng.choice(paths))]
    valid = checkable = rng.random() < 0.3 or _mutate(rng, inputs)
    if endpoint != "apply" and endpoint != "abstract_eval" and rng.random() < 0.1:
        # a path the request may not give (layers.[0] may be a w layer)
        paths.append(str(rng.choice(["layers.[7].w", "layers.[0].w_q.scale"])))
        valid = False
    payload = {"inputs": encode(inputs)}
    served = _as_served(inputs) if checkable else None

    def reference_y():
        return net.forward(served)

    if endpoint == "abstract_eval":
        payload["inputs"] = _abstract(inputs)

        def check(out):
            if served is not None:
                assert tuple(out["y"]["shape"]) == reference_y().shape

    elif endpoint == "apply":

        def check(out):
            if served is not None:
                assert_close(out["y"], reference_y())

    else:
        try:
            y_shape = net.forward(_as_served(inputs)).shape
        except Exception:  # a malformed network: any cotangent shape will do
            y_shape = (2, 2)
        tangents = {p: net.normal(rng, _shape_at(inputs, p)) for p in paths}
        if endpoint == "vector_jacobian_product":
            g = net.normal(rng, y_shape)
            payload.update(
                vjp_inputs=paths, vjp_outputs=["y"], cotangent_vector={"y": b64(g)}
            )

            def check(out):
                if served is not None:
                    want = net.vjp(served, g)
                    for p in paths:
                        assert_close(out[p], want[p], p)

        elif endpoint == "jacobian_vector_product":
            payload.update(
                jvp_inputs=paths,
                jvp_outputs=["y"],
                tangent_vector={p: b64(t) for p, t in tangents.items()},
            )

            def check(out):
                if served is not None:
                    want = _jvp_reference(served, tangents, reference_y().shape)
                    assert_close(out["y"], want)

        else:
            payload.update(jac_inputs=paths, jac_outputs=["y"])

            def check(out):
                if served is not None:
                    for p in paths:
                        want = net.jacobian(served, p)
                        assert_close(out["y"][p], want, p)

    return endpoint, payload, check if checkable else None, valid


def _shape_at(inputs, path):
    try:
        return np.shape(net.at(inputs, path))
    except KeyError:  # a path the request does not give
        return (2,)


def _abstract(inputs):
    """abstract_eval's form of a request: each array as its shape and dtype."""
    if isinstance(inputs, np.ndarray):
        return {"shape": list(inputs.shape), "dtype": str(inputs.dtype)}
    if isinstance(inputs, dict):
        return {k: _abstract(v) for k, v in inputs.items()}
    if isinstance(inputs, list) and inputs and isinstance(inputs[0], dict):
        return [_abstract(v) for v in inputs]
    if isinstance(inputs, list):  # an array as JSON lists
        return _abstract(np.asarray(inputs))
    return inputs


# 8 network structures (their seeds): each compiles once per endpoint and
# set of paths; together they cover what the coverage check names
REQUESTS, STRUCTURES, FIRST_SEED = 300, 8, 10


def test_mutated_networks_get_a_4xx_or_the_right_answer(tmp_path):
    """REQUESTS requests: valid random networks on every endpoint, 70% with
    one random change (shapes, rank, missing and unknown fields, layout and
    activation values, non-finite values, -128, negative scales, dtypes,
    layers duplicated, dropped, reversed or none). Never a 5xx; a request
    whose change cannot alter the network (or none) gets a 200 whose answer
    matches the NumPy network."""
    rng = np.random.default_rng(2026)
    seeds = range(FIRST_SEED, FIRST_SEED + STRUCTURES)
    structures = [_random_network(np.random.default_rng(i)) for i in seeds]
    features = set().union(*map(_features, structures))
    assert features >= {"kn", "nk", "w", "w_q", "bias", "batched-weights"}
    assert features >= {"x-rank-2", "x-rank-3", "quantize_activations", "return_w_q"}
    assert len(features & set(net.ACTIVATIONS)) >= 5
    seen = collections.Counter()
    with serve(tmp_path, env={"QARRAY_MAX_ELEMENTS": "100000"}) as url:
        session = requests.Session()
        for i in range(REQUESTS):
            # a few structures (each compiles once per endpoint), fresh x each time
            inputs = _random_network(np.random.default_rng(rng.choice(seeds)))
            inputs["x"] = net.normal(rng, inputs["x"].shape)
            endpoint, payload, check, valid = _fuzz_request(rng, inputs)
            response = session.post(f"{url}/{endpoint}", json=payload, timeout=60)
            status = response.status_code
            context = (i, endpoint, status, response.text[:1000])
            assert status == 200 or (400 <= status < 500 and not valid), context
            if status == 200:
                if check is not None:
                    check(_decode(response.json()))
                    seen["checked"] += 1
            else:
                assert "detail" in response.json(), context
                assert len(response.content) < 4000, context
            seen[endpoint, status == 200] += 1
        assert session.get(f"{url}/health", timeout=10).status_code == 200
    print(dict(seen))
    # both outcomes on every endpoint, and many answers checked
    assert {key for key, count in seen.items() if count >= 5} >= {
        (e, ok) for e in ENDPOINTS for ok in (False, True)
    }
    assert seen["checked"] >= REQUESTS // 4


# --- load: concurrent clients, every answer checked against the NumPy network


def _variant_inputs(i):
    """Distinct 3-layer networks per request (relu and tanh: apply caches its
    pullback), both layouts, w and w_q layers; every fourth pair an ensemble
    (batch axes on x and the weights). Pairs share a base and differ in one
    element's sign of zero in x and in the last bit of one int8 value, so a
    mixed-up cache entry would show."""
    rng = np.random.default_rng(i // 2)  # pairs share a base
    batch = (2,) if (i // 2) % 4 == 3 else ()
    layers = [
        net.make_layer(rng, 8, 6, "kn", "w_q", True, "relu", batch),
        net.make_layer(rng, 6, 5, "nk", "w", True, "tanh"),
        net.make_layer(rng, 5, 3, "nk", "w_q", bool((i // 2) % 3), "none", batch),
    ]
    x = net.normal(rng, (*batch, 3, 8))
    x[(*[0] * len(batch), 0, 0)] = -0.0 if i % 2 else 0.0
    # the last layer is linear: its weights always reach y
    qvalue = layers[2]["w_q"]["qvalue"]
    qvalue[(*[0] * len(batch), 1, 1)] = 5 if i % 2 else 4  # differ in the last bit
    return {"x": x, "layers": layers}


def _decode(answer):
    """server.decode, into lists too (the per-layer outputs)."""
    if isinstance(answer, list):
        return [_decode(v) for v in answer]
    if isinstance(answer, dict) and answer.get("object_type") != "array":
        return {k: _decode(v) for k, v in answer.items()}
    return decode(answer)


def _jvp_reference(inputs, tangents, y_shape):
    """J t from the reference VJP: one VJP per element of y."""
    out = np.zeros(y_shape)
    for index in np.ndindex(*y_shape):
        g = np.zeros(y_shape)
        g[index] = 1
        cotangents = net.vjp(inputs, g)
        out[index] = sum(np.vdot(cotangents[p], t) for p, t in tangents.items())
    return out


def _request(url, session, i):
    inputs = _variant_inputs(i)
    payload = encode(inputs)
    paths = net.diff_paths(inputs)
    y_shape = net.forward(inputs).shape
    kind = ("apply", "vjp", "jvp")[i % 3]
    rng = np.random.default_rng(10_000 + i)

    def post(endpoint, inputs=payload, **fields):
        out = session.post(
            f"{url}/{endpoint}", json={"inputs": inputs, **fields}, timeout=60
        )
        out.raise_for_status()
        return _decode(out.json())

    if kind == "apply":
        got = post("apply", {**payload, "return_weight_error": True})
        assert len(got["layers"]) == 3
        assert got["layers"][1]["weight_error"].shape == net.batch_shape(inputs)
        want = {"y": net.forward(inputs)}
    elif kind == "vjp":
        # apply first, as tesseract-jax does: the VJP may come from the cache
        post("apply")
        g = net.normal(rng, y_shape)
        got = post(
            "vector_jacobian_product",
            vjp_inputs=paths,
            vjp_outputs=["y"],
            cotangent_vector={"y": b64(g)},
        )
        want = net.vjp(inputs, g)
        assert set(got) == set(paths)
    else:
        tangents = {p: net.normal(rng, np.shape(net.at(inputs, p))) for p in paths}
        got = post(
            "jacobian_vector_product",
            jvp_inputs=paths,
            jvp_outputs=["y"],
            tangent_vector={p: b64(t) for p, t in tangents.items()},
        )
        want = {"y": _jvp_reference(inputs, tangents, y_shape)}
    for path, value in want.items():
        assert_close(got[path], value, f"{kind} {i} {path}")
    return kind, bool(net.batch_shape(inputs))


def test_load_variants_differ_within_each_pair():
    """A pair's answers differ by more than the tolerance, so the load test
    would see one answered with the other's (a mixed-up cache entry)."""
    for i in range(0, 48, 2):
        a, b = (net.forward(_variant_inputs(j)) for j in (i, i + 1))
        with pytest.raises(AssertionError):
            assert_close(a, b)


@pytest.mark.parametrize("workers", [1, 2])
def test_concurrent_mixed_load_is_always_right(tmp_path, workers):
    env = {"QARRAY_VJP_CACHE_SIZE": "8", "QARRAY_VJP_CACHE_MIN_INTENSITY": "0"}
    with serve(tmp_path, env=env, workers=workers) as url:
        sessions = threading.local()

        def run(i):
            if not hasattr(sessions, "s"):
                sessions.s = requests.Session()
            return _request(url, sessions.s, i)

        with ThreadPoolExecutor(max_workers=8) as pool:
            done = list(pool.map(run, range(240)))  # raises on any wrong answer
        # every endpoint, with and without batch axes
        kinds = ("apply", "vjp", "jvp")
        assert set(done) == {(k, b) for k in kinds for b in (False, True)}
        if workers == 1:
            # memory: 2,000 more requests with distinct inputs (the cache is an LRU)
            before = server_rss(url) / 2**20
            with ThreadPoolExecutor(max_workers=8) as pool:
                list(pool.map(run, range(1000, 3000)))
            growth = server_rss(url) / 2**20 - before
            print(f"RSS growth over 2,000 requests: {growth:.1f} MB")
            assert growth < RSS_GROWTH_BOUND_MB


# --- faults


def _start(tmp_path, port):
    env = {
        **os.environ,
        "TESSERACT_API_PATH": str(Path(__file__).parents[2] / "tesseract_api.py"),
        "TESSERACT_OUTPUT_PATH": str(tmp_path / "outputs"),
        "TESSERACT_OUTPUT_FORMAT": "json+base64",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "",
    }
    log = tmp_path / f"fault-{time.monotonic_ns()}.log"
    with log.open("wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [SERVE, "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    wait_healthy(f"http://127.0.0.1:{port}", proc, 120, log)
    return proc


def _apply_ok(url):
    inputs = net.three_layer(np.random.default_rng(0))
    out = requests.post(f"{url}/apply", json={"inputs": encode(inputs)}, timeout=60)
    out.raise_for_status()
    np.testing.assert_allclose(
        decode(out.json())["y"], net.forward(inputs), rtol=RTOL, atol=ATOL
    )


def test_killed_mid_request_then_restarted(tmp_path):
    (tmp_path / "outputs").mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(tmp_path, port)
    try:
        _apply_ok(url)
        errors = []

        def slow_body():
            yield b'{"inputs": {"x": '
            time.sleep(4)  # the server dies while this request is in flight
            yield b"[[1.0]]}}"

        def client():
            try:
                requests.post(
                    f"{url}/apply",
                    data=slow_body(),
                    timeout=60,
                    headers={"Content-Type": "application/json"},
                )
            except requests.ConnectionError as e:
                errors.append(e)

        thread = threading.Thread(target=client)
        thread.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert len(errors) == 1  # a clean connection error, not a hang or a 5xx
        proc = _start(tmp_path, port)
        for _ in range(3):
            _apply_ok(url)
    finally:
        stop(proc)


def test_client_disconnecting_mid_request_does_not_wedge_the_worker(tmp_path):
    with serve(tmp_path) as url:
        host, port = url.removeprefix("http://").split(":")
        for _ in range(5):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(
                    b"POST /apply HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                    b'{"inputs": {"x": [[1.0, 2.0'
                )
            # and a complete request whose client leaves before the answer
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                body = (
                    b'{"inputs": {"x": [[1.0, 2.0]], "layers": [{"w": [[1.0], [2.0]]}, '
                    b'{"w": [[3.0]], "activation": "relu"}]}}'
                )
                sock.sendall(
                    b"POST /apply HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    b"\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
        start = time.monotonic()
        _apply_ok(url)
        assert time.monotonic() - start < 10
