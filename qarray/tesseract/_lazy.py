"""Package names that import their module on first use (PEP 562).

``qarray.tesseract`` and ``qarray.tesseract.internal`` list where each name
lives and load nothing until it is asked for: the contract's network
(``Network``, its shape checks) then loads with jax and equinox alone, so
``qarray.checkpoint`` can read and write network files without importing
tesseract-core's server, and the serving modules (which load model files
through ``qarray.checkpoint``) never meet a half-imported package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_names(package: str, where: dict[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``where`` maps each name
    to the module (relative to ``qarray.tesseract``) that defines it, or
    is that module itself (``"internal": ".internal"``)."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where[name], __package__)
        value = module if where[name] == f".{name}" else getattr(module, name)
        setattr(sys.modules[package], name, value)  # the next lookup is plain
        return value

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__
