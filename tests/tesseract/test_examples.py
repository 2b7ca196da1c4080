"""The examples run end to end against a served Tesseract."""

import re
import subprocess
import sys

import pytest
import requests

from support.server import ROOT, serve


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("examples")) as url:
        yield url


def run_example(name, *args):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_http_client(server):
    out = run_example("http_client.py", "--url", server)
    rel = float(re.search(r"relative error vs dense float32: (\S+)", out).group(1))
    assert 0 < rel < 2e-2  # int8 weights, two layers
    assert "layers.[0]: int8 weights (32, 64) with (32,) scales" in out
    assert "d sum(y^2) / d layers.[0].w: shape (32, 64)" in out
    assert "d sum(y^2) / d layers.[1].w: shape (32, 16)" in out
    assert "w_q round trip max |dy|: 0.0e+00" in out
    assert "d sum(y^2) / d layers.[1].w_q.scale: shape (32,)" in out
    assert "refused: 422: " in out and "layers.[1].w (20, 16) has K = 20" in out


def test_qat_pipeline_trains_and_plots(server, tmp_path):
    """A short run: the served int8 network learns the digits (chance is 0.1)
    as well as the float32 model trained the same way."""
    plot = tmp_path / "qat.png"
    out = run_example(
        "qat_pipeline.py", "--url", server, "--steps", "40", "--plot", str(plot)
    )
    first, last = map(
        float, re.search(r"\(served\): loss (\S+) -> (\S+);", out).groups()
    )
    assert last < 0.2 * first
    served, baseline, deployed = map(
        float,
        re.search(
            r"test accuracy after 40 steps: int8 weights \(served\) (\S+), "
            r"float32 (\S+); exported int8 weights \(\d+ bytes\) served as w_q: "
            r"(\S+)",
            out,
        ).groups(),
    )
    assert served > 0.8
    assert abs(served - baseline) < 0.03
    assert abs(deployed - served) < 0.005  # the same int8 weights: one image at most
    assert len(re.findall(r"^step +\d+ +loss", out, re.M)) == 2  # progress
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def readme_curl_commands():
    """(path, JSON body) of every `curl ... -X POST` in the README and docs."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(page.read_text() for page in pages)
    pattern = re.compile(
        r"curl -s -X POST 127\.0\.0\.1:8000(/\w+) [^\n]*-d '(.*?)'", re.S
    )
    return pattern.findall(text)


def test_readme_curl_commands_work_as_written(server):
    commands = readme_curl_commands()
    assert {path for path, _ in commands} >= {"/apply", "/vector_jacobian_product"}
    for path, body in commands:
        response = requests.post(
            f"{server}{path}",
            data=body,
            timeout=60,
            headers={"Content-Type": "application/json"},
        )
        assert response.status_code == 200, (path, response.text[:1000])
        assert response.json()
