"""Model files: a quantized network in safetensors, and a converter from PyTorch.

A qarray model file is laid out like the Tesseract's ``layers`` field:

- tensors ``layers.{i}.w`` (float32, dense: quantized when loaded) or
  ``layers.{i}.w_q.qvalue`` (int8) with ``layers.{i}.w_q.scale`` (float32, one
  per row), and an optional ``layers.{i}.bias`` (float32, ``(N,)``);
- string metadata ``layers.{i}.layout`` (``"kn"``: weights ``(K, N)``, the
  default; ``"nk"``: ``(N, K)``, PyTorch's ``nn.Linear.weight``),
  ``layers.{i}.activation`` (default ``"none"``), ``layers.{i}.precision``
  (``"int8"``, the default; ``"int4"``: ``w_q.qvalue`` uint8 ``(N, K / 2)``
  packed and ``w_q.scale`` ``(N, K / G)``, or a dense ``w`` quantized so at
  load; ``"float32"``: ``w`` kept as it is) and ``layers.{i}.group_size``
  (int4; default 128).

Layers are numbered from 0 without gaps and their widths chain. ``load_model``
checks all of it and names the tensor at fault; ``pytorch.convert_state_dict``
turns a PyTorch-style state dict (``fc1.weight`` ``(out, in)``, ``fc1.bias``,
...) into a model file of int8 "nk" layers with one scale per output channel.
``load_network`` / ``save_network`` read and write a ``qarray.tesseract.Network``::

    qarray-serve convert state_dict.safetensors model.safetensors \\
        --layers fc1:relu,fc2:none

Any other equinox model (a CNN, your own) has its model file keyed by its
pytree paths: ``save_tree``, ``load_tree``, ``load_quantized`` (and
``pytorch.convert_tree`` from PyTorch's conv and linear layers, BatchNorm
folded)::

    qarray-serve convert state_dict.safetensors model.safetensors --tree \\
        --fold conv1+bn1,conv2+bn2

Needs the ``safetensors`` package (installed with ``qarray[tesseract]``).
"""

from ._errors import ModelFileError as ModelFileError
from ._network_file import load_model as load_model
from ._network_file import load_network as load_network
from ._network_file import save_model as save_model
from ._network_file import save_network as save_network
from ._tree import load_quantized as load_quantized
from ._tree import load_tree as load_tree
from ._tree import save_tree as save_tree

__all__ = [
    "ModelFileError",
    "load_model",
    "load_network",
    "load_quantized",
    "load_tree",
    "save_model",
    "save_network",
    "save_tree",
]


def __dir__() -> list[str]:
    """The model-file API (not the submodules, ``pytorch`` among them, that
    importing it brings in)."""
    return sorted(__all__)
