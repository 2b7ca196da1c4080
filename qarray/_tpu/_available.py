"""Whether qarray/_tpu's kernels compile here: on a TPU whose libtpu takes
the Mosaic modules this JAX writes, and unless ``QARRAY_KERNELS=xla`` asks
for XLA's formulations only.

A libtpu older than its JAX (a host's own libtpu under a newer jax) refuses
every Pallas kernel when the program compiles, long after the strategy was
chosen; one small kernel compiled once per process finds that out first, so
that products fall back to XLA's formulations with one logged line instead
of failing.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from .._rules import xla_only
from ._int4 import int4_product
from ._int8 import int8_product
from ._vector import int8_vector

_log = logging.getLogger("qarray")


@functools.cache
def available() -> bool:
    """Whether the TPU kernels run in this process (cached: one probe)."""
    if xla_only():
        return False
    if jax.default_backend() != "tpu":
        return False
    x = jax.ShapeDtypeStruct((8, 256), jnp.float32)
    int8 = jax.ShapeDtypeStruct((256, 256), jnp.int8)
    ones = jax.ShapeDtypeStruct((256,), jnp.float32)
    packed = jax.ShapeDtypeStruct((256, 128), jnp.uint8)
    groups = jax.ShapeDtypeStruct((256, 2), jnp.float32)
    # one of every kernel the strategies pick: a libtpu may take some only
    probes = [
        (functools.partial(int8_product, nk=nk, mxu=mxu, parts=parts), (x, int8, ones))
        for nk in (True, False)
        for mxu, parts in (("bf16", 1), ("int8", 3))
    ] + [
        (
            functools.partial(int4_product, group_size=128, mode=mode, mxu=mxu),
            (x, packed, groups),
        )
        for mode, mxu in (("groups", "int8"), ("groups", "bf16"), ("tile", "bf16"))
    ]
    probes.append((int8_vector, (x, int8)))
    try:
        for kernel, shapes in probes:
            jax.jit(kernel).lower(*shapes).compile()
    except Exception as error:
        _log.warning(
            "qarray: the TPU kernels do not compile here (%s); "
            "XLA's formulations run instead",
            str(error).splitlines()[0][:200],
        )
        return False
    return True
