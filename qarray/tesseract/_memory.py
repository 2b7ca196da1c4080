"""A server's memory: glibc's malloc tuned for big requests and resident
models, and Python's collector kept off what start-up made.

Each worker keeps freed heap mapped for the next request
(``keep_freed_memory``): the page faults of fresh memory can cost more than
the rest of a big request (benchmarks/parse_bodies.py measures a parse with
and without it).
After a model is loaded, what its loading freed goes back to the system
(``release_freed_memory``). Once started, a worker moves every object so far
(its imports, the API module, the model) out of the collector's reach
(``freeze_startup_objects``).
"""

from __future__ import annotations

import ctypes
import gc
import os

# glibc's malloc gives a freed block of more than its (dynamic) threshold back
# to the system, so every big buffer of the next request (the body, its str,
# the base64 strings, the decoded arrays) is fresh memory again, and its page
# faults can cost more than the rest of the request (benchmarks/parse_bodies.py
# and benchmarks/bench_served.py measure it on the machine they run on).
# Blocks up to 32 MiB (glibc's largest mmap
# threshold) come from the heap, and up to SERVE_KEEP_FREED_BYTES of free
# heap stays mapped for the next request. MALLOC_*_ in the environment win.
SERVE_MMAP_THRESHOLD_BYTES = 32 * 2**20
SERVE_KEEP_FREED_BYTES = 256 * 2**20


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for a server of big requests (see above); False
    where it cannot (not glibc) or the environment already does."""
    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(
        mallopt(m_mmap_threshold, SERVE_MMAP_THRESHOLD_BYTES)
        and mallopt(m_trim_threshold, SERVE_KEEP_FREED_BYTES)
    )


def release_freed_memory() -> None:
    """Hand the pages freed so far back to the OS (after loading a model,
    whose float32 file is read and dropped): glibc's allocator keeps them in
    the process otherwise, and the resident model would look several times
    its size."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def freeze_startup_objects() -> None:
    """Collect, then freeze every object left (``gc.freeze``): the modules,
    the API module and the model live as long as the process. Python's full
    collection walks every tracked object while it holds the GIL: with JAX,
    FastAPI and tesseract-core imported that stopped every request in the
    worker each time one ran, and set the p99 of a server under load
    (``make bench``, suite load); frozen, it walks what requests made. A
    process forked after this shares those objects' pages, since the
    collector never writes to them."""
    gc.collect()
    gc.freeze()
