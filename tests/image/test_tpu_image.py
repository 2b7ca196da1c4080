"""The image's TPU variant (``docker build --build-arg JAX=tpu``, built by
``make test-image-tpu``), served on a machine without a TPU: jax[tpu] and its
libtpu are installed, JAX finds no chip and falls back to the CPU, and the
guarded server answers as the CPU image does.

Skipped unless QARRAY_TEST_TPU_IMAGE names the image. What a TPU VM would add
(the chip itself) is not tested here: docs/tpu-image.md says what was verified.
Every container is published on 127.0.0.1 and removed by its id.
"""

import json
import os
import re

import pytest
from packaging.requirements import Requirement

from support.server import ROOT
from tests.image.checks import (
    check_apply_and_vjp,
    check_bad_input_is_a_small_4xx,
    check_health,
    check_hostile_binref_refused,
)
from tests.image.docker import docker, running

IMAGE = os.environ.get("QARRAY_TEST_TPU_IMAGE", "")
pytestmark = pytest.mark.skipif(
    not IMAGE,
    reason="QARRAY_TEST_TPU_IMAGE names the TPU image (make test-image-tpu)",
)

# what the image's own Python reports: JAX's backend, the versions installed,
# the libtpu pin of jax's `tpu` extra and where libtpu.so lies
REPORT = """
import importlib.metadata as m, json, os, jax, libtpu
path = libtpu.get_library_path()
print(json.dumps({
    "backend": jax.default_backend(),
    "devices": [d.platform for d in jax.devices()],
    "jax": m.version("jax"),
    "jaxlib": m.version("jaxlib"),
    "libtpu": m.version("libtpu"),
    "pins": [r for r in m.requires("jax") if 'extra == "tpu"' in r],
    "libtpu_so": os.path.getsize(path) if os.path.isfile(path) else 0,
    "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS"),
}))
"""


def pinned_jax() -> str:
    text = (ROOT / "tesseract_requirements.txt").read_text()
    return re.search(r"^jax\[[a-z0-9,_-]+\]==(\S+)$", text, re.MULTILINE).group(1)


@pytest.fixture(scope="module")
def served():
    if docker("image", "inspect", IMAGE, check=False).returncode != 0:
        pytest.fail(f"no image {IMAGE}: `make test-image-tpu` builds it")
    with running(IMAGE) as (url, container):
        yield url, container


def test_health(served):
    url, _ = served
    check_health(url)


def test_apply_and_vjp_match_numpy_on_the_cpu(served, rng):
    url, _ = served
    check_apply_and_vjp(url, rng)


def test_bad_input_is_a_small_4xx_naming_the_field(served, rng):
    url, _ = served
    check_bad_input_is_a_small_4xx(url, rng)


def test_hostile_binref_is_refused_unread(served, rng):
    check_hostile_binref_refused(*served, rng)


def test_server_runs_as_a_non_root_user_behind_the_guard(served):
    _, container = served
    status = docker("exec", container, "cat", "/proc/1/status").stdout
    uids = next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1:]
    assert uids and all(int(u) != 0 for u in uids), uids
    assert "qarray-serve" in docker("exec", container, "cat", "/proc/1/cmdline").stdout


def test_the_tpu_runtime_is_installed_and_jax_falls_back_to_the_cpu(served):
    """jax[tpu] at our pin with the libtpu its extra pins; no chip here, so
    JAX's default backend is the CPU, with JAX_PLATFORMS left unset (on a TPU
    VM JAX picks the chip by itself)."""
    _, container = served
    report = json.loads(
        docker("exec", container, "python", "-c", REPORT).stdout.splitlines()[-1]
    )
    assert report["backend"] == "cpu", report
    assert set(report["devices"]) == {"cpu"}, report
    assert report["JAX_PLATFORMS"] is None, report
    assert report["jax"] == report["jaxlib"] == pinned_jax(), report
    libtpu_pins = [Requirement(r) for r in report["pins"] if r.startswith("libtpu")]
    assert len(libtpu_pins) == 1, report["pins"]
    assert libtpu_pins[0].specifier.contains(report["libtpu"]), report
    assert report["libtpu_so"] > 100 * 2**20, report  # the runtime itself
    shown = docker("exec", container, "python", "-m", "pip", "show", "libtpu")
    assert f"Version: {report['libtpu']}" in shown.stdout, shown.stdout


def test_asking_for_the_tpu_fails_loudly_without_one():
    """JAX_PLATFORMS=tpu makes JAX load libtpu and look for a chip: here it
    raises, naming the TPU backend, rather than serving on the CPU (what a
    deployment that must not fall back sets)."""
    result = docker(
        "run", "--rm", "-e", "JAX_PLATFORMS=tpu", "--entrypoint", "python", IMAGE,
        "-c", "import jax; jax.devices()",
        timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode != 0, result.stdout
    assert "Unable to initialize backend 'tpu'" in result.stderr, result.stderr[-3000:]
