"""The VJP residual cache: apply keeps its pullback for the VJP that follows.

A training step through a Tesseract is an apply then a vector_jacobian_product
on the same inputs. ``ResidualCache.apply`` runs the forward pass and its
pullback in one compiled call (``jax.vjp`` inside ``jit``: the pullback is a
pytree of residuals) and keeps it in an LRU under a key of the request's host
arrays and the device the call ran on; ``ResidualCache.vjp`` runs the kept
pullback for the requested paths only. On a miss the caller recomputes
(tesseract-core's ``jax_vjp``). ``hits`` and ``misses`` count the lookups.

Why not tesseract-core's own cache (``jax_apply``): it stores an eager
``jax.vjp`` (Python dispatch on every call) under a key that fingerprints the
arrays on the device, which cost as much as the forward pass a hit saves.
``make bench`` (suite cache) measures both policies, with new inputs every
step (a training loop) and repeated ones.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal
from tesseract_core.runtime.tree_transforms import get_at_path

from .._jit import Parts, packed, unpacked
from ._request import merge_request, split_request

# QArray residuals leave the compiled forward pass as their parts
# (qarray.jit's): a hi-typed value makes every call of a jitted function that
# takes or gives one take JAX's Python dispatch path (more than a small
# network's whole backward pass); they are packed again inside.
#
# Residuals that are functions of the constants alone (a resident model's
# weights, which a linear layer's pullback needs) are not kept: as outputs of
# the compiled call they would be copies, one copy of the whole model per
# kept pullback (8 by default). The pullback's call computes them again from
# the live constants instead (no work: they are the weights' parts), and
# keeps only what depends on the request.


def _residuals(arrays, constants, fn, static, outputs):
    """Traced: ``fn``'s outputs and its pullback's residuals (QArrays as
    parts) as leaves, with the pullback's structure."""
    inputs = merge_request(arrays, static)
    # every inexact array of the request is differentiated; constants (the
    # server's own arrays) are not
    diff, nondiff = eqx.partition(inputs, eqx.is_inexact_array)

    def forward(diff):
        out = fn(eqx.combine(diff, nondiff), *constants)
        return {name: out[name] for name in outputs}, out

    _, pullback, out = jax.vjp(forward, diff, has_aux=True)
    leaves, structure = jax.tree.flatten(jax.tree.map(unpacked, pullback))
    return out, leaves, structure


@dataclass(frozen=True)
class _Signature:
    """What a kept pullback was traced from, besides the arrays' values."""

    fn: Callable
    static: tuple
    outputs: tuple[str, ...]
    arrays: tuple  # (shape, dtype) of each request array (None: not an array)
    # per residual leaf: depends on the request (None: keep every residual,
    # where the trace could not tell)
    keep: tuple[bool, ...] | None


def _request_dependent(fn, static, outputs, arrays, constants) -> tuple[bool, ...]:
    """Per residual leaf, whether it depends on the request's arrays (else
    on the constants alone): a walk over the traced forward pass, each
    equation's outputs depending on whatever its inputs depend on."""
    like = [
        None if a is None else jax.ShapeDtypeStruct(np.shape(a), a.dtype)
        for a in arrays
    ]
    closed = jax.make_jaxpr(lambda a, c: _residuals(a, c, fn, static, outputs)[1])(
        like, constants
    )
    jaxpr = closed.jaxpr
    count = len(jax.tree.leaves(like))
    request = set(jaxpr.invars[:count])
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in request for v in eqn.invars):
            request.update(eqn.outvars)
    return tuple(not isinstance(v, Literal) and v in request for v in jaxpr.outvars)


@functools.partial(jax.jit, static_argnames=("signature",))
def _forward_with_pullback(arrays, constants, signature: _Signature):
    out, leaves, _ = _residuals(
        arrays, constants, signature.fn, signature.static, signature.outputs
    )
    if signature.keep is None:
        return out, leaves
    return out, [leaf for leaf, k in zip(leaves, signature.keep, strict=True) if k]


@functools.partial(jax.jit, static_argnames=("signature", "paths"))
def _run_pullback(kept, constants, cotangents, signature: _Signature, paths):
    # the residuals of the constants again, from a forward pass on zeros that
    # XLA drops (nothing that is kept reads it)
    zeros = [None if like is None else jnp.zeros(*like) for like in signature.arrays]
    _, leaves, structure = _residuals(
        zeros, constants, signature.fn, signature.static, signature.outputs
    )
    if signature.keep is None:
        leaves = list(kept)
    else:
        given = iter(kept)
        leaves = [
            next(given) if k else leaf
            for leaf, k in zip(leaves, signature.keep, strict=True)
        ]
    pullback = jax.tree.unflatten(structure, leaves)
    pullback = jax.tree.map(packed, pullback, is_leaf=lambda n: isinstance(n, Parts))
    (input_cotangents,) = pullback(cotangents)
    # only the requested cotangents leave the call: XLA drops the products of
    # the others (x's, in a training step that differentiates the weights)
    return {path: get_at_path(input_cotangents, path) for path in paths}


def _libc_memcmp():
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):  # no C library to ask: NumPy compares
        return None
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    memcmp.restype = ctypes.c_int
    return memcmp


_MEMCMP = _libc_memcmp()


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one dtype and shape hold the same bytes (bitwise:
    -0.0 != 0.0, a NaN equal to the same NaN). C's memcmp where both are
    contiguous: one pass over both and no temporary (NumPy's ``==`` writes a
    bool array first), and the GIL released meanwhile; a VJP pays it once per
    request (make bench, suite served, the QAT loop)."""
    if (
        _MEMCMP is not None
        and a.flags.c_contiguous
        and b.flags.c_contiguous
        and a.nbytes == b.nbytes
    ):
        return a.nbytes == 0 or _MEMCMP(a.ctypes.data, b.ctypes.data, a.nbytes) == 0

    def raw(x):
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8)

    return np.array_equal(raw(a), raw(b))


def default_device() -> jax.Device:
    """The device JAX places a compiled call of host arrays on: the
    ``jax.default_device`` in force (a device, or a platform's first),
    else ``jax.devices()[0]`` (a TPU chip where there is one)."""
    device = jax.config.jax_default_device
    if device is None or isinstance(device, str):
        return jax.devices(device)[0]
    return device


class _HostKey:
    """An LRU key naming one request's arrays (host copies, as decoded), the
    static rest of the request, and the device the call is placed on
    (``default_device``).

    The device: a kept pullback's residuals stay on the device that computed
    them, uncommitted, so a VJP placed on another (a ``jax.default_device``
    block, a host with a CPU beside its accelerator) would copy every
    residual over to run there. Such a VJP misses instead and computes where
    it is placed. (A resident model on a mesh is committed to it and
    computes there whatever the default; its key names the default device
    alike.)

    Hashes a strided sample of every array (4096 elements each: a cheap hash), and
    compares the whole arrays, bitwise (-0.0 != 0.0), only when the hashes
    agree: a lookup reads the arrays once, on a hit.
    """

    SAMPLE = 4096

    def __init__(self, fn: Callable, arrays: list, static: tuple):
        self.arrays = tuple(np.asarray(a) for a in arrays if a is not None)
        self.device = default_device()
        shapes = tuple((a.dtype.str, a.shape) for a in self.arrays)
        self.meta = (fn, static, shapes, self.device)
        samples = []
        for a in self.arrays:
            flat = a.reshape(-1)
            samples.append(flat[:: max(1, flat.size // self.SAMPLE)].tobytes())
        self._hash = hash((self.meta, tuple(samples)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _HostKey)
            and self._hash == other._hash
            and self.meta == other.meta
            and all(
                same_bytes(a, b) for a, b in zip(self.arrays, other.arrays, strict=True)
            )
        )


class _Entry:
    """A kept pullback (its request-dependent residuals, the constants it
    ran on and how it was traced), and whether a VJP has read it."""

    def __init__(self, kept, constants, signature: _Signature):
        self.kept = kept
        self.constants = constants
        self.signature = signature
        self.read = False


class ResidualCache:
    """Apply's pullbacks, least recently used first out, for the VJPs that
    follow; ``size == 0`` turns it off. A VJP that reads an entry also drops
    the entries stored before it that a VJP has read already (the past steps
    of a training loop), so a loop holds one pullback, not ``size``.

    ``fn(inputs, *constants) -> outputs`` is the endpoint's function: a
    hashable callable (a module-level function) of the request dict (array
    leaves traced, the rest static) and of the server's own arrays; the
    ``outputs`` it names are the differentiable ones.
    """

    def __init__(self, size: int, min_flops: int, min_intensity: int):
        self.size = size
        self.min_flops = min_flops
        self.min_intensity = min_intensity
        # VJP lookups that found a kept pullback / did not (``pullback``)
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # endpoints run on several threads
        self._keep: dict = {}  # residuals to keep, per request signature
        # applies since the last VJP request: past ``size`` of them the traffic
        # is inference, and storing pullbacks only costs (residual buffers on
        # every apply: make bench, suite e2e, resident rows); the next VJP
        # request turns storing back on
        self._applies_without_vjp = 0

    def __len__(self) -> int:
        return len(self._entries)

    def resize(self, size: int) -> None:
        """Keep at most ``size`` entries from now on (0: off, and emptied)."""
        with self._lock:
            self.size = size
            self._evict()

    def pays(self, flops: int, elements: int, linear: bool) -> bool:
        """Whether apply should store its pullback.

        A hit saves the forward pass a miss recomputes, and costs the key, the
        pullback's residuals and a second compiled call. ``min_intensity=0``
        (the default): always, which measured faster than recomputing at every
        size, linear or not, in a training loop (``make bench``, suite cache).
        Otherwise a nonlinear function (whose backward pass needs the forward
        activations) caches from ``min_flops``, and a linear one (whose VJP
        never needs its outputs) from ``min_intensity`` flops per input element.
        Never while the last ``size`` applies had no VJP after them (inference
        traffic); the next VJP request (``vjp``) resumes it.
        """
        if self.size == 0 or self._applies_without_vjp >= self.size:
            return False
        if self.min_intensity == 0:
            return True
        if not linear:
            return flops >= self.min_flops
        return flops >= self.min_intensity * max(elements, 1)

    def arriving(self, store: bool) -> bool:
        """Counts an apply (``pays`` counts applies since the last VJP) and
        gives back ``store``, whether ``apply`` (else a plain call) serves it."""
        with self._lock:
            self._applies_without_vjp += 1
        return store

    def apply(self, fn: Callable, inputs: dict, constants=(), outputs=("y",)) -> dict:
        """``fn(inputs, *constants)``, keeping its pullback for ``vjp``."""
        arrays, static = split_request(inputs)
        constants, outputs = tuple(constants), tuple(outputs)
        signature = self._signature(fn, static, outputs, arrays, constants)
        out, kept = _forward_with_pullback(arrays, constants, signature=signature)
        key = _HostKey(fn, arrays, static)
        with self._lock:
            self._entries[key] = _Entry(kept, constants, signature)
            self._entries.move_to_end(key)
            self._evict()
        return out

    def _signature(self, fn, static, outputs, arrays, constants) -> _Signature:
        """The pullback's signature: which residuals to keep, found once per
        request signature (a trace, no compile)."""
        like = tuple(
            None if a is None else (np.shape(a), np.asarray(a).dtype) for a in arrays
        )
        leaves, structure = jax.tree.flatten(constants)
        shapes = tuple((np.shape(c), str(getattr(c, "dtype", ""))) for c in leaves)
        traced = (fn, static, outputs, like, structure, shapes)
        if traced not in self._keep:
            try:
                keep = _request_dependent(fn, static, outputs, arrays, constants)
            except Exception:  # the compiled call reports what is wrong
                keep = None
            with self._lock:
                self._keep[traced] = keep
        keep = self._keep[traced]
        return _Signature(fn, static, outputs, like, keep)

    def _evict(self) -> None:
        """Down to ``size`` entries (lock held): read ones first, oldest
        first, then the oldest unread. A read entry's VJP has come, and one
        still to come is another client's open step: with as many clients as
        entries, each client's apply and VJP always meet (test_replicas)."""
        while len(self._entries) > self.size:
            read = next((k for k, e in self._entries.items() if e.read), None)
            if read is None:
                self._entries.popitem(last=False)
            else:
                del self._entries[read]

    def vjp(self, fn: Callable, inputs: dict, cotangents: dict, paths) -> dict | None:
        """The cotangents at ``paths`` (input paths, ``layers.[0].w``) for
        output ``cotangents`` (every differentiable output, by name), from
        the pullback ``apply`` kept for these inputs; None if none was kept."""
        run = self.pullback(fn, inputs, paths)
        return None if run is None else run(cotangents)

    def pullback(self, fn: Callable, inputs: dict, paths) -> Callable | None:
        """The pullback ``apply`` kept for these inputs, taken out of the
        cache, as a function of the output cotangents (``vjp``'s second
        half, which the endpoints run in the batcher's turn: the lookup
        needs none); None if none was kept."""
        self._applies_without_vjp = 0  # VJPs follow applies: store again
        key = _HostKey(fn, *split_request(inputs)) if self._entries else None
        with self._lock:
            entry = None if key is None else self._take(key)
            if entry is None:
                self.misses += 1
                return None
            self.hits += 1
        paths = tuple(sorted(paths))
        return lambda cotangents: _run_pullback(
            entry.kept,
            entry.constants,
            cotangents,
            signature=entry.signature,
            paths=paths,
        )

    def _take(self, key: _HostKey) -> _Entry | None:
        """The entry under ``key``, marked read (lock held)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        # entries stored before this one whose VJP has come already are the
        # earlier steps of a training loop, which never sends the same weights
        # again: their residual buffers go now rather than ``size`` steps
        # later, so the next step's allocations reuse warm memory; entries not
        # read yet stay (another client's VJP may still come)
        stale = []
        for stored, other in self._entries.items():
            if other is entry:
                break  # ``stored`` is now the entry's own key object
            if other.read:
                stale.append(stored)
        for earlier in stale:
            del self._entries[earlier]
        entry.read = True
        # by the stored key, not ``key``: a dict finds its own key object by
        # identity, where ``key`` would be compared (its arrays, bitwise)
        # a second time
        self._entries.move_to_end(stored)
        return entry
