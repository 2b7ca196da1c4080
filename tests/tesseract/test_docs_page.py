"""The served API docs (/docs) render without internet, in headless Chromium
(Debian's `chromium`; `make test` installs it): GPU clusters are often
air-gapped, and tesseract-core's page loads ReDoc from a CDN.

Covers: qarray/tesseract/_server.py"""

import shutil
import subprocess

import pytest
import requests

from support.server import RUNTIME, serve

# every host but loopback is unreachable for the browser: what an air-gapped
# cluster sees
OFFLINE = "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"
FIELDS = ("quantize_activations", "return_w_q", "weight_error")


def rendered(url: str) -> str:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "no chromium on PATH: `make test` installs Debian's (setup)"
    result = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            OFFLINE,
            "--virtual-time-budget=20000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("docs")) as url:
        yield url


def test_docs_render_offline_with_the_schema(server):
    page = requests.get(f"{server}/docs", timeout=30).text
    assert "cdn" not in page.lower() and "fonts.googleapis" not in page
    dom = rendered(f"{server}/docs")
    for field in FIELDS:
        assert field in dom, field
    assert "vector_jacobian_product" in dom


def test_stock_docs_page_is_blank_offline(tmp_path):
    """The negative control: tesseract-core's own /docs shows none of the
    schema without its CDN."""
    with serve(tmp_path, program=RUNTIME) as url:
        dom = rendered(f"{url}/docs")
    assert not any(field in dom for field in FIELDS)
