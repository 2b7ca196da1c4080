"""Docker helpers for the image tests: every container is started and removed
by its id, and every server is published on loopback only."""

import contextlib
import json
import re
import shlex
import subprocess
import time
from pathlib import Path

import requests

from support.server import free_port


def docker(*args, timeout=600, check=True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise RuntimeError(
            f"docker {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def wait_healthy(url: str, container: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        state = docker("inspect", "-f", "{{.State.Running}}", container).stdout
        if state.strip() != "true":
            break
        time.sleep(0.5)
    logs = docker("logs", container, check=False)
    raise RuntimeError(
        f"container {container[:12]} not healthy:\n{logs.stdout[-3000:]}"
        f"{logs.stderr[-3000:]}"
    )


@contextlib.contextmanager
def running(image: str, *run_args: str, command=()):
    """``docker run`` ``image`` with its port 8000 on a free loopback port;
    yields ``(url, container id)``, removes the container on exit."""
    port = free_port()
    container = docker(
        "run", "-d", "-p", f"127.0.0.1:{port}:8000", *run_args, image, *command
    ).stdout.strip()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, container)
        yield url, container
    finally:
        docker("rm", "-f", container, check=False)


# --- a `tesseract build` context, built without what cannot be reached here


def generate_build_context(source: Path, build_dir: Path, tesseract: Path) -> Path:
    """``tesseract build SOURCE --generate-only``: the context tesseract-core
    would build, Dockerfile included."""
    subprocess.run(
        [
            str(tesseract),
            "build",
            str(source),
            "--generate-only",
            "--build-dir",
            str(build_dir),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return build_dir / "Dockerfile"


def final_instruction(dockerfile: str, keyword: str) -> str:
    """The last ``KEYWORD ...`` instruction of a Dockerfile (the one that wins)."""
    lines = [ln for ln in dockerfile.splitlines() if ln.startswith(f"{keyword} ")]
    return lines[-1]


_RUN_STAGE = re.compile(r"^FROM .* AS run_stage$", re.MULTILINE)
_COPY_CHMOD = re.compile(r"^COPY --chmod=(?P<mode>[0-7]+) (?P<rest>.+)$", re.MULTILINE)


def offline_dockerfile(generated: str, base_image: str) -> str:
    """The generated Dockerfile, buildable here by Docker's classic builder.

    The run stage (where the image's entry point, environment and our custom
    build steps live) is kept verbatim except for its base image and
    ``COPY --chmod`` (a BuildKit flag), which becomes COPY + chmod. The build
    stage, which pulls ghcr.io/astral-sh/uv and downloads CPython, is replaced
    by a venv of the base image's Python at the same place (/python-env) with
    the same requirements, CPU-only jax.
    """
    match = _RUN_STAGE.search(generated)
    if not match:
        raise ValueError("no run stage in the generated Dockerfile")
    build_stage = "\n".join(
        [
            f"FROM {base_image} AS build_stage",
            "COPY __tesseract_source__/tesseract_requirements.txt /tmp/req.txt",
            "RUN sed 's/^jax\\[[a-z0-9,_-]*\\]==/jax==/' /tmp/req.txt >/tmp/cpu.txt"
            " && python3 -m venv /python-env"
            " && /python-env/bin/pip install -q --no-cache-dir -r /tmp/cpu.txt",
            "",
        ]
    )
    run_stage = f"FROM {base_image} AS run_stage" + generated[match.end() :]

    def copy_then_chmod(m: re.Match) -> str:
        rest = m.group("rest")
        parts = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        return f"COPY {rest}\nRUN chmod -R {m.group('mode')} {parts[-1]}"

    return build_stage + _COPY_CHMOD.sub(copy_then_chmod, run_stage)
