"""qarray: int8 quantized arrays as a JAX type (hijax), differentiable everywhere.

The hijax doc's other teaching types (rank-1 matrices, tuples) live in
``qarray.doc_types``.
"""

from . import nn as nn
from ._conv import conv_q as conv_q
from ._jit import jit as jit
from ._primitives import dequantize as dequantize
from ._primitives import linear_q as linear_q
from ._primitives import matmul_q as matmul_q
from ._primitives import pack as pack
from ._primitives import quantize as quantize
from ._primitives import unpack as unpack
from ._qarray import QArray as QArray
from ._qarray import QArrayP as QArrayP
from ._qarray import QArraySpec as QArraySpec
from ._qarray import QArrayTy as QArrayTy

__version__ = "0.1.0"
