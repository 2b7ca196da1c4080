"""deploy/kubernetes.yaml against the Kubernetes schemas (offline: the schemas
ship inside kubernetes-validate), its wiring, and the graceful termination it
relies on: SIGTERM to `qarray-serve` lets the requests in flight finish."""

import copy
import signal
import socket
import threading
import time

import kubernetes_validate
import numpy as np
import pytest
import requests
import yaml

from support import network as net
from support.server import ROOT, decode, encode
from tests.deploy.replicas import replicas

MANIFEST = ROOT / "deploy/kubernetes.yaml"
# the oldest Kubernetes still commonly run, and the newest the package knows
VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]


def documents():
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


def by_kind(docs, kind):
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", VERSIONS)
def test_manifest_validates_offline(monkeypatch, version):
    def no_network(*args, **kwargs):
        raise OSError("kubernetes-validate tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    docs = documents()
    assert sorted(d["kind"] for d in docs) == ["Deployment", "Service"]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_validator_rejects_broken_manifests():
    """Negative controls: the schemas are really applied (types, and unknown
    fields under strict validation)."""
    deployment = by_kind(documents(), "Deployment")
    bad_type = copy.deepcopy(deployment)
    bad_type["spec"]["template"]["spec"]["containers"][0]["ports"][0][
        "containerPort"
    ] = "http"
    misspelled = copy.deepcopy(deployment)
    misspelled["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    for doc in (bad_type, misspelled):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_manifest_wiring():
    docs = documents()
    deployment, service = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()

    # serves on the port the probes and the Service name
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    assert args[0] == "serve"
    assert int(args[args.index("--port") + 1]) == ports["http"]
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert service["spec"]["ports"][0]["targetPort"] in ports
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in ports, probe

    # one GPU per replica, requested and limited (an extended resource)
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == 1
    assert resources["limits"]["nvidia.com/gpu"] == 1

    # the resident model comes from the read-only volume
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["QARRAY_MODEL"] == "/models/model.safetensors"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "models"]
    assert env["QARRAY_MODEL"].startswith(mount["mountPath"] + "/")
    assert mount["readOnly"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["readOnly"] is True

    # draining (preStop) leaves time for the requests in flight
    drain = container["lifecycle"]["preStop"]["exec"]["command"]
    assert drain[0] == "sleep"
    assert int(drain[1]) + 60 <= pod["terminationGracePeriodSeconds"]


# --- graceful termination


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_lets_in_flight_requests_finish(tmp_path, rng, workers):
    """Slow applies in flight (as many as workers) when SIGTERM arrives: each
    is answered, correctly, after the signal; then the server exits."""
    started = tmp_path / "started"
    started.touch()
    env = {"QARRAY_TEST_STARTED": str(started), "QARRAY_TEST_APPLY_SECONDS": "2"}
    api = ROOT / "tests/deploy/slow_api.py"
    networks = [
        net.three_layer(rng, "nk", activations=("silu", "gelu", "none"))
        for _ in range(workers)
    ]
    answers = {}

    def call(i):
        payload = {"inputs": encode(networks[i])}
        response = requests.post(f"{url}/apply", json=payload, timeout=60)
        answers[i] = (time.monotonic(), response)

    with replicas(tmp_path, 1, api_path=api, env=env, workers=workers) as servers:
        ((url, proc),) = servers
        threads = []
        for i in range(workers):
            threads.append(threading.Thread(target=call, args=(i,)))
            threads[-1].start()
            # each in flight before the next is sent (a worker's event loop
            # stays free while its endpoint runs: either worker may take it)
            deadline = time.monotonic() + 60
            while len(started.read_text().split()) <= i:
                assert time.monotonic() < deadline, "the apply never started"
                time.sleep(0.02)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
        code = proc.wait(timeout=60)

    assert len(started.read_text().split()) == workers  # all were in flight
    for i in range(workers):
        answered, response = answers[i]
        assert response.status_code == 200, response.text[:2000]
        assert answered > signalled  # in flight when the signal came
        y = decode(response.json())["y"]
        np.testing.assert_allclose(y, net.forward(networks[i]), rtol=2e-4, atol=2e-4)
    # uvicorn re-raises the signal once it has shut down: killed by SIGTERM
    # (Kubernetes reports exit code 143), not SIGKILLed
    assert code in (0, -signal.SIGTERM), code
