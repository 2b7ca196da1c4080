"""``QARRAY_MESH``: every device of a host, with explicit sharding."""

from __future__ import annotations

import re

import jax
from jax.sharding import AxisType, NamedSharding

from ..network import Network

DATA, MODEL = "data", "model"


def make_mesh(spec: str) -> jax.sharding.Mesh:
    """The device mesh ``spec`` names: ``"auto"`` (every local device on
    ``data``) or ``"data=D,model=M"``; axes ("data", "model"), explicit."""
    devices = jax.local_devices()
    found = f"found {len(devices)} local {devices[0].platform} device(s)"
    match = re.fullmatch(r"data=(\d+),model=(\d+)", spec.replace(" ", ""))
    if spec == "auto":
        data, model = len(devices), 1
    elif match:
        data, model = int(match.group(1)), int(match.group(2))
    else:
        raise ValueError(
            f"QARRAY_MESH must be 'auto' or 'data=D,model=M', got {spec!r} ({found})"
        )
    if data < 1 or model < 1 or data * model != len(devices):
        raise ValueError(
            f"QARRAY_MESH={spec} needs data * model = {data * model} devices, "
            f"{found}: use data * model = {len(devices)}, or 'auto'"
        )
    return jax.make_mesh(
        (data, model),
        (DATA, MODEL),
        axis_types=(AxisType.Explicit, AxisType.Explicit),
        devices=devices,
    )


def on_mesh(network: Network, mesh: jax.sharding.Mesh) -> Network:
    """``network`` placed once on ``mesh``: each device keeps its share of
    every layer's output channels; it then runs with rows over ``data``."""

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    layers = [layer.placed(put, MODEL) for layer in network.layers]
    return Network(layers, network.activation, mesh_axes=(DATA, MODEL))
