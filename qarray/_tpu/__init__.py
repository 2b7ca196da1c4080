"""qarray's Pallas kernels for TPUs (beside ``qarray/_cpu``'s C++ kernels for
CPUs): each runs compiled on a TPU and in Pallas' interpreter elsewhere (the
tests, on CPU)."""

from ._weight_only import parts_for as parts_for
from ._weight_only import weight_only_product as weight_only_product
