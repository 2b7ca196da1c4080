"""``qarray.jit``: ``jax.jit`` whose QArray arguments and results cross the
boundary as their two parts.

A QArray handed to a ``jax.jit`` function as an argument takes JAX's Python
dispatch path for hi types (a JAX limitation: the C++ fast path knows only
arrays), a cost that can exceed a small layer's whole product (``make bench``,
suite matmul, the dispatch rows). Here each concrete QArray becomes a pytree
of its parts before the call and is rebuilt with ``pack`` inside the trace,
so the call stays on the fast path; results that are QArrays come back the
same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax

from ._primitives import pack, unpack
from ._qarray import QArray, QArrayTy, kind_of_parts


@dataclass(frozen=True)
class Parts:
    """A QArray's parts as a pytree: two array leaves, its kind static (also
    how the Tesseract's residual cache keeps QArray residuals)."""

    qvalue: Any
    scale: Any
    bits: int
    group_size: int | None


jax.tree_util.register_dataclass(
    Parts, data_fields=["qvalue", "scale"], meta_fields=["bits", "group_size"]
)


def _is_parts(leaf) -> bool:
    return isinstance(leaf, Parts)


def _parts_of(q: QArray) -> Parts:
    return Parts(q.qvalue, q.scale, *kind_of_parts(q.qvalue, q.scale))


def _map_leaves(convert, tree, is_leaf=None):
    # flatten / unflatten rather than jax.tree.map: a visible part of the
    # saving on a small call
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
    return treedef.unflatten([convert(leaf) for leaf in leaves])


def _to_parts(leaf):
    return _parts_of(leaf) if isinstance(leaf, QArray) else leaf


def _from_parts(leaf):
    return QArray(leaf.qvalue, leaf.scale) if _is_parts(leaf) else leaf


def _argument_to_parts(arg):
    # arrays and QArrays without a flatten: a call's Python cost is the point
    if isinstance(arg, jax.Array):
        return arg
    if isinstance(arg, QArray):
        return _parts_of(arg)
    return _map_leaves(_to_parts, arg)


def _result_from_parts(result):
    if isinstance(result, jax.Array):
        return result
    return _map_leaves(_from_parts, result, _is_parts)


def packed(leaf):
    """A ``Parts`` leaf as its QArray (traced code); other leaves as they are."""
    if _is_parts(leaf):
        return pack(leaf.qvalue, leaf.scale, leaf.bits, leaf.group_size)
    return leaf


def unpacked(leaf):
    """A traced QArray as its ``Parts``; other leaves as they are."""
    ty = jax.typeof(leaf) if isinstance(leaf, jax.core.Tracer) else None
    if isinstance(ty, QArrayTy):
        qvalue, scale = unpack(leaf)
        return Parts(qvalue, scale, ty.bits, ty.group_size)
    return leaf


def jit(fun, **jit_kwargs):
    """``jax.jit(fun, **jit_kwargs)`` for functions of QArrays.

    The same function, compiled the same way; only the way a QArray crosses
    the boundary differs (as its ``qvalue`` and ``scale``, so a call costs
    what passing those two arrays costs). Under an outer transformation
    (``grad``, ``vmap``, ...) the QArray is a tracer and passes as
    ``jax.jit`` would pass it.
    """

    @functools.wraps(fun)
    def on_parts(*args, **kwargs):
        args, kwargs = _map_leaves(packed, (args, kwargs), _is_parts)
        return _map_leaves(unpacked, fun(*args, **kwargs))

    compiled = jax.jit(on_parts, **jit_kwargs)

    @functools.wraps(fun)
    def call(*args, **kwargs):
        args = [_argument_to_parts(arg) for arg in args]
        kwargs = {name: _argument_to_parts(arg) for name, arg in kwargs.items()}
        return _result_from_parts(compiled(*args, **kwargs))

    return call
