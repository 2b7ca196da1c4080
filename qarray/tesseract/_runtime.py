"""The runtime of a qarray Tesseract: settings, mesh, resident model, cache."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax

from ..network import LayerShapes, Network, NetworkShape, linear_shapes, network_shape
from ._batcher import Batcher
from ._cache import ResidualCache
from ._limits import Limits
from ._mesh import make_mesh
from ._resident import load_resident
from ._settings import Settings
from ._shared_weights import load_shared, shared_folder


@dataclass(frozen=True)
class Runtime:
    """Everything a Tesseract's endpoints hold besides the request (the
    batcher every computation goes through included): built
    once per API module at import (``RUNTIME = Runtime.from_env()``), so a
    bad setting or model file stops start-up with a message naming it."""

    settings: Settings
    limits: Limits
    cache: ResidualCache
    batcher: Batcher
    mesh: jax.sharding.Mesh | None = None
    resident: Network | Any | None = None

    @functools.cached_property
    def resident_shapes(self) -> tuple[LayerShapes, ...]:
        """The resident network's layer shapes (``network_shape``'s input),
        read once: the resident model never changes, and reading an equinox
        module's fields costs more than a small request's product."""
        return tuple(linear_shapes(layer) for layer in self.resident.layers)

    @functools.cached_property
    def resident_network_shape(self) -> Callable[[tuple[int, ...]], NetworkShape]:
        """``resident_network_shape(x)``: ``network_shape(x, resident_shapes)``,
        found once per shape of x (every request on the resident model checks
        it, twice: a visible part of a one-row apply's Python under load;
        bounded, the shapes a client sends being its own choice); a
        ValueError as ``network_shape`` raises it."""
        return functools.lru_cache(maxsize=256)(
            lambda x: network_shape(x, self.resident_shapes)
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Runtime:
        """From the ``QARRAY_*`` variables: with ``QARRAY_MESH``, the mesh is
        set for every computation of this process (``jax.set_mesh``: explicit
        sharding, propagated by qarray's typing rules); with ``QARRAY_MODEL``,
        the model is loaded, quantized and placed."""
        return cls.from_settings(Settings.from_env(environ))

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        load_model: Callable[[str, jax.sharding.Mesh | None], Any] = load_resident,
    ) -> Runtime:
        """``load_model(path, mesh)`` loads ``settings.model`` (default: the
        Tesseract contract's network; ``ModelTesseract`` gives its own); the
        workers of one ``qarray-serve serve --num-workers N`` map one copy
        of it (``_shared_weights``; not on a mesh, whose placement is each
        process's own)."""
        mesh = make_mesh(settings.mesh) if settings.mesh else None
        if mesh is not None:
            jax.set_mesh(mesh)
        resident = None
        if settings.model:
            folder = shared_folder()
            if folder is not None and mesh is None:
                resident = load_shared(
                    settings.model, lambda: load_model(settings.model, None), folder
                )
            else:
                resident = load_model(settings.model, mesh)
        cache = ResidualCache(
            settings.vjp_cache_size,
            settings.vjp_cache_min_flops,
            settings.vjp_cache_min_intensity,
        )
        batcher = Batcher(
            settings.max_batch_rows,
            settings.batch_wait_ms,
            settings.max_concurrency,
            # the mesh is the setting thread's: computations run on others
            contextlib.nullcontext if mesh is None else lambda: jax.set_mesh(mesh),
        )
        return cls(settings, Limits(settings), cache, batcher, mesh, resident)
