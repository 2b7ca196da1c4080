"""The hijax doc's other teaching types, not part of the quantization API.

``Rank1`` (an m x n matrix kept as ``col (x) row``, with ``outer``, ``factors``
and ``matmul_r1``) and ``HiTup`` (a tuple of any JAX values, hi types included,
with ``make_tup``, ``get_tuple_element`` and the ``TupSpec`` mapping spec): the
doc's worked examples of a hi type, kept as tested references for the same
machinery QArray uses. Import them from here::

    from qarray.doc_types import make_tup, outer
"""

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
