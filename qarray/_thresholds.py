"""The thresholds that choose a path inside qarray's CPU kernels.

One owner: ``_ffi`` passes them to the kernels with every call (``Thresholds``
in ``qarray/_cpu/common.h``, whose handlers check their range), and
``_kernels`` chooses between the kernels and XLA's formulations with the
same numbers. A leaf module (it imports nothing of qarray), so that both can
read it. Measured with ``make bench`` (suites kernels --strategies and int4,
weights cold, with ``QARRAY_CPU_ISA`` for the other instruction sets);
docs/kernels.md keeps the figures.
"""

# int8 parts representing float32 activations (weight-only): (1/254)^3 ~ 6e-8
# of a row's max, the XLA formulation's split_int8 and the kernels alike
SPLIT_LEVELS = 3

# layout kn's integer dot products: int8 rows (parts) at most (the kernels'
# kMaxKnDotRows bounds it)
KN_DOT_INT8_ROWS = 9
# rows of x up to which the kernels' dot-product tiles run
KERNEL_TILE_ROWS = {
    ("nk", "float32"): 2,
    ("nk", "int8"): 8,
    ("kn", "float32"): KN_DOT_INT8_ROWS // SPLIT_LEVELS,
    ("kn", "int8"): KN_DOT_INT8_ROWS,
}
# int8 rows (weight-only: SPLIT_LEVELS parts a row) from which the kernels run
# their GEMM rather than their dot tiles (ahead of XLA's int8 dots and of
# split_int8 from there, layout nk), by instruction set: the vector sets' GEMM
# packs panels that stay in L2; AMX's reads the weights straight from their
# rows and leads AVX-512's dot tiles from 6 int8 rows (level at 4:
# benchmarks.gemm_crossover, weights cold, docs/kernels.md)
KERNEL_GEMM_ROWS = {"amx": 6, "other": 8}

# rows of x from which the int4 kernel runs its GEMM rather than its dot
# tiles, by instruction set and activations. The AVX-512 tiles pay a table
# permute per nibble per row pass, the panel one unpack for every row: the
# GEMM leads from two rows in both modes. The 256-bit tiles (AVX2, NEON) stay
# ahead to 8 int8 rows (W4A8: 8 rows, weight-only: 3, its three parts a row).
INT4_GEMM_ROWS = {
    "amx": {"float32": 2, "int8": 2},  # below it, AVX-512's tiles run
    "avx512": {"float32": 2, "int8": 2},
    "other": {"float32": 3, "int8": 8},
}
