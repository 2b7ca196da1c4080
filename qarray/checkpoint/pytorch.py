"""qarray.checkpoint.pytorch: PyTorch state dicts (safetensors) to qarray
model files.

- ``convert_state_dict``: ``fc1.weight`` ``(out, in)``, ``fc1.bias``, ... to a
  model file of the Tesseract's network (int8 "nk" layers, one scale per
  output channel; int4 or float32 per layer), what ``qarray-serve convert
  SRC DST --layers fc1:relu,fc2:none`` runs;
- ``convert_tree``: any model's conv and linear layers to a model file keyed
  by its pytree paths (``--tree``), BatchNorm folded (``fold_batchnorm``).
"""

from ._convert import convert_state_dict as convert_state_dict
from ._tree import convert_tree as convert_tree
from ._tree import fold_batchnorm as fold_batchnorm
