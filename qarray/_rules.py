"""The rules that choose how a product runs: one frozen object per platform
and instruction set, holding every number ``_formulations.choose_strategy``
and qarray's CPU kernels decide by.

One owner: ``_formulations`` chooses between the kernels and XLA's
formulations with a rule, and ``_ffi`` passes the kernels the same rule's
thresholds with every call (``Thresholds`` in ``qarray/_cpu/common.h`` has no
numbers of its own). The limits only the kernels know (how many int8 parts a
row and kn dot-tile rows their stack arrays hold) are checked against every
rule here when ``_ffi`` loads the library. A leaf module: it imports nothing
of qarray, so both can read it.

Each number is where a benchmark put it: ``benchmarks.bench_kernels
--strategies`` (weights cold, ``QARRAY_CPU_ISA`` for the other instruction
sets), ``benchmarks.gemm_crossover`` for the GEMM's first rows, ``make bench``
suite int4; docs/kernels.md keeps their tables. A benchmark that moves a
threshold does it through ``overriding``, never by assigning to this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

# "xla": qarray's own kernels (the CPU's C++, the TPU's Pallas) never run,
# XLA's formulations serve every product
KERNELS_ENV = "QARRAY_KERNELS"


def xla_only() -> bool:
    """Whether ``QARRAY_KERNELS=xla`` asks for XLA's formulations only."""
    return os.environ.get(KERNELS_ENV, "").strip().lower() == "xla"


@dataclasses.dataclass(frozen=True)
class ByActivations:
    """One number for each activations mode: weight-only (``float32``) and
    W8A8 (``int8``); ``None``: no limit."""

    float32: int | None
    int8: int | None

    def __getitem__(self, activations: str) -> int | None:
        return getattr(self, activations)


@dataclasses.dataclass(frozen=True)
class KernelRule:
    """Every threshold of one CPU instruction set (qwix's ``QuantizationRule``
    is the model: a frozen value, replaced rather than edited).

    Rows count rows of x; int8 rows count the rows the kernels multiply
    (weight-only: ``split_levels`` parts a row of x, W8A8: one).
    """

    name: str
    # int8 parts representing float32 activations (weight-only): each
    # quantizes what the previous left, (1/254)^3 of a row's max at three:
    # float32 precision, the XLA formulation split_int8 and the kernels alike
    split_levels: int
    # layout kn: int8 rows up to which the dot tiles run (past it: the GEMM)
    kn_dot_int8_rows: int
    # layout nk: int8 rows from which the GEMM runs rather than the dot tiles
    # (the vector sets' GEMM packs panels that stay in L2; AMX's reads the
    # weights straight from their rows, so it leads sooner)
    gemm_rows: int
    # int4 weights: rows of x from which the GEMM runs rather than the dot
    # tiles (AVX-512's tiles pay a table permute per nibble per row pass, the
    # panel one unpack for every row; the 256-bit tiles stay ahead longer)
    int4_gemm_rows: ByActivations
    # rows of x up to which the kernels run at all, past which XLA's int8 dots
    # keep up (None: every row count)
    kernel_max_rows: ByActivations
    # layout nk weight-only past kernel_max_rows still takes the kernel (AMX:
    # its GEMM on the weights' own rows stays ahead of split_int8)
    nk_weight_only_uncapped: bool
    # W8A8 with K up to this: the GEMM at every row count (its chunks' panels
    # stay near L1, ahead of XLA's int8 dot there)
    kernel_short_k: int
    # layout kn packs its weights on every call: past kn_large_weights of them,
    # weight-only's GEMM keeps its lead over split_int8 only to
    # kn_large_max_rows rows (None: at every row count)
    kn_large_weights: int
    kn_large_max_rows: int | None
    # the int4 kernel up to these rows of x, past which dequantizing and one
    # float32 dot keep up
    int4_kernel_max_rows: ByActivations
    # weight-only products with at most this many weights take "dequantize"
    # on CPU (a float32 copy that stays in cache: no weight bytes to save)
    small_weight_elements: int
    # rows of int8 weights the chunked formulation converts to float32 at a
    # time (an f32 chunk near 512 bytes a column beats smaller and larger
    # ones across N on XLA:CPU)
    convert_rows: int

    def int8_rows(self, m: int, activations: str) -> int:
        """The int8 rows the kernels multiply for ``m`` rows of x."""
        return m if activations == "int8" else self.split_levels * m

    def dot_tile_rows(self, layout: str, activations: str) -> int:
        """Rows of x the kernels' dot tiles take (C++'s ``UsesGemm``: nk
        below ``gemm_rows`` int8 rows, kn up to ``kn_dot_int8_rows``)."""
        parts = self.int8_rows(1, activations)
        if layout == "kn":
            return self.kn_dot_int8_rows // parts
        return (self.gemm_rows - 1) // parts

    def thresholds(self, activations: str) -> dict[str, int]:
        """Every threshold the kernels take, by the names of C++'s
        ``Thresholds`` (each handler is passed all of them)."""
        return {
            "split": self.split_levels,
            "gemm_rows": self.gemm_rows,
            "kn_dot_rows": self.kn_dot_int8_rows,
            "int4_gemm_rows": self.int4_gemm_rows[activations],
        }


# --- the CPU instruction sets. The 256-bit sets (AVX2, AVX-VNNI, NEON's
# dotprod and i8mm) share one rule; AVX-512 and AMX differ from it where
# benchmarks.bench_kernels --strategies measured them apart.
OTHER = KernelRule(
    name="other",
    split_levels=3,
    kn_dot_int8_rows=9,
    gemm_rows=8,
    int4_gemm_rows=ByActivations(float32=3, int8=8),
    kernel_max_rows=ByActivations(float32=64, int8=128),
    nk_weight_only_uncapped=False,
    kernel_short_k=2048,
    kn_large_weights=2**21,
    kn_large_max_rows=8,
    int4_kernel_max_rows=ByActivations(float32=256, int8=4096),
    small_weight_elements=1024,
    convert_rows=128,
)
# AVX-512's tiles hold 16 channels a vector: the int4 GEMM leads from two rows
# in both modes, and the kn GEMM keeps its lead, packing included, to
# kernel_max_rows (the backward of linear_q layers under load)
AVX512 = dataclasses.replace(
    OTHER,
    name="avx512",
    int4_gemm_rows=ByActivations(float32=2, int8=2),
    kn_large_max_rows=None,
)
# AMX's GEMM reads the weights from their rows and leads AVX-512's dot tiles
# sooner (benchmarks.gemm_crossover); its int4 products below the GEMM's rows
# are AVX-512's; it packs kn weights like the 256-bit sets
AMX = dataclasses.replace(
    OTHER,
    name="amx",
    gemm_rows=6,
    int4_gemm_rows=AVX512.int4_gemm_rows,
    nk_weight_only_uncapped=True,
)
CPU_RULES = {rule.name: rule for rule in (AMX, AVX512, OTHER)}

# --- accelerators. qarray/_tpu's Pallas kernels on a TPU, where they lead
# XLA's formulations (benchmarks.tpu_kernels, each way and block against
# bf16's dense product; benchmarks.bench_tpu for XLA's and qwix's rows in
# the same shapes; docs/accelerators.md keeps the tables).


@dataclasses.dataclass(frozen=True)
class TpuRule:
    """When and how qarray/_tpu's kernels run on a TPU (off it: never).

    Blocks are (rows of x, output columns, K) upper bounds, K in packed
    bytes for int4; rows count rows of x; the vector unit's are (output
    columns, K).
    """

    name: str
    # weight-only products on int8 weights, either layout: up to these rows
    # the weights stream once at HBM rate into the MXU, x as its one bf16
    # part at the default precision (the pass it asks for) and as int8 parts
    # above it (_tpu.INT8_PARTS); past them the MXU's work, not the weights'
    # bytes, sets the pace and XLA's dequantized dot keeps up
    int8_kernel_max_rows: int
    int8_blocks: tuple[int, int, int]
    # weight-only products on int8 weights, layout nk (linear's), of up to
    # vector_max_rows rows on the vector unit (_tpu._vector, at most 8):
    # float32's products and sums at any precision, within a few percent of
    # the MXU's one bf16 part at one row (docs/accelerators.md)
    vector_max_rows: int
    vector_blocks: tuple[int, int]
    # int4 weights with G a multiple of 128: their bytes read four to a word
    # into the int8 MXU, x as int8 parts (mode "groups", _tpu.reads_bytes),
    # weight-only or W4A8, up to int4_bytes_max_rows; past them XLA's
    # dequantized dot keeps up (blocks: int4_bytes_blocks); weight-only at
    # the default precision, up to int4_bf16_max_rows the shifts below with x
    # as its one bf16 part lead them (benchmarks.tpu_kernels, int4 against
    # int4_bytes); weight-only up to int4_pair_max_rows x's two int8 parts
    # are int8_pair's, whose sums meet in int32 before the group scales
    # (int4_pair against int4_bytes); weight-only at one bf16 pass past
    # int4_bytes_pass_max_rows, the tile kernel below to int4_tile_max_rows
    # (int4_tile_rows against int4_bytes)
    int4_bytes_max_rows: int
    int4_bf16_max_rows: int
    int4_pair_max_rows: int
    int4_bytes_pass_max_rows: int
    int4_bytes_blocks: tuple[int, int, int]
    # other group sizes, weight-only: nibbles unpacked by shifts and each
    # group's sums scaled (mode "groups") up to int4_groups_max_rows; each
    # block dequantized in VMEM (mode "tile") up to int4_tile_max_rows
    int4_groups_max_rows: int
    int4_groups_blocks: tuple[int, int, int]
    int4_tile_max_rows: int
    int4_tile_blocks: tuple[int, int, int]


TPU = TpuRule(
    name="tpu",
    int8_kernel_max_rows=64,
    int8_blocks=(512, 1024, 2048),
    vector_max_rows=1,
    vector_blocks=(256, 8192),
    int4_bytes_max_rows=512,
    int4_bf16_max_rows=1,
    int4_pair_max_rows=64,
    int4_bytes_pass_max_rows=256,
    int4_bytes_blocks=(512, 1024, 2048),
    int4_groups_max_rows=64,
    int4_groups_blocks=(512, 1024, 1024),
    int4_tile_max_rows=512,
    int4_tile_blocks=(1024, 2048, 512),
)

_overrides: dict[str, object] = {}


def _overridden(rule):
    fields = {f.name for f in dataclasses.fields(rule)}
    changes = {k: v for k, v in _overrides.items() if k in fields}
    return dataclasses.replace(rule, **changes) if changes else rule


def for_isa(isa: str | None) -> KernelRule:
    """The rule of a CPU instruction set (``_ffi.isa()``'s names; None or a
    set without a rule of its own: ``OTHER``), with ``overriding``'s
    changes."""
    return _overridden(CPU_RULES.get(isa or OTHER.name, OTHER))


def for_tpu() -> TpuRule:
    """The TPU's rule, with ``overriding``'s changes."""
    return _overridden(TPU)


@contextlib.contextmanager
def overriding(**changes) -> Iterator[None]:
    """Every rule with ``changes`` (``KernelRule`` or ``TpuRule`` field
    names) while the block runs: what a benchmark uses to force a path (e.g.
    ``gemm_rows=1``: the GEMM at every row count). The choice is made when a
    computation is traced: trace inside the block."""
    known = {f.name for rule in (KernelRule, TpuRule) for f in dataclasses.fields(rule)}
    unknown = set(changes) - (known - {"name"})  # a rule's name is what it is
    if unknown:
        raise TypeError(
            f"KernelRule and TpuRule have no field {sorted(unknown)} to override"
        )
    saved = dict(_overrides)
    _overrides.update(changes)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)
