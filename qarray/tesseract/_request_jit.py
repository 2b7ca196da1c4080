"""Compiling endpoint functions of a request dict: arrays traced, the rest
(strings, flags, None) static."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

_ARRAY = object()  # where an array leaf goes in the static part


def is_array(leaf: Any) -> bool:
    return isinstance(leaf, np.ndarray | np.generic | jax.Array)


def split_request(inputs: Any) -> tuple[list, tuple]:
    """``(arrays, static)``: the array leaves of ``inputs`` and a hashable
    rest (the tree structure and every other leaf); ``merge_request`` inverts
    it. Cheaper per call than ``eqx.filter_jit``'s partition, a visible part
    of a small apply's latency (``make bench``, suite http)."""
    leaves, treedef = jax.tree.flatten(inputs)
    arrays = [leaf if is_array(leaf) else None for leaf in leaves]
    others = tuple(_ARRAY if is_array(leaf) else leaf for leaf in leaves)
    return arrays, (treedef, others)


def merge_request(arrays: list, static: tuple) -> Any:
    treedef, others = static
    leaves = [a if o is _ARRAY else o for a, o in zip(arrays, others, strict=True)]
    return jax.tree.unflatten(treedef, leaves)


def jit_request(fn: Callable) -> Callable:
    """``fn(inputs, *constants)`` compiled with ``jax.jit``: the array leaves
    of the ``inputs`` dict traced, its other leaves static; ``constants``
    (pytrees of arrays the server holds, e.g. a resident model) traced."""

    @functools.partial(jax.jit, static_argnames="static")
    def compiled(arrays, constants, static):
        return fn(merge_request(arrays, static), *constants)

    @functools.wraps(fn)
    def call(inputs, *constants):
        arrays, static = split_request(inputs)
        return compiled(arrays, constants, static=static)

    return call
