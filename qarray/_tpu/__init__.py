"""qarray's Pallas kernels for TPUs (beside ``qarray/_cpu``'s C++ kernels for
CPUs): each runs compiled on a TPU and in Pallas' interpreter elsewhere (the
tests, on CPU)."""

from .._numerics import as_int4 as as_int4
from ._available import available as available
from ._int4 import int4_product as int4_product
from ._int4 import reads_bytes as reads_bytes
from ._int4 import takes_pair as takes_pair
from ._int8 import int8_product as int8_product
from ._parts import INT8_PARTS as INT8_PARTS
from ._parts import parts_for as parts_for
from ._vector import VECTOR_MAX_ROWS as VECTOR_MAX_ROWS
from ._vector import int8_vector as int8_vector
