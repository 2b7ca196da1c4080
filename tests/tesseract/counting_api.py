"""tesseract_api.py with a forward-pass counter: a test-only shim.

Appends one byte to the file named by QARRAY_TEST_FORWARD_COUNTER for every
forward pass the server computes: one per apply, and one per
vector_jacobian_product that misses the residual cache and recomputes
(tesseract-core's jax_recipes.jax_vjp, which tesseract_api calls on a
miss). A VJP served from the cache adds none.
"""

import os
import sys
from pathlib import Path

from tesseract_core.runtime import jax_recipes

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tesseract_api as base
from tesseract_api import *  # noqa: F403

_COUNTER = os.environ["QARRAY_TEST_FORWARD_COUNTER"]


def _count_forward_pass():
    with open(_COUNTER, "a") as f:
        f.write("1")


def _counted(fn):
    if getattr(fn, "_counted", False):  # the runtime may load this module twice
        return fn

    def wrapper(*args, **kwargs):
        _count_forward_pass()
        return fn(*args, **kwargs)

    wrapper._counted = True
    return wrapper


apply = _counted(base.apply)
jax_recipes.jax_vjp = _counted(jax_recipes.jax_vjp)
