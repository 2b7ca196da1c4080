"""The Tesseract's images, built and served for real (``make test-image``).

Needs a Docker engine and the image named by QARRAY_TEST_IMAGE (built by
``make test-image``); tests/conftest.py leaves this folder out of ``make test``.
Every container is published on 127.0.0.1 and removed by its id.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tesseract_core import Tesseract

from qarray.checkpoint import save_model
from support import network as net
from support.server import ROOT, b64, decode, encode, free_port
from tests.image.checks import (
    ATOL,
    RTOL,
    check_apply_and_vjp,
    check_bad_input_is_a_small_4xx,
    check_health,
    check_hostile_binref_refused,
    post,
    request_inputs,
)
from tests.image.docker import (
    docker,
    final_instruction,
    generate_build_context,
    offline_dockerfile,
    running,
)

IMAGE = os.environ["QARRAY_TEST_IMAGE"]
BASE_IMAGE = os.environ.get("BASE_IMAGE", "local/debian-python:trixie")
TESSERACT = Path(sys.executable).with_name("tesseract")


@pytest.fixture(scope="module")
def served():
    with running(IMAGE) as (url, container):
        yield url, container


def test_health(served):
    url, _ = served
    check_health(url)


def test_apply_and_vjp_base64_match_numpy(served, rng):
    url, _ = served
    check_apply_and_vjp(url, rng)
    # the image answers in base64 (TESSERACT_OUTPUT_FORMAT), not JSON lists
    inputs, *_ = request_inputs(rng)
    out = post(url, "apply", {"inputs": encode(inputs)}).json()
    assert out["y"]["data"]["encoding"] == "base64"


def test_hostile_binref_is_refused_unread(served, rng):
    check_hostile_binref_refused(*served, rng)


def test_server_runs_as_a_non_root_user(served):
    _, container = served
    status = docker("exec", container, "cat", "/proc/1/status").stdout
    uids = next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1:]
    assert uids and all(int(u) != 0 for u in uids), uids
    cmdline = docker("exec", container, "cat", "/proc/1/cmdline").stdout
    assert "qarray-serve" in cmdline  # the guarded server is PID 1


def test_image_runs_the_cpu_kernels_without_a_compiler(served):
    """Built in the build stage for the image's own jaxlib; the image itself
    has no compiler. The tiles are this CPU's best (the container's CPU is
    the host's); on a CPU without any, the XLA formulations serve, and the
    status says so."""
    from support.cpu_kernels import best_isa

    _, container = served
    code = "from qarray import _ffi; print(_ffi.status())"
    status = docker("exec", container, "python", "-c", code).stdout.strip()
    best = best_isa()
    assert status == f"available ({best})" if best else "lacks" in status, status
    compilers = docker("exec", container, "sh", "-c", "command -v g++ cc || true")
    assert compilers.stdout.strip() == ""


def test_bad_input_is_a_4xx_naming_the_field(served, rng):
    url, _ = served
    check_bad_input_is_a_small_4xx(url, rng)


def test_container_stops_cleanly():
    with running(IMAGE) as (_, container):
        start = time.monotonic()
        docker("stop", "-t", "20", container)
        took = time.monotonic() - start
        state = json.loads(docker("inspect", "-f", "{{json .State}}", container).stdout)
    # SIGTERM ends uvicorn with status 0 well before docker's SIGKILL
    assert state["ExitCode"] == 0, state
    assert not state["OOMKilled"]
    assert took < 15, took


def test_tesseract_serve_ps_and_teardown(rng):
    port = free_port()
    served = subprocess.run(
        [
            str(TESSERACT),
            "serve",
            IMAGE,
            "--port",
            str(port),
            "--host-ip",
            "127.0.0.1",
            "--user",
            "10001",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    name = json.loads(served.stdout)["container_name"]
    try:
        url = f"http://127.0.0.1:{port}"
        check_apply_and_vjp(url, rng)
        ps = subprocess.run(
            [str(TESSERACT), "ps"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "250"},
        )
        assert ps.returncode == 0, ps.stdout + ps.stderr
        row = next(ln for ln in ps.stdout.splitlines() if name in ln)
        assert "qarray" in row and "0.1.0" in row and f"127.0.0.1:{port}" in row
    finally:
        teardown = subprocess.run(
            [str(TESSERACT), "teardown", name],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert teardown.returncode == 0, teardown.stdout + teardown.stderr
    left = docker("ps", "-a", "-q", "--filter", f"name={name}").stdout.strip()
    assert left == ""


def test_tesseract_from_image_apply(rng):
    inputs, y, *_ = request_inputs(rng)
    with Tesseract.from_image(IMAGE) as tess:
        out = tess.apply(inputs)
    np.testing.assert_allclose(out["y"], y, rtol=RTOL, atol=ATOL)


def test_image_carries_what_tesseract_build_sets(tmp_path):
    """The environment and labels tesseract-core's own builds set (its tooling
    reads them) are set in our image too, with the same values."""
    source = _clean_source(tmp_path / "source")
    generated = generate_build_context(source, tmp_path / "ctx", TESSERACT)
    generated_text = generated.read_text()
    config = json.loads(docker("image", "inspect", IMAGE).stdout)[0]["Config"]
    env = dict(item.split("=", 1) for item in config["Env"])
    for line in generated_text.splitlines():
        for key in ("TESSERACT_NAME", "TESSERACT_VERSION", "TESSERACT_DESCRIPTION"):
            if line.strip().startswith(f"{key}=") or f" {key}=" in line:
                value = line.split(f"{key}=", 1)[1].split('"')[1]
                assert env.get(key) == value, (key, env.get(key), value)
    for key in ("TESSERACT_API_PATH", "TESSERACT_INPUT_PATH", "TESSERACT_OUTPUT_PATH"):
        assert key in env, key
        assert f'{key}="{env[key]}"' in generated_text, key
    for label in ("ai.pasteurlabs.tesseract.metadata",):
        assert label in generated_text
        assert label in (config.get("Labels") or {}), label
    assert env["TESSERACT_OUTPUT_FORMAT"] == "json+base64"


def _clean_source(folder: Path) -> Path:
    """What `tesseract build` needs from the project, without .venv (which it
    would otherwise copy whole into the context)."""
    folder.mkdir()
    for name in ("tesseract_api.py", "tesseract_config.yaml"):
        shutil.copy(ROOT / name, folder / name)
    shutil.copy(ROOT / "tesseract_requirements.txt", folder)
    shutil.copytree(
        ROOT / "qarray", folder / "qarray", ignore=shutil.ignore_patterns("__pycache__")
    )
    return folder


@pytest.fixture(scope="module")
def tesseract_build_image(tmp_path_factory):
    """The image `tesseract build` would make, built from its generated context
    with only the unreachable parts swapped (see offline_dockerfile)."""
    tmp = tmp_path_factory.mktemp("tesseract-build")
    source = _clean_source(tmp / "source")
    dockerfile = generate_build_context(source, tmp / "ctx", TESSERACT)
    generated = dockerfile.read_text()
    offline = tmp / "ctx" / "Dockerfile.offline"
    offline.write_text(offline_dockerfile(generated, BASE_IMAGE))
    tag = f"{IMAGE.split(':')[0]}-tesseract-build:test"
    docker(
        "build", "--network", "host", "-q", "-f", str(offline), "-t", tag,
        str(tmp / "ctx"), timeout=1200,
    )  # fmt: skip
    try:
        yield tag, generated
    finally:
        docker("rmi", "-f", tag, check=False)


def test_tesseract_build_entrypoint_reaches_the_guard(tesseract_build_image, rng):
    tag, generated = tesseract_build_image
    # tesseract-core's own ENTRYPOINT is the last one, so it is what runs ...
    assert final_instruction(generated, "ENTRYPOINT") == (
        'ENTRYPOINT ["/tesseract/entrypoint.sh", "tesseract-runtime"]'
    )
    # ... and our custom build step, which comes before it, made
    # `tesseract-runtime` qarray-serve's entry point
    custom = generated.index("# Custom build steps")
    assert custom < generated.rindex("ENTRYPOINT")
    assert "/python-env/bin/tesseract-runtime" in generated[custom:]
    config = json.loads(docker("image", "inspect", tag).stdout)[0]["Config"]
    assert config["Entrypoint"] == ["/tesseract/entrypoint.sh", "tesseract-runtime"]
    with running(tag, command=("serve", "--port", "8000", "--host", "0.0.0.0")) as (
        url,
        container,
    ):
        check_apply_and_vjp(url, rng)
        check_hostile_binref_refused(url, container, rng)
    # other commands still reach tesseract-runtime
    result = docker("run", "--rm", tag, "--help", timeout=120)
    assert "Usage: tesseract-runtime" in result.stdout + result.stderr


def test_resident_model_from_a_mounted_file(tmp_path, rng):
    """docker run -v model.safetensors:/models/... -e QARRAY_MODEL=...: requests
    carry only x."""
    layers = [
        net.make_layer(rng, 6, 5, "nk", "w", True, "relu"),
        net.make_layer(rng, 5, 3, "nk", "w_q", True, "none"),
    ]
    model = tmp_path / "model.safetensors"
    save_model(model, layers)
    model.chmod(0o644)  # readable by the image's non-root user
    mount = f"{model}:/models/model.safetensors:ro"
    env = "QARRAY_MODEL=/models/model.safetensors"
    with running(IMAGE, "-v", mount, "-e", env) as (url, _):
        x = net.normal(rng, (4, 6))
        response = post(url, "apply", {"inputs": {"x": b64(x)}})
        assert response.status_code == 200, response.text[:2000]
        np.testing.assert_allclose(
            decode(response.json())["y"],
            net.forward({"x": x, "layers": layers}),
            rtol=RTOL,
            atol=ATOL,
        )
