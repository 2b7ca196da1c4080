"""``QARRAY_MODEL``: a network loaded once at start-up and kept on the device."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from ..checkpoint import ModelFileError, load_network
from ..network import Network
from ._memory import release_freed_memory
from ._mesh import on_mesh


def load_resident(path: str, mesh: jax.sharding.Mesh | None = None) -> Network:
    """The model file's network, checked and quantized (only the int8 payload
    and the scales stay), on the device, or on ``mesh`` with each layer's
    output channels spread over its "model" axis. Start-up fails with a
    RuntimeError naming the tensor at fault; the load is logged."""
    try:
        network = load_network(path)
    except ModelFileError as error:
        raise RuntimeError(f"QARRAY_MODEL: {error}") from None
    if mesh is None:
        network = jax.tree.map(jnp.asarray, network)
    else:
        network = on_mesh(network, mesh)
    release_freed_memory()
    payload = sum(a.nbytes for a in jax.tree.leaves(network))
    errors = ", ".join(f"{layer.stored_error or 0:.2e}" for layer in network.layers)
    print(  # for whoever reads the server's log
        f"QARRAY_MODEL: {path}: {len(network.layers)} layers, "
        f"{payload / 2**20:.1f} MiB of int8 payload, scales and biases resident, "
        f"weight errors [{errors}]",
        file=sys.stderr,
        flush=True,
    )
    return network
