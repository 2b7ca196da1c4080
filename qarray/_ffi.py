"""qarray's CPU kernels (``qarray/_cpu/``) through ``jax.ffi``.

``scripts/build_kernels.sh`` (run by ``make setup`` and the image's build
stage) compiles them into ``qarray/_cpu/libqarray_cpu.so``: four handlers
over tiles for each instruction set of the architecture (x86-64: AMX,
AVX-512 VNNI, AVX-VNNI, AVX2; aarch64: dotprod, i8mm), the best this CPU has
chosen when the library loads. ``QARRAY_CPU_ISA=amx|avx512|avxvnni|avx2|i8mm|
dotprod`` forces a lower one (tests, benchmarks); ``QARRAY_KERNELS=xla`` asks
for the XLA formulations everywhere. ``status`` says which runs
(``"available (avx2)"``), ``available`` whether one does, ``rule`` the
thresholds of the set that runs (``_rules``), and
``_formulations.choose_strategy`` picks them on CPU.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from . import _rules

LIBRARY = Path(__file__).parent / "_cpu" / "libqarray_cpu.so"
# the jaxlib whose FFI headers built LIBRARY (scripts/build_kernels.sh): XLA
# refuses a handler built for another FFI API version only when it compiles
BUILT_FOR = LIBRARY.with_suffix(".jaxlib")
TARGET = "qarray_product"
TARGET_INT4 = "qarray_product_int4"
TARGET_QUANTIZE = "qarray_quantize"
TARGET_CONV = "qarray_conv"
ISA_ENV = "QARRAY_CPU_ISA"  # read by the library (qarray/_cpu/dispatch.cc)


@functools.cache
def status() -> str:
    """Whether the CPU kernels run in this process and on which instruction
    set: ``"available (avx2)"``, or the reason they do not."""
    if _rules.xla_only():
        return f"{_rules.KERNELS_ENV}=xla"
    if not LIBRARY.is_file():
        return f"not built ({LIBRARY.name} missing: run make setup with a C++ compiler)"
    import jaxlib

    built_for = BUILT_FOR.read_text().strip() if BUILT_FOR.is_file() else "unknown"
    if built_for != jaxlib.__version__:
        return (
            f"built for jaxlib {built_for}, running {jaxlib.__version__} "
            "(run make setup, or scripts/build_kernels.sh, to rebuild)"
        )
    try:
        library = ctypes.CDLL(str(LIBRARY))
    except OSError as error:
        return f"{LIBRARY.name} does not load: {error}"
    library.qarray_cpu_isa.restype = ctypes.c_char_p
    library.qarray_cpu_reason.restype = ctypes.c_char_p
    isa = library.qarray_cpu_isa()
    if isa is None:
        return library.qarray_cpu_reason().decode()
    refused = limits_refusal(library_limits(library), _rules.CPU_RULES)
    if refused:
        return refused
    jax.ffi.register_ffi_target(
        TARGET, jax.ffi.pycapsule(library.QarrayProduct), platform="cpu"
    )
    jax.ffi.register_ffi_target(
        TARGET_INT4, jax.ffi.pycapsule(library.QarrayProductInt4), platform="cpu"
    )
    jax.ffi.register_ffi_target(
        TARGET_QUANTIZE, jax.ffi.pycapsule(library.QarrayQuantize), platform="cpu"
    )
    jax.ffi.register_ffi_target(
        TARGET_CONV, jax.ffi.pycapsule(library.QarrayConv), platform="cpu"
    )
    return f"available ({isa.decode()})"


def available() -> bool:
    """Whether the CPU kernels run in this process (see ``status``)."""
    return status().startswith("available")


def isa() -> str | None:
    """The instruction set the CPU kernels run on here ("amx", "avx512",
    "avxvnni", "avx2", "i8mm", "dotprod"), or None where they do not run."""
    if not available():
        return None
    return status()[len("available (") : -1]


def _float32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _call(target, operands, results, **attrs):
    """The kernel ``target`` on ``operands`` -> ``results`` (a shape-dtype
    struct, or a tuple of them), typed like the operands inside shard_map."""
    if not available():
        raise RuntimeError(f"qarray's CPU kernels do not run here: {status()}")
    call = jax.ffi.ffi_call(target, results, vmap_method="sequential")
    out = call(*operands, **attrs)
    if isinstance(out, tuple | list):
        return tuple(_varying_like(o, operands) for o in out)
    return _varying_like(out, operands)


def _varying_like(y, operands):
    """``y`` varying over the manual axes its operands do inside shard_map
    (what the typing rules declared; the call's own type says none)."""
    varying = frozenset().union(
        *(jax.typeof(a).manual_axis_type.varying for a in operands)
    )
    if varying:
        axes = tuple(sorted(varying))
        if hasattr(jax.lax, "pcast"):
            y = jax.lax.pcast(y, axes, to="varying")
        else:  # jax 0.11, before pcast (an environment older than the pin)
            y = jax.lax.pvary(y, axes)
    return y


# the library's limits: ``KernelRule`` field -> the C function exporting it
LIMITS = {
    "split_levels": "qarray_cpu_max_split",
    "kn_dot_int8_rows": "qarray_cpu_max_kn_dot_rows",
}


def library_limits(library: ctypes.CDLL) -> dict[str, int]:
    """What only the kernels know: the most int8 parts a row (``kMaxSplit``)
    and kn dot-tile rows (``kMaxKnDotRows``) their stack arrays hold, read
    from the loaded library."""
    limits = {}
    for name, symbol in LIMITS.items():
        function = getattr(library, symbol)
        function.restype = ctypes.c_int64
        limits[name] = function()
    return limits


def limits_refusal(limits: dict[str, int], rules: dict) -> str | None:
    """Why the library refuses to load beside these rules (a rule asks for
    more than the kernels hold: every call would fail), or None."""
    for rule in rules.values():
        for field, most in limits.items():
            asked = getattr(rule, field)
            if asked > most:
                return (
                    f"refused: {LIBRARY.name} holds at most {field}={most}, "
                    f"qarray._rules' {rule.name!r} rule asks {asked} (change the "
                    "rule, or the kernels' limit in qarray/_cpu/common.h and "
                    "rebuild with make setup)"
                )
    return None


def rule() -> _rules.KernelRule:
    """The rule of the instruction set that runs here (``_rules.for_isa``)."""
    return _rules.for_isa(isa())


def thresholds(activations: str = "float32") -> dict[str, np.int64]:
    """Every threshold the kernels take (``rule().thresholds``), passed with
    every call: the library has none of its own, and checks their range."""
    return {k: np.int64(v) for k, v in rule().thresholds(activations).items()}


def product_int4(x, packed, scale, *, int8: bool = False):
    """x f32[m, k] @ W^T for int4 weights W[n, k] (packed uint8[n, k / 2], one
    scale per group of k: f32[n, k / G], G a multiple of 32) -> f32[m, n];
    ``int8``: x quantized per row first (W4A8)."""
    return _call(
        TARGET_INT4,
        (x, packed, scale),
        _float32(x.shape[0], packed.shape[0]),
        int8=np.int64(int8),
        **thresholds("int8" if int8 else "float32"),
    )


def quantize_rows(x):
    """x f32[m, k] -> (int8[m, k], f32[m]): ``_numerics.quantize_rows``'s
    numerics (the division correctly rounded), each row read once."""
    m, k = x.shape
    results = (
        jax.ShapeDtypeStruct((m, k), jnp.int8),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )
    return _call(TARGET_QUANTIZE, (x,), results)


def conv(x, qvalue, scale, out_shape, geometry, *, int8: bool):
    """x f32[B, C, *S] convolved with int8 weights q[O, C / G * prod(k)] and
    one scale per output channel -> f32 ``out_shape`` (B, O, *S'), im2col and
    the kernel's products; ``geometry``: kernel sizes, strides, low paddings
    and dilations (3 each, the used ones last), then the group count."""
    return _call(
        TARGET_CONV,
        (x, qvalue, scale),
        _float32(*out_shape),
        geometry=np.asarray(geometry, np.int64),
        int8=np.int64(int8),
        **thresholds("int8" if int8 else "float32"),
    )


def product(x, qvalue, scale, *, kn: bool, int8: bool):
    """x f32[m, k] with int8 weights and their per-row scales -> f32[m, n]:
    ``(x * scale) @ qvalue`` for ``kn`` (q[k, n], scale[k]), else
    ``(x @ qvalue.T) * scale`` (q[n, k], scale[n]); ``int8``: x's rows
    quantized per row first (after the scales fold in, for kn)."""
    n = qvalue.shape[1] if kn else qvalue.shape[0]
    return _call(
        TARGET,
        (x, qvalue, scale),
        _float32(x.shape[0], n),
        kn=np.int64(kn),
        int8=np.int64(int8),
        **thresholds("int8" if int8 else "float32"),
    )
