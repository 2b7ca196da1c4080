"""Test set-up shared by every test: 8 CPU devices, strict numerics.

``QARRAY_TEST_PLATFORM=tpu`` (or ``gpu``; ``make test-accelerator``) runs the
tests on that device instead, in one process (one program at a time holds a
TPU): the devices there are (sharding tests build their meshes from them),
and the tests marked ``cpu_only`` (qarray's C++ kernels, the formulations
only the CPU picks) skipped with their reason.
"""

import os
import tempfile

PLATFORMS = ("cpu", "gpu", "tpu")
PLATFORM = os.environ.get("QARRAY_TEST_PLATFORM", "cpu")
if PLATFORM not in PLATFORMS:
    raise SystemExit(
        f"QARRAY_TEST_PLATFORM must be one of {PLATFORMS}, got {PLATFORM!r}"
    )
if PLATFORM == "cpu":
    # must precede the first jax import: the sharding tests need an 8-device mesh
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

# tesseract-core's runtime writes a run folder (logs, metrics) per call where
# TESSERACT_OUTPUT_PATH points, the working directory by default: keep the
# tests' out of the checkout
os.environ.setdefault(
    "TESSERACT_OUTPUT_PATH", tempfile.mkdtemp(prefix="qarray-test-runs-")
)

# XLA's compiled programs kept on disk for the whole run (every xdist worker,
# every server a test starts, the XLA rerun): many tests build the same
# functions again (a new jit wrapper, a new server process), and a hit skips
# XLA's compile, most of a small test's time. Under .pytest_cache: a fresh
# clone starts empty; jax keys the entries by program, options and version.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), ".pytest_cache", "jax"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)
if PLATFORM != "cpu":
    # the suite's references are NumPy float32 / float64 and its tolerances
    # float32's: it asks for float32 products (what CPU gives at any
    # precision). An accelerator's default is one bf16 pass (TPU) or TF32
    # (GPU); the tests of that default ask for it by name
    # (tests/qarray/test_dtypes.py)
    jax.config.update("jax_default_matmul_precision", "highest")

# tests/image builds on a Docker engine and an image: `make test-image` runs it
# (and names the image); `make test` does not collect it
collect_ignore = [] if os.environ.get("QARRAY_TEST_IMAGE") else ["image"]


@pytest.fixture
def mesh():
    """An explicit mesh over axis "i" of 4 devices (of the 8 virtual CPU
    devices), or of the devices there are (one TPU chip), current for the
    test: the typing rules act alike on any size."""
    size = min(4, len(jax.devices()))
    mesh = jax.make_mesh((size,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        yield mesh


@pytest.fixture
def rng():
    """A fresh, seeded NumPy generator per test."""
    return np.random.default_rng(0)


def pytest_configure(config):
    if PLATFORM == "cpu":
        assert len(jax.devices()) == 8, "tests/conftest.py must run before jax starts"
    elif jax.default_backend() != PLATFORM:
        raise pytest.UsageError(
            f"QARRAY_TEST_PLATFORM={PLATFORM}, but JAX runs on "
            f"{jax.default_backend()} here ({jax.devices()})"
        )


def pytest_collection_modifyitems(config, items):
    """Off CPU, the tests marked ``cpu_only(reason)`` are skipped, saying why,
    and the cases marked ``cpu_breadth(reason)`` are deselected: on a TPU the
    suite's time is its XLA compiles (a few tenths of a second each, a 3-D
    convolution's several seconds), and those cases add compiles without
    reaching code their sibling cases do not (docs/accelerators.md)."""
    if PLATFORM == "cpu":
        return
    breadth = [item for item in items if item.get_closest_marker("cpu_breadth")]
    if breadth:
        config.hook.pytest_deselected(items=breadth)
        items[:] = [
            item for item in items if not item.get_closest_marker("cpu_breadth")
        ]
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            why = marker.args[0] if marker.args else "CPU-only machinery"
            item.add_marker(pytest.mark.skip(reason=f"CPU only: {why}"))
