"""Requests of a function of the request dict merged along their rows into
one compiled call: the jobs ``Batcher`` computes together.

``MergedRows`` builds such jobs for ``fn(inputs, *constants) -> outputs``
(the shape ``jit_request`` compiles): the arrays under ``row_fields`` carry
one example per leading row and are concatenated; every other array (a
request's LoRA adapters) is stacked, one per request, and given to each row
by an index (``fn`` must take per-row leading axes on them: the contract's
batch axes). Rows are padded to a few sizes (``_bucket``) by repeating the
last row, so batching compiles a few sizes, and padded rows get zero
cotangents and tangents.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._batcher import Batcher, Job
from ._request import _ARRAY, is_array, merge_request, split_request


def _path_name(key_path) -> str:
    """tesseract-core's path of a leaf (``lora.[0].a``) from a jax key path."""
    parts = []
    for k in key_path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(f"[{k.idx}]")
        else:
            parts.append(str(k))
    return ".".join(parts)


@dataclass(frozen=True)
class _Plan:
    """The static part of a merged call: which leaves are rows, which are
    per request, and where the differentiated paths are."""

    fn: Callable
    static: tuple
    row_leaf: tuple[bool, ...]  # per array leaf: rows (else: per request)
    kind: str  # "apply" | "vjp" | "jvp"
    paths: tuple[int, ...]  # leaves differentiated (vjp) or perturbed (jvp)
    path_names: tuple[str, ...]  # their tesseract-core paths
    outputs: tuple[str, ...]  # outputs differentiated


@dataclass(frozen=True)
class _Request:
    """One job's arrays, as ``together`` reads them."""

    arrays: list  # the request's array leaves, in tree order
    vectors: tuple  # cotangents (per output) or tangents (per path)
    rows: int


class MergedRows:
    """Jobs for ``fn(inputs, *constants)`` whose ``row_fields`` (top-level
    inputs) carry one example per leading row (module doc); every output
    then carries those rows too."""

    def __init__(
        self,
        batcher: Batcher,
        fn: Callable,
        row_fields: Sequence[str],
        constants: Callable[[], tuple],
    ):
        self.batcher = batcher
        self.fn = fn
        self.row_fields = frozenset(row_fields)
        self.constants = constants
        self._names: dict[tuple, tuple] = {}  # _leaf_names'

    def run(self, job: Job) -> Any:
        return self.batcher.run(job)

    def job(
        self,
        kind: str,
        inputs: dict | None,
        alone: Callable[[], Any],
        paths: Sequence[str] = (),
        outputs: Sequence[str] = (),
        vectors: dict | None = None,
    ) -> Job:
        """A job for ``inputs`` (None: not mergeable, ``alone`` only).
        ``kind`` "apply"; "vjp" with ``vectors`` the cotangents of every
        name in ``outputs`` (rows first) for the input ``paths``; "jvp" with
        ``vectors`` the tangents of ``paths`` (absent: zeros) for
        ``outputs``. A request whose row fields disagree on their rows runs
        alone."""
        if inputs is None or self.batcher.max_rows == 1:
            return Job(None, 1, alone)
        arrays, static = split_request(inputs)
        names, row_leaf = self._leaf_names(inputs, static)
        leaves = [np.asarray(a) for a in arrays if a is not None]
        rows = {a.shape[:1] for a, r in zip(leaves, row_leaf, strict=True) if r}
        where = {name: j for j, name in enumerate(names)}
        if len(rows) != 1 or rows == {()} or not set(paths) <= set(where):
            return Job(None, 1, alone)
        ((n,),) = rows
        paths, outputs = tuple(sorted(paths)), tuple(sorted(outputs))
        plan = _Plan(
            self.fn,
            static,
            row_leaf,
            kind,
            tuple(where[p] for p in paths),
            paths,
            outputs,
        )
        vectors = vectors or {}
        if kind == "vjp":
            if set(vectors) != set(outputs):
                return Job(None, 1, alone)
            ordered = [np.asarray(vectors[name], np.float32) for name in outputs]
        elif kind == "jvp":
            ordered = [
                np.asarray(vectors[p], np.float32)
                if p in vectors
                else np.zeros(leaves[where[p]].shape, np.float32)
                for p in paths
            ]
        else:
            ordered = []
        key = (
            plan,
            tuple(
                (a.dtype.str, a.shape[1:] if r else a.shape)
                for a, r in zip(leaves, row_leaf, strict=True)
            ),
            tuple(v.shape for v in ordered),
        )
        request = _Request(leaves, tuple(ordered), n)
        return Job(key, n, alone, self._together, payload=request)

    def _leaf_names(self, inputs: dict, static: tuple) -> tuple[tuple, tuple]:
        """The array leaves' paths (``lora.[0].a``) and whether each is a
        row field, found once per request structure (``static``): a second
        walk of every request's tree cost as much as the rest of the job."""
        found = self._names.get(static)
        if found is None:
            names = tuple(
                _path_name(p)
                for p, leaf in jax.tree_util.tree_flatten_with_path(inputs)[0]
                if is_array(leaf)
            )
            row_leaf = tuple(n.split(".")[0] in self.row_fields for n in names)
            if len(self._names) >= _STRUCTURES_KEPT:  # clients choose them
                self._names.clear()
            found = self._names[static] = (names, row_leaf)
        return found

    def _together(self, jobs: list[Job]) -> list:
        plan = jobs[0].key[0]
        requests = [job.payload for job in jobs]
        total = sum(r.rows for r in requests)
        size = min(_bucket(total), max(self.batcher.max_rows, total))
        count = _bucket(len(requests))
        seg = np.repeat(np.arange(len(requests)), [r.rows for r in requests])
        seg = _pad(seg, size)
        merged = []
        for j, is_row in enumerate(plan.row_leaf):
            parts = [r.arrays[j] for r in requests]
            merged.append(
                _pad(np.concatenate(parts), size)
                if is_row
                else _pad(np.stack(parts), count)
            )
        vectors = []
        for j in range(len(requests[0].vectors)):
            parts = [r.vectors[j] for r in requests]
            rowwise = plan.kind == "vjp" or plan.row_leaf[plan.paths[j]]
            vectors.append(
                _pad(np.concatenate(parts), size, zeros=True)
                if rowwise
                else _pad(np.stack(parts), count, zeros=True)
            )
        out = _merged(merged, vectors, seg, self.constants(), plan=plan)
        out = jax.tree.map(np.asarray, out)
        starts = np.cumsum([0] + [r.rows for r in requests])
        answers = []
        for i, r in enumerate(requests):
            lo, hi = starts[i], starts[i] + r.rows
            if plan.kind == "vjp":
                answers.append(
                    {
                        name: (g[lo:hi] if plan.row_leaf[j] else g[i])
                        for name, j, g in zip(
                            plan.path_names, plan.paths, out, strict=True
                        )
                    }
                )
            else:
                answers.append(jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], out))
        return answers


# request structures whose leaf names are kept (``MergedRows._leaf_names``)
_STRUCTURES_KEPT = 64


def _bucket(n: int) -> int:
    """The compiled size for ``n``: the next power of two up to 8, then the
    next multiple of 8 (padding costs as much per row as a real one)."""
    if n <= 8:
        return 1 << max(n - 1, 0).bit_length()
    return -(-n // 8) * 8


def _pad(a: np.ndarray, size: int, zeros: bool = False) -> np.ndarray:
    """``a`` to ``size`` along axis 0: its last entry repeated (values the
    function takes: no inf or NaN from padding), or zeros (tangents and
    cotangents, so padding adds nothing)."""
    extra = size - a.shape[0]
    if extra <= 0:
        return a
    fill = np.zeros_like(a[:1]) if zeros else a[-1:]
    return np.concatenate([a, np.repeat(fill, extra, axis=0)])


@functools.partial(jax.jit, static_argnames="plan")
def _merged(merged, vectors, seg, constants, plan: _Plan):
    """The merged call: per-request leaves given to each row by ``seg``."""

    def call(leaves):
        given = iter(
            a if is_row else a[seg]
            for a, is_row in zip(leaves, plan.row_leaf, strict=True)
        )
        arrays = [next(given) if o is _ARRAY else None for o in plan.static[1]]
        return plan.fn(merge_request(arrays, plan.static), *constants)

    if plan.kind == "apply":
        return call(merged)

    def differentiated(chosen):
        leaves = list(merged)
        for j, a in zip(plan.paths, chosen, strict=True):
            leaves[j] = a
        out = call(leaves)
        return [out[name] for name in plan.outputs]

    chosen = [jnp.asarray(merged[j], jnp.float32) for j in plan.paths]
    if plan.kind == "vjp":
        _, pullback = jax.vjp(differentiated, chosen)
        (grads,) = pullback(list(vectors))
        return grads
    _, tangents = jax.jvp(differentiated, (chosen,), (list(vectors),))
    return dict(zip(plan.outputs, tangents, strict=True))
