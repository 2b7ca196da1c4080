"""qarray: int8 quantized arrays as a JAX type (hijax), differentiable everywhere."""

from ._ops import dequantize as dequantize
from ._ops import linear_q as linear_q
from ._ops import matmul_q as matmul_q
from ._ops import pack as pack
from ._ops import quantize as quantize
from ._ops import unpack as unpack
from ._qarray import QArray as QArray
from ._qarray import QArrayP as QArrayP
from ._qarray import QArraySpec as QArraySpec
from ._qarray import QArrayTy as QArrayTy
from ._rank1 import Rank1 as Rank1
from ._rank1 import Rank1Ty as Rank1Ty
from ._rank1 import factors as factors
from ._rank1 import matmul_r1 as matmul_r1
from ._rank1 import outer as outer
from ._tuple import HiTup as HiTup
from ._tuple import TupSpec as TupSpec
from ._tuple import TupTy as TupTy
from ._tuple import get_tuple_element as get_tuple_element
from ._tuple import make_tup as make_tup

__version__ = "0.1.0"
