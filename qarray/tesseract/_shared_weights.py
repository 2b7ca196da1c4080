"""One copy of the resident weights for every worker process.

``qarray-serve serve --num-workers N`` with ``QARRAY_MODEL`` would give each
worker a private copy of the quantized model: N x the memory, which is what
keeps a big model off a many-core host. Instead the supervisor makes a folder
(on ``/dev/shm`` where there is one: memory, not disk) and names it to its
workers (``SHARED_WEIGHTS_ENV``). The first worker to take the folder's lock
loads the model and writes its arrays into a segment file there; every
worker, the first included, then maps that file read-only (``MAP_SHARED``,
``PROT_READ``) and hands the mapped arrays to JAX, which on the CPU uses host
memory in place (no copy: ``jax.device_put`` of an aligned NumPy array aliases
it). The pages are the kernel's page cache, counted once however many
workers map them (PSS: ``/proc/PID/smaps_rollup``), and no worker can write
to them: a write is a fault, not a change another worker would see.

The segment: 8 bytes (little-endian length of the header), the header (a
pickle of the tree's structure and each leaf: an array's dtype, shape and
offset, or a non-array value), then the arrays, each at a multiple of
``ALIGN`` bytes (XLA's CPU client aliases aligned buffers only). Written to a
temporary name and renamed, so a worker killed while writing leaves no
half-written segment.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import pickle
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ._memory import release_freed_memory

SHARED_WEIGHTS_ENV = "QARRAY_SERVE_SHARED_WEIGHTS"  # set by serve for its workers
ALIGN = 64
# the mappings the resident arrays alias: kept for the life of the process
_MAPPINGS: list[mmap.mmap] = []


def shared_folder() -> Path | None:
    """The folder the supervisor made for its workers' shared weights, or
    None (one worker: nothing to share)."""
    folder = os.environ.get(SHARED_WEIGHTS_ENV, "").strip()
    return Path(folder) if folder else None


def make_shared_folder() -> Path:
    """A new folder for the workers' segments: on ``/dev/shm`` where it is
    writable (memory-backed), else the temporary folder."""
    import tempfile

    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="qarray-weights-", dir=base))


def load_shared(path: str, load: Callable[[], Any], folder: Path) -> Any:
    """The resident model of file ``path``, its arrays mapped from the
    segment in ``folder``: ``load()`` runs in the first worker only (the
    others wait for it on the folder's lock, then map what it wrote)."""
    segment = folder / f"{_key(path)}.weights"
    with open(folder / f"{segment.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not segment.exists():
            tree = load()
            _write(segment, tree)
            del tree  # this worker's private copy: the mapping replaces it
            release_freed_memory()
    tree = map_segment(segment)
    print(  # for whoever reads the server's log
        f"QARRAY_MODEL: worker {os.getpid()} maps {segment} read-only "
        f"({segment.stat().st_size / 2**20:.1f} MiB, shared by every worker)",
        file=sys.stderr,
        flush=True,
    )
    return tree


def _key(path: str) -> str:
    """The segment's name: the model file, its size and its time of change."""
    stat = os.stat(path)
    text = f"{os.path.realpath(path)}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class _Stored:
    """An array's place in the segment, standing in for it in the pickled
    tree (the tree itself is pickled, not its structure: equinox's
    structures hold sentinels that do not survive a pickle)."""

    def __init__(self, dtype: str, shape: tuple, offset: int):
        self.dtype, self.shape, self.offset = dtype, shape, offset


def _is_array(leaf) -> bool:
    return isinstance(leaf, np.ndarray | jax.Array)


def _write(segment: Path, tree: Any) -> None:
    arrays, offset = [], 0

    def stored(leaf):
        nonlocal offset
        if not _is_array(leaf):
            return leaf
        array = np.ascontiguousarray(np.asarray(leaf))
        offset = -(-offset // ALIGN) * ALIGN
        arrays.append((offset, array))
        place = _Stored(array.dtype.str, array.shape, offset)
        offset += array.nbytes
        return place

    header = pickle.dumps(jax.tree.map(stored, tree))
    start = -(-(8 + len(header)) // ALIGN) * ALIGN  # where the arrays begin
    partial = segment.with_suffix(f".{os.getpid()}.partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for at, array in arrays:
            f.seek(start + at)
            f.write(memoryview(array).cast("B"))
        f.truncate(start + offset)
    os.replace(partial, segment)


def map_segment(segment: Path) -> Any:
    """The tree written to ``segment``, its arrays read-only views of a
    shared mapping, placed on the default device (aliased on the CPU)."""
    with open(segment, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    _MAPPINGS.append(mapping)
    (size,) = struct.unpack_from("<Q", mapping, 0)
    tree = pickle.loads(mapping[8 : 8 + size])
    start = -(-(8 + size) // ALIGN) * ALIGN

    def placed(leaf):
        if not isinstance(leaf, _Stored):
            return leaf
        dtype = np.dtype(leaf.dtype)
        count = int(np.prod(leaf.shape, dtype=np.int64))
        view = np.frombuffer(mapping, dtype, count, start + leaf.offset)
        return jax.device_put(view.reshape(leaf.shape))

    return jax.tree.map(placed, tree)
