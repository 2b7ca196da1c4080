"""One host, no Docker: a Tesseract served by ``qarray-serve`` over shared memory.

tesseract-core 1.15 passes arrays between processes on one host as ``binref``
files (``output_format="json+binref"``) in folders both sides can read; on a
tmpfs (``/dev/shm``) with the client's pool of warm buffers
(``experimental_binref_pool``) no array goes through JSON or base64, and only
the small request documents travel over loopback HTTP. ``make bench``, suite
served, measures it against base64 and in-process calls.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

from ._workarounds import guarded_interpreter

SHARED_MEMORY = Path("/dev/shm")


def _scratch_folder() -> Path:
    """A new folder on the tmpfs where there is one (else the temp folder)."""
    root = SHARED_MEMORY if SHARED_MEMORY.is_dir() else None
    return Path(tempfile.mkdtemp(prefix="qarray-", dir=root))


def shared_memory_tesseract(
    tesseract_api: str | Path,
    folder: str | Path | None = None,
    *,
    environment: dict[str, str] | None = None,
    python_executable: str | Path | None = None,
    runtime_config: dict[str, Any] | None = None,
    startup_timeout: float = 120.0,
):
    """``Tesseract.from_source`` for one host: ``tesseract_api`` served by
    ``qarray-serve`` (the request guard: binrefs outside ``folder/inputs``
    refused, the size limits, load shedding) in its own process, arrays passed
    as binref files under ``folder`` (default: a new folder in ``/dev/shm``,
    removed with the object) through the binref pool.

    Use it as ``from_source`` is used: ``with shared_memory_tesseract(path) as
    tess: tess.apply(...)``, or hand it to tesseract-jax's ``apply_tesseract``.
    ``environment``: the server's ``QARRAY_*`` settings (``QARRAY_MODEL``...);
    ``python_executable``: an interpreter with qarray and tesseract-core's
    runtime installed (default: this one); ``runtime_config``: tesseract-core's
    runtime options (debug mode off unless given: from_source turns it on).
    """
    from tesseract_core import Tesseract

    owned = folder is None
    folder = _scratch_folder() if owned else Path(folder)
    inputs, outputs = folder / "inputs", folder / "outputs"
    inputs.mkdir(parents=True, exist_ok=True)
    outputs.mkdir(parents=True, exist_ok=True)
    python = guarded_interpreter(
        folder / "interpreter", python_executable or sys.executable, environment
    )
    tess = Tesseract.from_source(
        tesseract_api,
        input_path=inputs,
        output_path=outputs,
        output_format="json+binref",
        runtime_config={"debug": False, **(runtime_config or {})},
        python_executable=python,
        startup_timeout=startup_timeout,
        experimental_binref_pool=True,
        stream_logs=False,
    )
    if owned:
        weakref.finalize(tess, shutil.rmtree, folder, True)
    return tess
