"""qarray.nn: quantized layers as equinox modules, and quantized copies of
equinox models.

    import equinox as eqx, jax, qarray.nn as qnn
    mlp = eqx.nn.MLP(64, 10, 256, depth=3, key=jax.random.key(0))
    served = qnn.quantize(mlp)                  # int8 weights, stored
    qat = qnn.quantize(mlp, trainable=True)     # float32, quantized every call
    exported = qnn.freeze(qat)                  # after training: int8
    cnn = qnn.quantize(my_cnn)                  # eqx.nn.Conv layers too
    unet = qnn.quantize(my_unet)                # and ConvTranspose, Embedding, ...
    report = qnn.plan(mlp, x, budget=0.01)      # a precision per layer
    mixed = qnn.apply_plan(mlp, report)         # int4 / int8 / float32 layers
"""

from ._accuracy import evaluate as evaluate
from ._config import QuantConfig as QuantConfig
from ._conv import Conv as Conv
from ._conv import ConvTranspose as ConvTranspose
from ._embedding import Embedding as Embedding
from ._kinds import FLOAT_LAYERS as FLOAT_LAYERS
from ._linear import Linear as Linear
from ._lora import Adapter as Adapter
from ._lora import LoRA as LoRA
from ._lora import adapter_shapes as adapter_shapes
from ._lora import lora as lora
from ._lora import lora_spec as lora_spec
from ._lora import merge as merge
from ._lora import with_adapters as with_adapters
from ._plan import apply_plan as apply_plan
from ._plan import plan as plan
from ._quantize import freeze as freeze
from ._quantize import quantize as quantize
from ._spectral import SpectralConv as SpectralConv
from ._spectral import kept_frequencies as kept_frequencies
