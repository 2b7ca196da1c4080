"""qarray.network: the Tesseract contract's network, below both the model
files (``qarray.checkpoint``) and the servers (``qarray.tesseract``), which
import it and which it imports neither of.

- ``Network``: the ``layers`` field (or a resident ``QARRAY_MODEL``) as an
  equinox module of ``qarray.nn.Linear`` layers, with each layer's
  activation (``ACTIVATIONS``);
- the shape rules, one function for declared and traced shapes
  (``network_shape``, ``layer_shapes``, ``linear_shapes``: ``LayerShapes``,
  ``NetworkShape``; ``check_adapter_shapes``), their errors named by the
  contract's paths; the contract's vocabulary (``LAYOUTS``, ``PRECISIONS``,
  ``DEFAULT_GROUP_SIZE``).

``qarray.tesseract.Network`` and ``qarray.tesseract.internal``'s names are
these, re-exported where they were first published.
"""

from ._network import ACTIVATIONS as ACTIVATIONS
from ._network import Network as Network
from ._shapes import DEFAULT_GROUP_SIZE as DEFAULT_GROUP_SIZE
from ._shapes import LAYOUTS as LAYOUTS
from ._shapes import PRECISIONS as PRECISIONS
from ._shapes import LayerShapes as LayerShapes
from ._shapes import NetworkShape as NetworkShape
from ._shapes import check_adapter_shapes as check_adapter_shapes
from ._shapes import layer_shapes as layer_shapes
from ._shapes import linear_shapes as linear_shapes
from ._shapes import network_shape as network_shape
