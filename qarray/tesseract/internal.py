"""The rest of ``qarray.tesseract``: what its own modules, the top-level
``tesseract_api.py`` and the tests share, without a promise of stability
(as ``equinox.internal``). Names load on first use."""

from ._lazy import lazy_names

_WHERE = {
    # the contract's network (qarray.network): activations, layouts, precisions,
    # shape rules
    "ACTIVATIONS": "..network",
    "LAYOUTS": "..network",
    "PRECISIONS": "..network",
    "DEFAULT_GROUP_SIZE": "..network",
    "LayerShapes": "..network",
    "NetworkShape": "..network",
    "check_adapter_shapes": "..network",
    "layer_shapes": "..network",
    "linear_shapes": "..network",
    "network_shape": "..network",
    # request checks and their 422s
    "NetworkRequest": "._request",
    "checked_vectors": "._request",
    "given_paths": "._request",
    "request_dict": "._request",
    "unprocessable": "._request",
    "declared_shape": "._limits",
    "first_index": "._limits",
    "quantized_payload": "._limits",
    "require_at_least": "._limits",
    "require_finite": "._limits",
    "lookup_path": "._paths",
    # serving machinery
    "Batcher": "._batcher",
    "ResidualCache": "._cache",
    "RequestGuard": "._guard",
    "binref_problem": "._guard",
    "check_body": "._guard",
    "make_mesh": "._mesh",
    "on_mesh": "._mesh",
    "load_resident": "._resident",
    "keep_freed_memory": "._memory",
    "SettingsError": "._settings",
    "install_gradient_path_check": "._workarounds",
}
__all__ = list(_WHERE)
__getattr__, __dir__ = lazy_names(__name__, _WHERE)
del lazy_names
