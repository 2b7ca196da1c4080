"""qarray.tesseract: what a Tesseract built on qarray needs.

- ``ModelTesseract``: any equinox model, quantized and resident, as a
  Tesseract with all five endpoints (a user's ``tesseract_api.py`` in a few
  lines: ``examples/cnn_surrogate/``);
- ``Network``: the contract's network (the ``layers`` field, a resident
  ``QARRAY_MODEL``) as a module of ``qarray.nn.Linear`` layers;
- ``Settings``: every ``QARRAY_*`` variable, read and checked once;
- ``Runtime``: the settings, the mesh, the resident model, the residual cache
  and the batcher of one API module (``RUNTIME = Runtime.from_env()``);
- ``Limits``: request size limits as schema validators and endpoint checks;
- ``MergedRows``: concurrent requests merged along their rows into one
  compiled call (dynamic batching);
- ``Endpoints``: apply and the gradient endpoints over a function of the
  request (checked, compiled, batched, the pullback cached): what
  ``ModelTesseract`` and the top-level ``tesseract_api.py`` both serve
  through, each endpoint one call;
- ``jit_request``: an endpoint function of the request dict, compiled;
- ``main``, ``create_app``: the guarded server (``qarray-serve``);
  ``shared_memory_tesseract``: it on one host, arrays through shared memory.

Everything else (the guard, the path and vector checks, the contract's
shapes, the upstream workarounds) is in ``qarray.tesseract.internal``, without
a promise of stability. Names load on first use (``_lazy``). Needs
tesseract-core's runtime (``pip install qarray[tesseract]``) for everything
but ``Network``; ``import qarray`` does not import this package.
"""

from ._lazy import lazy_names

_WHERE = {
    "Endpoints": "._endpoints",
    "Limits": "._limits",
    "ModelTesseract": "._model",
    "Network": "..network",
    "MergedRows": "._row_merging",
    "Runtime": "._runtime",
    "Settings": "._settings",
    "create_app": "._server",
    "jit_request": "._request",
    "main": "._cli",
    "shared_memory_tesseract": "._shared_memory",
}
__all__ = [*_WHERE, "internal"]
__getattr__, __dir__ = lazy_names(__name__, {**_WHERE, "internal": ".internal"})
del lazy_names
