"""Every tesseract-core workaround of qarray, in one place.

Each names the behaviour it works around and the tesseract-core version it
was checked against; ``tests/tesseract/test_workarounds.py`` has a test per
workaround that fails when tesseract-core stops behaving that way, so that an
upgrade fails loudly and the workaround can go.

Checked against tesseract-core 1.15.0.

1. **Gradient paths through fields a request left null.** The gradient
   endpoints' schemas check each path with
   ``schema_generation.input_path_validator``, whose lookup raises TypeError
   (answered as a 500) for a path that indexes a null list (``layers.[0].w``
   when the request omits ``layers`` to run the resident model), and which
   accepts a path to an absent optional array (``layers.[0].bias`` not
   given), whose tangent then fails as "expected 0D". ``install_gradient_path_check``
   reassigns the validator (before the runtime builds the schemas, i.e. at
   import of the API module) to one that turns the TypeError into the
   schema's own check, then calls ``inputs.check_gradient_path(path)`` when
   the InputSchema defines it: its ValueError is a 422 naming the path.
2. **No server of one's own for ``Tesseract.from_source``.** It always runs
   the ``tesseract-runtime`` console script found beside
   ``python_executable`` (``local_client._runtime_command``), so a Tesseract
   started that way serves without qarray's request guard.
   ``guarded_interpreter`` makes a folder holding a link to the interpreter
   and a ``tesseract-runtime`` script that runs ``qarray-serve`` (the same
   script every image installs, tesseract_config.yaml); passed as
   ``python_executable``, it makes ``from_source`` serve behind the guard.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tesseract_core.runtime import schema_generation
from tesseract_core.runtime import serve as _serve

CHECKED_AGAINST = "1.15.0"

_upstream_input_path_validator = schema_generation.input_path_validator


def checked_input_path(path: str, info) -> str:
    """tesseract-core's gradient path check, then the InputSchema's own."""
    try:
        path = _upstream_input_path_validator(path, info)
    except TypeError:
        pass  # a path through a null field: the schema's check names it
    inputs = info.data.get("inputs")
    check = getattr(inputs, "check_gradient_path", None)
    if check is not None:
        try:
            check(path)
        except ValueError as error:
            raise ValueError(f"{info.field_name}: {error}") from None
    return path


def install_gradient_path_check() -> None:
    """Workaround 1 (module doc); idempotent."""
    schema_generation.input_path_validator = checked_input_path


_RUNTIME_SCRIPT = """#!{python}
import os
import sys

os.environ.update({environment!r})

from qarray.tesseract import main

sys.exit(main())
"""


def guarded_interpreter(
    folder: Path,
    python: str | Path = sys.executable,
    environment: dict[str, str] | None = None,
) -> Path:
    """Workaround 2 (module doc): ``folder/python``, a link to ``python``
    beside a ``tesseract-runtime`` script that runs ``qarray-serve`` on it
    with ``environment`` added (``from_source`` takes none of its own); give
    it to ``Tesseract.from_source(python_executable=...)``."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "python"
    if not link.exists():
        link.symlink_to(Path(python).absolute())
    script = folder / "tesseract-runtime"
    script.write_text(
        _RUNTIME_SCRIPT.format(
            python=Path(python).absolute(), environment=dict(environment or {})
        )
    )
    os.chmod(script, 0o755)
    return link


COMPUTE_ROUTES = (
    "/apply",
    "/jacobian",
    "/jacobian_vector_product",
    "/vector_jacobian_product",
)


def endpoints_off_event_loop(app, threads: int) -> bool:
    """Workaround 3 (module doc): ``app``'s computational routes call their
    endpoints on at most ``threads`` worker threads at once; False where the
    upstream handlers stay (GPU transport, profiling)."""
    import uuid

    import anyio
    from fastapi.routing import APIRoute
    from tesseract_core.runtime.config import get_config

    config = get_config()
    if config.gpu_transport != "none" or config.profiling:
        return False
    limiters = []  # made in the event loop, by the first request

    def limiter():
        if not limiters:
            limiters.append(anyio.CapacityLimiter(threads))
        return limiters[0]

    for route in list(app.router.routes):
        if not isinstance(route, APIRoute) or route.path not in COMPUTE_ROUTES:
            continue
        upstream = route.endpoint
        endpoint = upstream.__wrapped__  # create_endpoints' function

        async def handler(
            *args, accept, run_id, exports_done, endpoint=endpoint, **kwargs
        ):
            encoding = _serve.negotiate_encoding(accept)
            rundir = f"run_{run_id or uuid.uuid4()}"
            output_path = get_config().output_path

            def compute():
                result = endpoint(*args, **kwargs)
                return _serve.create_response(
                    result, encoding, base_dir=output_path, binref_dir=rundir
                )

            return await anyio.to_thread.run_sync(compute, limiter=limiter())

        handler.__signature__ = upstream.__signature__
        handler.__name__, handler.__doc__ = upstream.__name__, upstream.__doc__
        app.router.routes.remove(route)
        app.add_api_route(route.path, handler, methods=sorted(route.methods))
    return True
