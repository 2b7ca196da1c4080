"""The project's install metadata stays consistent."""

import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pins(lines):
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            out[name.split("[")[0].strip().lower()] = version.strip()
    return out


def test_image_requirements_match_pyproject_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = pins(
        project["dependencies"] + project["optional-dependencies"]["tesseract"]
    )
    image = pins((ROOT / "tesseract_requirements.txt").read_text().splitlines())
    assert image, "tesseract_requirements.txt pins nothing"
    for name, version in image.items():
        assert declared.get(name) == version, (name, version, declared.get(name))
    for name in ("jax", "equinox", "numpy", "tesseract-core"):
        assert name in image


def test_every_dependency_is_pinned_exactly():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [
        d for extra in project["optional-dependencies"].values() for d in extra
    ]
    assert all("==" in d for d in deps), deps


def test_every_subpackage_is_installed():
    """pyproject lists its packages by hand: a new subpackage left out works
    in the editable checkout and is missing from the wheel and the image."""
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
            "packages"
        ]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "qarray").rglob("__init__.py")
    }
    assert found == listed, f"pyproject packages {sorted(listed)} vs {sorted(found)}"


def test_the_server_parses_http_with_httptools():
    """httptools is a dependency for speed alone (uvicorn falls back to h11
    without a word): the protocol qarray-serve runs must be uvicorn's
    httptools one."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from qarray.tesseract._workarounds import OneWriteHTTPProtocol

    assert issubclass(OneWriteHTTPProtocol, HttpToolsProtocol)


def test_the_accelerator_suite_collects():
    """``make test-accelerator``'s file list names files that exist (a test
    file renamed elsewhere would stop the chip's run before its first test)."""
    done = subprocess.run(
        [
            "bash",
            "scripts/test_accelerator.sh",
            sys.executable,
            "cpu",
            "--collect-only",
            "-q",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "tests collected" in done.stdout
