"""The XLA formulations behind the primitives' ``expand``, and the choice
between them and qarray's kernels (``choose_strategy``).

Everything here takes and returns plain arrays (lojax): the primitives own
the types, these functions own the arithmetic and the choice of formulation;
every number the choice uses is a rule's (``_rules``).

How ``matmul_q`` computes ``x[m, k] @ (qvalue[k, n] * scale[k])``
-----------------------------------------------------------------
The per-row weight scales run along the contraction axis, so they always fold
into ``x`` first (``v = x * scale``) and the product runs against the int8
payload. How it runs is a deterministic function of the static shapes, the
``activations`` mode and the backend (``choose_strategy``):

========== ================================ =========================================
strategy   what                             why / accuracy
========== ================================ =========================================
chunked    K in chunks (the rule's          XLA:CPU never fuses an int8 -> f32 convert
           ``convert_rows``): each chunk's  into a dot: a whole-matrix convert writes a
           int8 rows converted to f32 and   full f32 copy (4x the int8 bytes). Chunks
           multiplied, accumulated in f32   keep the copy in cache. Exact f32 math.
           (``lax.scan``)
split_int8 ``v`` split per row into three   One int8 x int8 -> int32 product (parts'
           int8 parts, each quantizing      rows stacked), the fast int8 kernel. ``v``
           what the previous left           is kept to ~1e-7 of each row's largest
           (``v ~ a1 q1 + a2 q2 + a3 q3``)  entry: float32 precision, so the product
                                            is as smooth in ``x`` as a float32 one
                                            (finite differences agree with the
                                            gradients at any step).
int8_dot   (``activations="int8"``) ``v``   int8 x int8 -> int32, rows padded to a
           quantized per row, one int8 dot  multiple of 8 (XLA:CPU's int8 kernel is
                                            slow for a single row).
dequantize ``v @ qvalue.astype(f32)``       Backends that fuse the convert into the
                                            dot (GPU); the reference formulation.
pallas     (TPU) qarray/_tpu's kernel: the  Few rows are bound by the weights' bytes,
           int8 weights streamed once into  read once. At the default precision ``v``
           the MXU, ``v`` as its one bf16   is its one bf16 part (the pass asked for;
           part or as int8 parts            the weights are exact in bf16); above it
                                            int8 parts (``_tpu.INT8_PARTS``) at least
                                            as fine as the bf16 passes asked for.
vector     (TPU, layout nk) qarray/_tpu's   One row uses each weight once: the MXU
           vector-unit kernel: the weights  takes them in no faster than they
           converted to float32 in VMEM,    arrive, the vector unit keeps up;
           multiplied by ``v``'s row        float32's products and sums (~1e-7)
                                            at any precision.
========== ================================ =========================================

Weight-only products keep the activations at the precision asked for: on CPU
float32's at any precision, so the only approximation is the weights'
quantization (two int8 parts, or ``v`` in bf16, are faster again at some
shapes, but their relative noise on the activations breaks finite-difference
checks of the exact gradients; docs/performance-notes.md records what they
measured); on a TPU, as its dots, one bf16 pass over ``v`` at the default
precision and finer passes as asked.

Operands sharded over explicit mesh axes take the ``dequantize`` / plain int8
formulations, which keep every axis in place for sharding propagation. On CPU:
``chunked`` for a single row, either mode (bandwidth-bound; no full f32 copy of
the weights); more rows: ``split_int8`` (weight-only) or ``int8_dot``, except
weight-only products with tiny weights (the rule's ``small_weight_elements``),
which take ``dequantize``: they read x, and have no weight bytes to save.
On a TPU: ``vector`` for weight-only ``linear`` products up to the TPU rule's
``vector_max_rows``, then ``pallas`` up to its ``int8_kernel_max_rows`` (where
its kernels compile: ``_tpu.available``),
else ``dequantize`` and ``int8_dot``, as elsewhere. The benchmarks behind
these choices: ``benchmarks.bench_kernels --strategies``, ``make bench`` and,
on the chip, ``benchmarks.tpu_kernels``.

How ``linear_q`` computes ``x[m, k] @ (qvalue[n, k] * scale[n, None])^T``
------------------------------------------------------------------------
Weights stored ``(out, in)`` with one scale per output channel: the scales run
along the *output* axis and factor out of the product, ``y = (x @ qvalue^T) *
scale``, so nothing folds into ``x``. With ``activations="int8"``, ``x`` is
quantized per row as it is (``y = int32(xq @ qvalue^T) * sx * scale``): its
error is the size of the weights' own, sqrt(2) of weight-only in all.

The same strategies, chosen by the same rule (``choose_strategy``), each
contracting both operands' last axes: ``chunked`` converts chunks of
``convert_rows`` output channels (rows of ``qvalue``), each giving a block of
output columns; ``split_int8`` and ``int8_dot`` run one int8 dot;
``dequantize`` converts the whole payload. For a single row the chunks are
steady while the int8 dots (an int8 product padded to 8 rows is compute-bound)
swing with the machine's load; for more the int8 dots win, as for matmul_q
(``make bench``, suite matmul).

The two products are each other's transposes (``g @ W`` for W stored ``(n, k)``
is matmul_q's product): each primitive's backward for ``x`` is the other's
weight-only forward, so both backwards also run on the int8 payload.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from . import _ffi, _rules
from ._numerics import (
    INT32_EXACT_TERMS,
    dequantize_groups,
    dequantize_groups_bf16,
    dequantize_rows,
    quantize_rows,
)
from ._qarray import kind_of_parts

# lhs[m, k] . rhs[k, n]: contract lhs's columns with rhs's rows (matmul_q)
_ROWS_BY_COLS = (((1,), (0,)), ((), ()))
# lhs[m, k] . rhs[n, k]: contract both operands' last axes (linear_q)
_LAST_BY_LAST = (((1,), (1,)), ((), ()))

WEIGHT_ONLY_STRATEGIES = ("kernel", "chunked", "split_int8", "dequantize", "pallas")
INT8_STRATEGIES = ("kernel", "chunked", "int8_dot")


def quantize(x):
    """``quantize_rows(x)`` through qarray's CPU kernel where it runs (each
    row read from memory once, where XLA reads x twice: make bench, suite
    kernels, quantize rows), else as written there."""
    if x.size == 0 or _explicitly_sharded(x) or not _ffi.available():
        return quantize_rows(x)
    lead, n = x.shape[:-1], x.shape[-1]

    def kernel():
        qvalue, scale = _ffi.quantize_rows(x.reshape(-1, n))
        return qvalue.reshape(x.shape), scale.reshape(lead)

    return lax.platform_dependent(cpu=kernel, default=lambda: quantize_rows(x))


def kernel_wins(m: int, k: int, n: int, activations: str, layout: str) -> bool:
    """Whether the CPU kernel is the faster formulation, by the rule of the
    instruction set that runs (``_ffi.rule()``): its dot tiles for a few rows,
    then its GEMM up to the rows past which XLA's int8 dots keep up."""
    rule = _ffi.rule()
    if m <= rule.dot_tile_rows(layout, activations):
        return True
    cap = rule.kernel_max_rows[activations]
    if layout == "nk" and activations == "float32" and rule.nk_weight_only_uncapped:
        cap = None
    if activations == "int8" and k <= rule.kernel_short_k:
        cap = None
    large_kn = layout == "kn" and activations == "float32"
    if (
        large_kn
        and k * n > rule.kn_large_weights
        and rule.kn_large_max_rows is not None
    ):
        cap = rule.kn_large_max_rows
    too_many = cap is not None and m > cap
    return rule.int8_rows(m, activations) >= rule.gemm_rows and not too_many


def choose_strategy(
    m: int,
    k: int,
    n: int,
    activations: str,
    platform: str,
    layout: str = "kn",
    kernels: bool | None = None,
) -> str:
    """The formulation ``matmul`` (x[m, k] @ q8[k, n], layout "kn") and
    ``linear`` (x[m, k] @ q8[n, k]^T, "nk") use (see module doc).
    ``kernels``: whether qarray's own kernels run here (default: ``_ffi``'s
    on CPU, ``_tpu``'s on a TPU)."""
    if platform == "tpu":
        if kernels is None:
            kernels = _tpu_available() and not _partitioned()
        rule = _rules.for_tpu()
        if kernels and activations == "float32":
            vector_rows = min(rule.vector_max_rows, _tpu_module().VECTOR_MAX_ROWS)
            if layout == "nk" and m <= vector_rows:
                return "vector"
            if m <= rule.int8_kernel_max_rows:
                return "pallas"
    if platform != "cpu":
        return "int8_dot" if activations == "int8" else "dequantize"
    if kernels is None:
        kernels = _ffi.available()
    if kernels and kernel_wins(m, k, n, activations, layout):
        return "kernel"
    small = _ffi.rule().small_weight_elements
    if activations == "float32" and k * n <= small:
        # no weight bytes to save: the product reads x, and the three int8
        # parts of split_int8 would write and read it three times more
        # (make bench, suite served)
        return "dequantize"
    if m == 1:
        return "chunked"
    return "int8_dot" if activations == "int8" else "split_int8"


def matmul(x, qvalue, scale, activations="float32", strategy=None, *, precision=None):
    """x f32[..., k] @ (qvalue int8[k, n] * scale f32[k]) -> f32[..., n].

    ``activations="int8"`` quantizes ``x * scale`` per row first.
    ``precision``: the float dots' (``lax.dot_general``'s), for the
    formulations that run one (``dequantize``; the others are float32-exact).
    ``strategy`` forces a formulation (tests, benchmarks); by default
    ``choose_strategy`` picks one per backend at lowering time.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = qvalue.shape[1]
    m = math.prod(lead)
    if _explicitly_sharded(x) or _explicitly_sharded(qvalue):
        return _sharded(x * scale, qvalue, activations, 0, precision)
    x2 = x.reshape(m, k)

    def run(strategy):
        if strategy == "kernel":  # the scales fold in inside the kernel
            return _ffi.product(x2, qvalue, scale, kn=True, int8=activations == "int8")
        v = x2 * scale  # per-row weight scales fold into x
        if activations == "int8":
            return _int8_activations(*quantize_rows(v), qvalue, strategy)
        return _weight_only(v, qvalue, strategy, precision=precision)

    y = _by_platform(run, (m, k, n, activations), strategy, layout="kn")
    return y.reshape(*lead, n)


def linear(
    x,
    qvalue,
    scale,
    activations="float32",
    strategy=None,
    *,
    precision=None,
    bf16_x=False,
):
    """x f32[..., k] @ (qvalue int8[n, k] * scale f32[n, None])^T -> f32[..., n].

    The per-output-channel scales factor out: ``(x @ qvalue^T) * scale``.
    ``activations="int8"`` quantizes ``x`` per row first (``sx``):
    ``int32(xq @ qvalue^T) * sx[:, None] * scale``. ``precision`` and
    ``strategy`` as ``matmul``'s. ``bf16_x``: x's values are bf16's (a bf16
    x, upcast), so one bf16 part of x is all of it (``_weight_only``).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = qvalue.shape[0]
    m = math.prod(lead)
    if _explicitly_sharded(x) or _explicitly_sharded(qvalue):
        return _sharded(x, qvalue, activations, 1, precision) * scale
    x2 = x.reshape(m, k)  # nothing folds in: the scales multiply the output

    def run(strategy):
        if strategy == "kernel":  # the scales multiply inside the kernel
            return _ffi.product(x2, qvalue, scale, kn=False, int8=activations == "int8")
        if activations == "int8":
            xq, xs = quantize_rows(x2)
            y = _int8_activations(xq, xs, qvalue, strategy, dims=_LAST_BY_LAST)
        else:
            y = _weight_only(x2, qvalue, strategy, _LAST_BY_LAST, precision, bf16_x)
        return y * scale

    y = _by_platform(run, (m, k, n, activations), strategy, layout="nk")
    return y.reshape(*lead, n)


def linear_int4(
    x,
    packed,
    scale,
    activations="float32",
    strategy=None,
    *,
    precision=None,
    bf16_x=False,
):
    """x f32[..., k] @ W^T with int4 weights W[n, k] (packed uint8[n, k / 2],
    one scale per group along k: f32[n, k / G]) -> f32[..., n].

    ``activations="int8"`` (W4A8) quantizes each row of x first (``xq``,
    ``sx``, as ``quantize_rows``): ``y = sx[:, None] * (xq @ W^T)``.
    ``"kernel"``: qarray's CPU kernel (its dot tiles below the rule's
    ``int4_gemm_rows`` rows of x, then the int8 GEMM with the nibbles unpacked
    into its panel and each group's sums scaled in the tile), chosen up to the
    rule's ``int4_kernel_max_rows`` (``make bench``, suite int4);
    ``"dequantize"``: W in float32, then one dot (the reference formulation,
    and what runs elsewhere); ``"int4_bf16"`` (weight-only): W rounded to
    bf16 as ``dequantize_groups_bf16`` reads it, x rounded to bf16, one bf16
    dot summing in float32 (the default precision's one pass, which XLA's
    dot on a TPU takes: ``int4_tpu_strategy``); ``"pallas_groups"`` and
    ``"pallas_tile"``: the TPU's kernels. ``bf16_x`` as ``linear``'s, where
    a bf16 x is one bf16 part of the TPU's kernel: exact, except on the
    bytes kernel (G a multiple of 128), which takes x as int8 parts whatever
    its dtype.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = packed.shape[0]
    m = math.prod(lead)
    if _explicitly_sharded(x) or _explicitly_sharded(packed):
        if activations == "int8":
            xq, xs = quantize_rows(x)
            x = xq.astype(jnp.float32) * xs[..., None]
        dims = (((x.ndim - 1,), (1,)), ((), ()))
        w = dequantize_groups(packed, scale)
        return lax.dot_general(x, w, dims, precision=precision)
    if k == 0:  # an empty contraction sums to 0 (the kernels take no empty K)
        return jnp.zeros((*lead, n), jnp.float32)
    x2 = x.reshape(m, k)

    def run(strategy):
        if strategy == "kernel":
            return _ffi.product_int4(x2, packed, scale, int8=activations == "int8")
        if strategy in ("pallas_groups", "pallas_tile"):
            _, group = kind_of_parts(packed, scale)
            mode = strategy.removeprefix("pallas_")
            tpu = _tpu_module()
            parts = tpu.parts_for(precision, jax.default_backend())
            one_bf16_pass = parts == 1 and m <= _rules.for_tpu().int4_bf16_max_rows
            bytes_kernel = mode == "groups" and tpu.reads_bytes(group, "int8")
            if activations == "int8":  # one int8 part: quantize_rows(x)
                if mode != "groups":
                    raise ValueError(f"{strategy} is weight-only: activations int8")
                mxu, parts = "int8", 1
            elif bytes_kernel and not one_bf16_pass:
                # a bf16 x too: its int8 parts are finer than the bf16
                # pass the default asks for, and the bytes kernel leads the
                # bf16 forms past int4_bf16_max_rows (benchmarks.tpu_kernels,
                # int4 and int4_bytes)
                mxu, parts = "int8", tpu.INT8_PARTS[parts]
            else:  # a bf16 x is its own one bf16 part: exact
                mxu, parts = "bf16", 1 if bf16_x else parts
            pair = (
                bytes_kernel
                and mxu == "int8"
                and parts == 2
                and tpu.takes_pair(group)
                and m <= _rules.for_tpu().int4_pair_max_rows
            )
            return tpu.int4_product(
                x2,
                packed,
                scale,
                group_size=group,
                mode=mode,
                mxu=mxu,
                parts=parts,
                pair=pair,
                interpret=not _tpu_available(),  # forced where none compile
            )
        if strategy == "int4_bf16":
            if activations == "int8":
                raise ValueError("int4_bf16 is weight-only: activations int8")
            w = dequantize_groups_bf16(packed, scale)
            v = x2.astype(jnp.bfloat16)
            return lax.dot_general(
                v, w, _LAST_BY_LAST, preferred_element_type=jnp.float32
            )
        if strategy == "dequantize":
            v = x2
            if activations == "int8":
                xq, xs = quantize_rows(x2)
                v = xq.astype(jnp.float32) * xs[:, None]
            w = dequantize_groups(packed, scale)
            return lax.dot_general(v, w, _LAST_BY_LAST, precision=precision)
        raise ValueError(f"unknown int4 strategy {strategy!r}")

    if strategy is None:
        _, group = kind_of_parts(packed, scale)
        kernel = (
            _ffi.available()
            and m <= _ffi.rule().int4_kernel_max_rows[activations]
            and group % 32 == 0
        )
        cpu = "kernel" if kernel else "dequantize"
        tpu = "dequantize"
        if _on_tpu():
            parts = int4_tpu_parts(precision)
            tpu = int4_tpu_strategy(m, group, activations, parts)
        if cpu == tpu == "dequantize":
            y = run("dequantize")
        else:
            y = lax.platform_dependent(
                cpu=lambda: run(cpu),
                tpu=lambda: run(tpu),
                default=lambda: run("dequantize"),
            )
    else:
        y = run(strategy)
    return y.reshape(*lead, n)


def int4_tpu_parts(precision) -> int:
    """bf16 parts an int4 product at ``precision`` takes on a TPU: the finer
    of x's and the weights' (``int4_bf16`` rounds the dequantized weights to
    bf16 as well as x)."""
    pair = precision if isinstance(precision, tuple) else (precision,)
    return max(_tpu_module().parts_for(p, "tpu") for p in pair)


def int4_bf16_on_tpu(precision) -> bool:
    """Whether products run on a TPU here and an int4 product at
    ``precision`` takes one bf16 pass there (``int4_bf16``'s read of the
    weights, the VJP's product for x included)."""
    return _on_tpu() and int4_tpu_parts(precision) == 1


def int4_tpu_strategy(m: int, group: int, activations: str, parts: int) -> str:
    """The strategy an int4 product of ``m`` rows takes on a TPU at a
    precision of ``parts`` bf16 parts (the finer of x's and the weights',
    ``_tpu.parts_for``): a kernel by the TPU rule (``"pallas_groups"`` /
    ``"pallas_tile"``); else XLA's, weight-only at one bf16 pass
    ``"int4_bf16"`` (the bytes bitcast to jnp.int4: a relayout of the
    weights in device memory, and still ahead of ``dequantize``'s shifts at
    every row benchmarks.bench_tpu timed, docs/accelerators.md) and
    ``"dequantize"`` otherwise."""
    xla = "int4_bf16" if activations == "float32" and parts == 1 else "dequantize"
    rule = _rules.for_tpu()
    if not _int4_kernels_run(group):
        return xla
    if _tpu_module().reads_bytes(group, "int8"):
        one_pass = activations == "float32" and parts == 1
        if one_pass and rule.int4_bytes_pass_max_rows < m <= rule.int4_tile_max_rows:
            return "pallas_tile"
        return "pallas_groups" if m <= rule.int4_bytes_max_rows else xla
    if activations != "float32":
        return xla
    if m <= rule.int4_groups_max_rows:
        return "pallas_groups"
    if m <= rule.int4_tile_max_rows:
        return "pallas_tile"
    return xla


def int4_cotangent_kernel(m: int, group: int) -> bool:
    """Whether the VJP's int4 product for x (``y_bar @ W``, ``m`` rows of
    y_bar) at one bf16 pass on a TPU takes the tile kernel (``nk=False``:
    each block of weights dequantized in VMEM), up to the TPU rule's
    ``int4_tile_max_rows``; else bf16 blocks read as ``int4_bf16`` reads the
    weights (a relayout of them in device memory, which dominated at few
    rows: docs/accelerators.md)."""
    return _int4_kernels_run(group) and m <= _rules.for_tpu().int4_tile_max_rows


def _int4_kernels_run(group: int) -> bool:
    """Whether the TPU's int4 kernels run here for groups of ``group``
    (G / 2 divides 128 or is a multiple of it, kernels that compile, no
    partitioned mesh)."""
    half = group // 2
    fits = half > 0 and group % 2 == 0 and (128 % half == 0 or half % 128 == 0)
    return fits and _tpu_available() and not _partitioned()


def _by_platform(run, problem, strategy, layout):
    """``run(strategy)``, or the strategy ``choose_strategy(*problem, platform,
    layout)`` picks per backend, resolved when the computation is lowered."""
    if strategy is not None:
        return run(strategy)
    cpu, other = (choose_strategy(*problem, p, layout) for p in ("cpu", "gpu"))
    # a TPU's own choice only where one is attached: tracing its kernels
    # elsewhere would cost every CPU trace for a branch that never lowers
    tpu = choose_strategy(*problem, "tpu", layout) if _on_tpu() else other
    if cpu == other == tpu:
        return run(cpu)
    return lax.platform_dependent(
        cpu=lambda: run(cpu), tpu=lambda: run(tpu), default=lambda: run(other)
    )


def _on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def _tpu_module():
    # imported on first use: Pallas adds a fifth to `import qarray`'s time
    from . import _tpu

    return _tpu


def _tpu_available() -> bool:
    """Whether qarray/_tpu's kernels compile here (never off a TPU)."""
    return _on_tpu() and _tpu_module().available()


def _partitioned() -> bool:
    """Whether the computation being traced may be partitioned over several
    devices by XLA: more than one device in the process, outside shard_map
    (inside it, each device runs the kernel on its own block). A Pallas
    kernel is one device's program: XLA would gather its operands, the
    weights included, to every device. jit's ``in_shardings`` are not seen
    at trace time, so any second device counts."""
    if jax.device_count() == 1:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    manual = jax.sharding.AxisType.Manual
    return mesh.empty or any(
        size > 1 and kind != manual
        for size, kind in zip(mesh.axis_sizes, mesh.axis_types, strict=True)
    )


def _explicitly_sharded(a) -> bool:
    """Whether ``a``'s type partitions an axis over an explicit mesh axis."""
    return any(p is not None for p in jax.typeof(a).sharding.spec)


def _sharded(v, qvalue, activations, w_axis, precision=None):
    """The plain formulations, rank kept, contracting v's last axis with
    qvalue's ``w_axis``: explicit sharding propagates through them as the
    typing rule declared (rows like x's, the other axis like qvalue's), where
    padding, stacking or reshaping rows would need resharding."""
    dims = (((v.ndim - 1,), (w_axis,)), ((), ()))
    if activations == "int8":
        xq, xscale = quantize_rows(v)
        acc = lax.dot_general(xq, qvalue, dims, preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * xscale[..., None]
    w = qvalue.astype(jnp.float32)
    return lax.dot_general(v, w, dims, precision=precision)


def _weight_only(v, qvalue, strategy, dims=_ROWS_BY_COLS, precision=None, bf16_x=False):
    """v f32[m, k] contracted with the int8 payload (layout given by ``dims``).

    ``bf16_x``: v's values are bf16's. The Pallas kernel then takes v as its
    one bf16 part, against the weights converted to bf16 in VMEM: exact at
    any precision. A float32 v is its one bf16 part at the default precision
    (the pass asked for) and int8 parts above it (``_tpu.INT8_PARTS``)."""
    if strategy == "chunked":
        return _chunked(v, qvalue) if dims == _ROWS_BY_COLS else _chunked_nk(v, qvalue)
    if strategy == "split_int8":
        levels = _ffi.rule().split_levels
        return _split_product(v, qvalue, dims, levels=levels)
    if strategy == "dequantize":
        w = qvalue.astype(jnp.float32)
        return lax.dot_general(v, w, dims, precision=precision)
    if strategy == "vector":
        if dims != _LAST_BY_LAST:
            raise ValueError("the vector kernel takes layout nk (linear's)")
        return _tpu_module().int8_vector(v, qvalue, interpret=not _tpu_available())
    if strategy == "pallas":
        tpu = _tpu_module()
        parts = tpu.parts_for(precision, jax.default_backend())
        nk = dims == _LAST_BY_LAST
        ones = jnp.ones(qvalue.shape[0 if nk else 1], jnp.float32)
        # the default precision's one bf16 pass is x's one bf16 part (bf16
        # MXU), as is all of a bf16 x; finer precisions take int8 parts
        # (benchmarks.tpu_kernels, int8: two int8 parts cost more at 64 rows)
        one_part = bf16_x or parts == 1
        mxu, count = ("bf16", 1) if one_part else ("int8", tpu.INT8_PARTS[parts])
        return tpu.int8_product(
            v,
            qvalue,
            ones,
            nk=nk,
            mxu=mxu,
            parts=count,
            interpret=not _tpu_available(),  # forced where none compile
        )
    raise ValueError(f"unknown weight-only strategy {strategy!r}")


def _int8_activations(xq, xscale, qvalue, strategy, dims=_ROWS_BY_COLS):
    """Quantized rows ``xq * xscale`` contracted with the int8 payload."""
    if strategy == "chunked":
        # integer sums, in f32
        acc = _weight_only(xq.astype(jnp.float32), qvalue, strategy, dims)
    elif strategy == "int8_dot":
        acc = _int8_dot(xq, qvalue, dims)
    else:
        raise ValueError(f"unknown int8-activation strategy {strategy!r}")
    return acc * xscale[:, None]


def _dot(lhs, rhs, preferred_element_type=None):
    """lhs[m, k] . rhs[k, n] -> [m, n]."""
    return lax.dot_general(
        lhs, rhs, _ROWS_BY_COLS, preferred_element_type=preferred_element_type
    )


def _int8_dot(lhs_q, qvalue, dims=_ROWS_BY_COLS):
    """int8[m, c] . int8 payload -> f32[m, ...]: int32 sums (exact) over
    blocks of at most ``INT32_EXACT_TERMS`` of c, the blocks added in
    float32 (an LM head's vocabulary can pass it); rows padded to a multiple
    of 8 (XLA:CPU's int8 kernel is slow for a single row and for odd
    counts)."""
    m, c = lhs_q.shape
    padded = jnp.pad(lhs_q, ((0, -m % 8), (0, 0)))
    w_axis = dims[0][1][0]
    starts = range(0, c, INT32_EXACT_TERMS) if c > INT32_EXACT_TERMS else [0]
    total = 0.0
    for start in starts:
        stop = start + INT32_EXACT_TERMS if c > INT32_EXACT_TERMS else c
        lhs = padded[:, start:stop]  # the whole of c in one block: no slice
        rhs = lax.slice_in_dim(qvalue, start, min(stop, c), axis=w_axis)
        sums = lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.int32)
        total = total + sums.astype(jnp.float32)
    return total[:m]


def _split_product(v, qvalue, dims, levels):
    """``v`` f32[m, c] contracted with the int8 payload as ``levels`` int8 parts.

    Each part quantizes, per row, what the previous parts left over, so ``v`` is
    represented to ~(1/254)^levels * 2 of each row's largest entry. All parts
    go through one int8 x int8 -> int32 product (rows stacked, padded to 8).
    """
    m = v.shape[0]
    parts, scales, rest = [], [], v
    for _ in range(levels):
        q, a = quantize_rows(rest)
        parts.append(q)
        scales.append(a)
        rest = rest - dequantize_rows(q, a)
    acc = _int8_dot(jnp.concatenate(parts), qvalue, dims)
    return sum(acc[i * m : (i + 1) * m] * a[:, None] for i, a in enumerate(scales))


def _chunk_rows(k: int) -> int:
    """Rows per chunk: a divisor of k near the rule's ``convert_rows`` (so the
    weights reshape into chunks without a copy; from half to twice it), else
    ``convert_rows`` with a tail."""
    convert = _ffi.rule().convert_rows
    for delta in range(convert // 2 + 1):
        for rows in (convert - delta, convert + delta):
            if convert // 2 <= rows <= 2 * convert and k % rows == 0:
                return rows
    return convert


def _chunked(v, qvalue):
    """v f32[m, k] @ int8[k, n] -> f32[m, n], converting K-chunks of rows."""
    m, k = v.shape
    n = qvalue.shape[1]
    chunk = min(_chunk_rows(k), k)
    full = k // chunk if chunk else 0
    main = full * chunk
    # zeros from an empty contraction: typed like the operands' product, so the
    # carry also has their varying manual axes inside shard_map
    acc = _dot(v[:, :0], qvalue[:0].astype(jnp.float32))
    if full:
        v_chunks = v[:, :main].reshape(m, full, chunk).transpose(1, 0, 2)
        q_chunks = qvalue[:main].reshape(full, chunk, n)

        def step(acc, chunk_pair):
            cols, rows = chunk_pair
            return acc + _dot(cols, rows.astype(jnp.float32)), None

        acc, _ = lax.scan(step, acc, (v_chunks, q_chunks))
    if main < k:  # the last partial chunk
        acc = acc + _dot(v[:, main:], qvalue[main:].astype(jnp.float32))
    return acc


def _chunked_nk(v, qvalue):
    """v f32[m, k] . int8[n, k] over k -> f32[m, n], converting chunks of the
    weights' rows (output channels): each chunk gives a block of columns."""
    m, k = v.shape
    n = qvalue.shape[0]
    chunk = min(_chunk_rows(n), n)
    full = n // chunk if chunk else 0
    main = full * chunk
    blocks = []
    if full:

        def step(_, rows):
            return None, lax.dot_general(v, rows.astype(jnp.float32), _LAST_BY_LAST)

        _, ys = lax.scan(step, None, qvalue[:main].reshape(full, chunk, k))
        blocks.append(jnp.moveaxis(ys, 0, 1).reshape(m, main))
    if main < n or not blocks:  # the last partial chunk (or no rows at all)
        rows = qvalue[main:].astype(jnp.float32)
        blocks.append(lax.dot_general(v, rows, _LAST_BY_LAST))
    return jnp.concatenate(blocks, axis=1) if len(blocks) > 1 else blocks[0]
