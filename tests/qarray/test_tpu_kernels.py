"""qarray's Pallas kernels (qarray/_tpu) against NumPy references in float64:
compiled on a TPU, in Pallas' interpreter elsewhere (CI's CPU).

Their precision is a number of parts of x: bf16 parts (one is x rounded to
bf16, 2**-9 an entry; two ~2**-17; three float32's) or int8 parts (each
quantizes per row what the last left: ~(1/254)**parts of the row's largest
entry). One int8 part is the int8-activation product, exact in its integer
sums.

Covers: qarray/_tpu/__init__.py, qarray/_tpu/_int8.py, qarray/_tpu/_int4.py,
qarray/_tpu/_vector.py, qarray/_tpu/_layout.py, qarray/_tpu/_parts.py,
qarray/_tpu/_available.py"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qarray as qa
from qarray import _formulations, _rules, _tpu
from qarray._numerics import quantize_groups_np, quantize_rows_np
from qarray._tpu import _available

# interpreted wherever they do not compile (off a TPU, or a TPU whose libtpu
# refuses this JAX's Mosaic modules: there the strategies take XLA's too)
INTERPRET = not _tpu.available()
# relative error (Frobenius) of a product, by x's parts
BF16_TOLERANCE = {1: 2.0**-8, 2: 2.0**-15, 3: 1e-6}
INT8_TOLERANCE = {2: 1e-4, 3: 1e-6}


def rel_err(got, want):
    got = np.asarray(got, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def int8_weights(rng, n, k):
    return rng.integers(-127, 128, (n, k)).astype(np.int8), rng.random(n).astype(
        np.float32
    )


@pytest.mark.parametrize(
    "mxu,parts", [("bf16", 1), ("bf16", 2), ("bf16", 3), ("int8", 2), ("int8", 3)]
)
@pytest.mark.parametrize("nk", [True, False], ids=["nk", "kn"])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 256, 128),
        pytest.param(
            (5, 300, 130), marks=pytest.mark.cpu_breadth("tails: 40 x 2100 x 600's")
        ),
        (40, 2100, 600),
    ],
)
def test_int8_weights_match_numpy(rng, shape, nk, mxu, parts):
    """Both layouts, padded tails on every axis, several blocks of K and N
    (and of rows: ``blocks`` caps them small)."""
    m, k, n = shape
    x = rng.standard_normal((m, k)).astype(np.float32)
    w, scale = int8_weights(rng, n, k)
    stored = w if nk else np.ascontiguousarray(w.T)
    got = _tpu.int8_product(
        jnp.asarray(x),
        stored,
        scale,
        nk=nk,
        mxu=mxu,
        parts=parts,
        blocks=(32, 256, 1024),
        interpret=INTERPRET,
    )
    want = (x.astype(np.float64) @ w.T.astype(np.float64)) * scale
    assert got.shape == (m, n) and got.dtype == jnp.float32
    tolerance = (BF16_TOLERANCE if mxu == "bf16" else INT8_TOLERANCE)[parts]
    assert rel_err(got, want) <= tolerance
    if (mxu, parts) == ("bf16", 1):  # exactly the product of x rounded to bf16
        x16 = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
        assert rel_err(got, (x16 @ w.T.astype(np.float64)) * scale) <= 1e-6


@pytest.mark.parametrize("nk", [True, False], ids=["nk", "kn"])
def test_one_int8_part_is_the_int8_activation_product(rng, nk):
    """x quantized per row as quantize_rows does, integer sums exact: the
    product of W8A8 to float32's rounding."""
    m, k, n = 12, 520, 260
    x = rng.standard_normal((m, k)).astype(np.float32)
    w, scale = int8_weights(rng, n, k)
    stored = w if nk else np.ascontiguousarray(w.T)
    got = _tpu.int8_product(
        jnp.asarray(x), stored, scale, nk=nk, mxu="int8", parts=1, interpret=INTERPRET
    )
    xq, xs = quantize_rows_np(x)
    sums = xq.astype(np.int64) @ w.T.astype(np.int64)  # exact
    want = sums * xs.astype(np.float64)[:, None] * scale
    assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("mxu,parts", [("bf16", 1), ("bf16", 3), ("int8", 3)])
def test_int8_weights_as_the_streamed_operand(rng, mxu, parts):
    """orient="columns": (weights . rows) transposed, the same product."""
    m, k, n = 3, 700, 390
    x = rng.standard_normal((m, k)).astype(np.float32)
    w, scale = int8_weights(rng, n, k)
    got = _tpu.int8_product(
        jnp.asarray(x),
        w,
        scale,
        nk=True,
        mxu=mxu,
        parts=parts,
        blocks=(512, 128, 256),
        orient="columns",
        interpret=INTERPRET,
    )
    want = (x.astype(np.float64) @ w.T.astype(np.float64)) * scale
    tolerance = (BF16_TOLERANCE if mxu == "bf16" else INT8_TOLERANCE)[parts]
    assert rel_err(got, want) <= tolerance


def int4_case(rng, m, k, n, group_size, **options):
    """(the kernel's product of random x and int4 weights, x @ W.T in
    float64 from the dequantized weights)."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    packed, scale = quantize_groups_np(rng.standard_normal((n, k)), group_size)
    got = _tpu.int4_product(
        jnp.asarray(x),
        packed,
        scale,
        group_size=group_size,
        interpret=INTERPRET,
        **options,
    )
    want = x.astype(np.float64) @ dequantized_int4(packed, scale, group_size).T
    return got, want


def dequantized_int4(packed, scale, group_size):
    low = (packed & 0xF).astype(np.int16)
    high = (packed >> 4).astype(np.int16)
    values = np.stack(
        [np.where(low > 7, low - 16, low), np.where(high > 7, high - 16, high)], -1
    )
    values = values.reshape(packed.shape[0], -1).astype(np.float64)
    groups = (
        values.reshape(*scale.shape, group_size) * scale.astype(np.float64)[..., None]
    )
    return groups.reshape(packed.shape[0], -1)


@pytest.mark.parametrize(
    "mode,mxu,parts",
    [
        ("groups", "bf16", 1),
        ("groups", "bf16", 3),
        ("groups", "int8", 2),
        ("groups", "int8", 3),
        ("tile", "bf16", 1),
        ("tile", "bf16", 3),
    ],
)
@pytest.mark.parametrize("group_size", [32, 128, 256])
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(
            (1, 512, 128),
            marks=pytest.mark.cpu_breadth(
                "9 x 1024 x 300 has its one row block and tails"
            ),
        ),
        (9, 1024, 300),
    ],
)
def test_int4_weights_match_numpy(rng, shape, group_size, mode, mxu, parts):
    """Groups several to a 128-byte chunk (G 32, 128) and a chunk to a group
    (256); padded rows and columns; blocks of K for G 32 (packed bk 256;
    G 128 and 256 take one here: test_int4_bytes_over_several_blocks_of_k)."""
    m, k, n = shape
    options = dict(mode=mode, mxu=mxu, parts=parts, blocks=(32, 256, 256))
    got, want = int4_case(rng, m, k, n, group_size, **options)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    tolerance = (BF16_TOLERANCE if mxu == "bf16" else INT8_TOLERANCE)[parts]
    if mode == "tile" and parts == 1:  # the weights rounded to bf16 as well
        tolerance = 2.0**-7
    assert rel_err(got, want) <= tolerance


@pytest.mark.parametrize("mxu,parts", [("bf16", 1), ("int8", 2), ("bf16", 3)])
@pytest.mark.parametrize("group_size", [32, 128, 256])
def test_int4_weights_held_as_jnp_int4_match_numpy(rng, group_size, mxu, parts):
    """The groups kernel on weights held as jnp.int4 (n, k), which Mosaic
    unpacks (qarray's bytes bitcast: ``as_int4``)."""
    m, k, n = 9, 1024, 300
    x = rng.standard_normal((m, k)).astype(np.float32)
    packed, scale = quantize_groups_np(rng.standard_normal((n, k)), group_size)
    w = _tpu.as_int4(jnp.asarray(packed))
    assert w.dtype == jnp.int4 and w.shape == (n, k)
    options = dict(mode="groups", mxu=mxu, parts=parts, blocks=(32, 256, 256))
    got = _tpu.int4_product(
        jnp.asarray(x), w, scale, group_size=group_size, interpret=INTERPRET, **options
    )
    want = x.astype(np.float64) @ dequantized_int4(packed, scale, group_size).T
    assert got.shape == (m, n) and got.dtype == jnp.float32
    tolerance = (BF16_TOLERANCE if mxu == "bf16" else INT8_TOLERANCE)[parts]
    assert rel_err(got, want) <= tolerance


@pytest.mark.parametrize(
    "m,k,n,blocks",
    [
        (1, 1024, 300, (128, 256)),  # padded N, several blocks of K
        (3, 300, 130, (128, 128)),  # padded K
        (8, 2048, 256, (256, 2048)),  # the most rows, one block
    ],
)
def test_the_vector_kernel_matches_numpy(rng, m, k, n, blocks):
    """The vector unit's product: float32 products and sums, ~1e-7 of the
    float64 reference whatever the precision."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    qvalue, _ = int8_weights(rng, n, k)
    got = _tpu.int8_vector(jnp.asarray(x), qvalue, blocks=blocks, interpret=INTERPRET)
    want = x.astype(np.float64) @ qvalue.T.astype(np.float64)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert rel_err(got, want) <= 1e-6


def test_the_vector_kernel_says_what_it_takes():
    x = jnp.ones((2, 256))
    with pytest.raises(TypeError, match="m <= 8"):
        _tpu.int8_vector(jnp.ones((9, 256)), jnp.ones((128, 256), jnp.int8))
    with pytest.raises(TypeError, match="do not agree"):
        _tpu.int8_vector(x, jnp.ones((128, 128), jnp.int8))
    with pytest.raises(ValueError, match="layout nk"):
        _formulations.matmul(
            x, jnp.ones((256, 8), jnp.int8), jnp.ones(256), "float32", "vector"
        )


def test_the_kernel_takes_x_at_the_precision_asked_for(rng):
    """linear's MXU kernel: at the default precision x is its one bf16 part
    (the pass asked for: exact for x whose values are bf16's, as for a bf16
    x, one bf16 rounding of each entry otherwise); above it int8 parts,
    finer."""
    m, k, n = 5, 1024, 300
    x = rng.standard_normal((m, k)).astype(np.float32)
    x16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    qvalue, scale = int8_weights(rng, n, k)
    w = qvalue * scale[:, None].astype(np.float64)

    def err(x, **options):
        got = _formulations.linear(x, qvalue, scale, strategy="pallas", **options)
        return rel_err(got, np.asarray(x, np.float64) @ w.T)

    P = lax.Precision
    assert err(x16, bf16_x=True) <= 1e-6
    assert err(x16, precision=P.DEFAULT) <= 1e-6
    assert 1e-4 < err(x, precision=P.DEFAULT) < 4e-3  # one bf16 rounding
    assert err(x, precision=P.HIGH) <= INT8_TOLERANCE[3]
    assert err(x, precision=P.HIGHEST) <= INT8_TOLERANCE[3]


def test_linear_q_says_when_x_is_bf16(monkeypatch):
    """The primitive passes x's dtype on (x is upcast to float32 before the
    products): bf16 x only, not float16 (11 bits) nor float32."""
    seen = []
    real = _formulations.linear

    def spy(*args, **kwargs):
        seen.append(kwargs["bf16_x"])
        return real(*args, **kwargs)

    monkeypatch.setattr(_formulations, "linear", spy)
    qw = qa.quantize(jnp.ones((5, 192)))
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        jax.jit(lambda x: qa.linear_q(x, qw))(jnp.ones((3, 192), dtype))
    assert seen == [True, False, False]


def test_empty_axes_give_zeros():
    for m, k, n in [(0, 256, 8), (2, 0, 3), (2, 256, 0)]:
        got = _tpu.int8_product(
            jnp.ones((m, k)),
            jnp.ones((n, k), jnp.int8),
            jnp.ones(n),
            nk=True,
            interpret=INTERPRET,
        )
        assert got.shape == (m, n) and not np.asarray(got).any()
        got = _tpu.int4_product(
            jnp.ones((m, k)),
            jnp.ones((n, k // 2), jnp.uint8),
            jnp.ones((n, k // 128)),
            group_size=128,
            interpret=INTERPRET,
        )
        assert got.shape == (m, n) and not np.asarray(got).any()


def test_bad_static_parameters_are_value_errors():
    x, packed, scale = jnp.ones((2, 96)), jnp.ones((4, 48), jnp.uint8), jnp.ones((4, 1))
    with pytest.raises(ValueError, match="group_size 96"):
        _tpu.int4_product(x, packed, scale, group_size=96, interpret=INTERPRET)
    with pytest.raises(ValueError, match="int4 mode"):
        _tpu.int4_product(
            jnp.ones((2, 128)),
            jnp.ones((4, 64), jnp.uint8),
            jnp.ones((4, 1)),
            group_size=128,
            mode="rows",
            interpret=INTERPRET,
        )
    with pytest.raises(ValueError, match="mode 'groups'"):
        _tpu.int4_product(
            jnp.ones((2, 128)),
            jnp.ones((4, 128), jnp.int4),
            jnp.ones((4, 1)),
            group_size=128,
            mode="tile",
            interpret=INTERPRET,
        )
    with pytest.raises(ValueError, match="orient='columns'"):
        _tpu.int8_product(
            jnp.ones((2, 128)),
            jnp.ones((128, 4), jnp.int8),
            jnp.ones(4),
            nk=False,
            orient="columns",
            interpret=INTERPRET,
        )


def test_parts_follow_the_precision_asked_for():
    P = lax.Precision
    assert _tpu.parts_for(P.DEFAULT, "tpu") == 1
    assert _tpu.parts_for(P.HIGH, "cpu") == 2
    assert _tpu.parts_for(P.HIGHEST, "tpu") == 3
    assert _tpu.parts_for((P.DEFAULT, P.HIGHEST), "tpu") == 1  # x's precision
    with jax.default_matmul_precision("default"):
        assert _tpu.parts_for(None, "cpu") == 1
    with jax.default_matmul_precision("highest"):
        assert _tpu.parts_for(None, "tpu") == 3
    if jax.config.jax_default_matmul_precision is None:
        # the platform's default: one pass on a TPU, float32 elsewhere
        assert (_tpu.parts_for(None, "tpu"), _tpu.parts_for(None, "cpu")) == (1, 3)
    # int8 parts at least as fine as the bf16 parts they stand in for
    assert [_tpu.INT8_PARTS[p] for p in (1, 2, 3)] == [2, 3, 3]


def test_the_kernels_run_only_on_a_tpu_that_compiles_them(monkeypatch, caplog):
    """Off a TPU, and under QARRAY_KERNELS=xla, never; on a TPU whose libtpu
    refuses this JAX's Mosaic modules, a logged line and XLA's formulations
    instead of a failure when the program compiles."""
    probe = _available.available.__wrapped__  # uncached
    if jax.default_backend() != "tpu":
        assert not _tpu.available()
    monkeypatch.setenv("QARRAY_KERNELS", "xla")
    assert not probe()
    monkeypatch.delenv("QARRAY_KERNELS")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")

    def refused(*args, **kwargs):
        raise RuntimeError("Failed to parse the Mosaic module: unknown attribute code")

    monkeypatch.setattr(_available, "int8_product", refused)
    with caplog.at_level(logging.WARNING, logger="qarray"):
        assert not probe()
    assert "do not compile here (Failed to parse the Mosaic module" in caplog.text


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_a_tpu_takes_the_kernel_for_few_rows_of_weight_only_products(layout):
    """By the TPU rule: weight-only up to int8_kernel_max_rows rows, XLA's
    dequantized dot past them; int8 activations always XLA's int8 dot;
    nothing of qarray's where its kernels do not compile."""
    rule = _rules.for_tpu()
    rows = rule.int8_kernel_max_rows
    choose = _formulations.choose_strategy
    first = "vector" if layout == "nk" and rule.vector_max_rows >= 1 else "pallas"
    assert choose(1, 4096, 4096, "float32", "tpu", layout, kernels=True) == first
    if layout == "nk":  # linear's: the vector unit up to vector_max_rows
        few = rule.vector_max_rows
        if few >= 1:
            assert choose(few, 4096, 4096, "float32", "tpu", "nk", kernels=True) == (
                "vector"
            )
        assert choose(few + 1, 4096, 4096, "float32", "tpu", "nk", kernels=True) == (
            "pallas"
        )
        with _rules.overriding(vector_max_rows=20):  # the kernel takes 8
            assert choose(9, 4096, 4096, "float32", "tpu", "nk", kernels=True) == (
                "pallas"
            )
        with _rules.overriding(vector_max_rows=0):
            assert choose(1, 4096, 4096, "float32", "tpu", "nk", kernels=True) == (
                "pallas"
            )
    assert choose(rows, 4096, 4096, "float32", "tpu", layout, kernels=True) == "pallas"
    assert (
        choose(rows + 1, 4096, 4096, "float32", "tpu", layout, kernels=True)
        == "dequantize"
    )
    assert choose(1, 4096, 4096, "int8", "tpu", layout, kernels=True) == "int8_dot"
    assert (
        choose(1, 4096, 4096, "float32", "tpu", layout, kernels=False) == "dequantize"
    )
    with _rules.overriding(int8_kernel_max_rows=rows + 1):
        assert (
            choose(rows + 1, 4096, 4096, "float32", "tpu", layout, kernels=True)
            == "pallas"
        )


def test_the_int4_modes_follow_the_tpu_rule(monkeypatch):
    rule = _rules.for_tpu()
    monkeypatch.setattr(_formulations, "_tpu_available", lambda: True)
    monkeypatch.setattr(_formulations, "_partitioned", lambda: False)
    mode = _formulations.int4_tpu_mode
    # G a multiple of 128: the groups mode, weight-only and W4A8 (the bytes
    # kernel, or at one row of the default precision the shifts: below)
    for activations in ("float32", "int8"):
        assert mode(1, 128, activations) == "pallas_groups"
        assert mode(rule.int4_bytes_max_rows, 256, activations) == "pallas_groups"
        assert mode(rule.int4_bytes_max_rows + 1, 128, activations) is None
    # other sizes: the shifts, then the tile, weight-only
    assert mode(rule.int4_groups_max_rows, 32, "float32") == "pallas_groups"
    assert mode(rule.int4_groups_max_rows + 1, 64, "float32") == "pallas_tile"
    assert mode(rule.int4_tile_max_rows + 1, 64, "float32") is None
    assert mode(1, 64, "int8") is None  # W4A8: XLA's
    assert mode(1, 96, "float32") is None  # G / 2 neither divides 128 nor is a multiple

    assert mode(1, 0, "float32") is None  # k = 0: no groups
    monkeypatch.setattr(_formulations, "_tpu_available", lambda: False)
    assert mode(1, 128, "float32") is None


def test_each_precision_takes_its_mxu_form(monkeypatch):
    """Which form of x each kernel is handed: int8 weights, x's one bf16
    part at the default precision and int8 parts above it (a bf16 x: its
    one bf16 part always); int4 G=128, the shifts with x's one bf16 part up
    to int4_bf16_max_rows rows at the default precision, else the bytes
    kernel's int8 parts."""
    seen = []

    def spy(real):
        def kernel(*args, mxu, parts, **options):
            seen.append((mxu, parts))
            return real(*args, mxu=mxu, parts=parts, **options)

        return kernel

    monkeypatch.setattr(_tpu, "int8_product", spy(_tpu.int8_product))
    monkeypatch.setattr(_tpu, "int4_product", spy(_tpu.int4_product))
    P = lax.Precision
    qvalue, scale = jnp.ones((256, 256), jnp.int8), jnp.ones((256,))
    cases = ((P.DEFAULT, False), (P.HIGHEST, False), (P.HIGHEST, True))
    for precision, bf16_x in cases:
        _formulations.linear(
            jnp.ones((3, 256)), qvalue, scale, strategy="pallas",
            precision=precision, bf16_x=bf16_x,
        )  # fmt: skip
    with jax.default_matmul_precision("default"):  # precision None: the default
        _formulations.matmul(jnp.ones((3, 256)), qvalue, scale, strategy="pallas")
    assert seen == [("bf16", 1), ("int8", 3), ("bf16", 1), ("bf16", 1)]
    seen.clear()
    packed, scales = jnp.zeros((256, 128), jnp.uint8), jnp.ones((256, 2))
    few = _rules.for_tpu().int4_bf16_max_rows

    def int4(rows, precision, activations="float32", bf16_x=False):
        _formulations.linear_int4(
            jnp.ones((rows, 256)), packed, scales, activations, "pallas_groups",
            precision=precision, bf16_x=bf16_x,
        )  # fmt: skip

    int4(few, P.DEFAULT)
    int4(few + 1, P.DEFAULT)
    int4(few, P.HIGHEST)
    int4(few, P.DEFAULT, bf16_x=True)
    int4(few, P.DEFAULT, activations="int8")  # W4A8: x's one int8 part
    with _rules.overriding(int4_bf16_max_rows=0):
        int4(1, P.DEFAULT)
    assert seen == [
        ("bf16", 1), ("int8", 2), ("int8", 3), ("bf16", 1), ("int8", 1), ("int8", 2),
    ]  # fmt: skip


def test_partitioned_programs_keep_xlas_formulations(monkeypatch):
    """A Pallas kernel is one device's program: where XLA may partition the
    computation over several devices (any second device: jit's in_shardings
    are not seen at trace time), the weights would be gathered to every
    device, so the TPU keeps XLA's formulations there; inside shard_map each
    device runs the kernel on its own block."""
    monkeypatch.setattr(_formulations, "_tpu_available", lambda: True)
    kernels = ("pallas", "pallas_groups")

    def chosen():
        return (
            _formulations.choose_strategy(8, 1024, 1024, "float32", "tpu", "nk"),
            _formulations.int4_tpu_mode(8, 128, "float32"),
        )

    one_device = jax.device_count() == 1
    assert chosen() == (kernels if one_device else ("dequantize", None))
    size = min(2, jax.device_count())
    mesh = jax.make_mesh((size,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        assert chosen() == (kernels if size == 1 else ("dequantize", None))
        seen = []

        def per_device(x):
            seen.append(chosen())
            return x

        x = jax.reshard(jnp.ones((size, 4)), jax.P("i"))
        jax.shard_map(per_device, in_specs=jax.P("i"), out_specs=jax.P("i"))(x)
        assert seen == [kernels]


def test_int8_sums_do_not_overflow_over_a_long_k():
    """Each block of K sums in int32 (exact), the blocks in float32: K far
    past 2**31 / 127**2 (an LM head's vocabulary, in its VJP) stays right."""
    k, n = 2048 * 70, 128
    x = jnp.ones((1, k), jnp.float32)
    w = jnp.full((n, k), 127, jnp.int8)
    scale = jnp.full((n,), 1 / 127, jnp.float32)
    for nk in (True, False):
        got = _tpu.int8_product(
            x, w if nk else w.T, scale, nk=nk, mxu="int8", parts=2, interpret=INTERPRET
        )
        np.testing.assert_allclose(np.asarray(got), k, rtol=1e-6)


@pytest.mark.parametrize("group_size", [128, 512])
def test_int4_bytes_over_several_blocks_of_k(rng, group_size):
    """The bytes kernel's sums carried across blocks of K (packed bk 512:
    eight groups of 128, or one of 512 in its 128-byte chunks), padded rows
    and columns."""
    options = dict(mode="groups", mxu="int8", parts=3, blocks=(32, 256, 512))
    got, want = int4_case(rng, 9, 4096, 300, group_size, **options)
    assert rel_err(got, want) <= INT8_TOLERANCE[3]


def test_int4_bytes_take_a_bf16_x_as_int8_parts(rng):
    """linear_int4 on bf16 x: G = 64 takes it as its one bf16 part (exact),
    G = 128 the bytes kernel with x's int8 parts, finer than the one bf16
    pass the default precision asks for (2**-9)."""
    x = jnp.asarray(rng.standard_normal((5, 1024)), jnp.bfloat16).astype(jnp.float32)
    for group_size, tolerance in ((64, 1e-6), (128, INT8_TOLERANCE[2])):
        packed, scale = quantize_groups_np(rng.standard_normal((96, 1024)), group_size)
        want = np.asarray(x, np.float64) @ dequantized_int4(packed, scale, group_size).T
        got = _formulations.linear_int4(
            x,
            packed,
            scale,
            strategy="pallas_groups",
            bf16_x=True,
            precision=lax.Precision.DEFAULT,
        )
        assert rel_err(got, want) <= tolerance


@pytest.mark.parametrize("mode", ["groups", "tile"])
@pytest.mark.parametrize("group_size", [64, 512])
def test_int4_over_several_row_blocks(rng, mode, group_size):
    """m = 70 rows in blocks of 32 (parts stacked per block), G 64 and 512,
    K / 2 not a multiple of 128 for G = 64."""
    k = 1024 + (0 if group_size == 512 else 192)
    options = dict(mode=mode, parts=3, blocks=(32, 128, 256))
    got, want = int4_case(rng, 70, k, 130, group_size, **options)
    assert rel_err(got, want) <= BF16_TOLERANCE[3]


def test_the_rules_blocks_are_read_at_each_call(monkeypatch):
    """The default blocks come from the TPU rule before the compiled
    function's cache is asked: an ``overriding`` in force after a first call
    reaches the kernel (what a block sweep through the rule relies on)."""
    from qarray._tpu import _int4, _int8

    seen = []
    for module in (_int8, _int4):
        original = module._jitted
        monkeypatch.setattr(
            module,
            "_jitted",
            lambda *a, original=original, **kw: (
                seen.append(kw["blocks"]) or original(*a, **kw)
            ),
        )
    x, w, s = jnp.ones((2, 256)), jnp.ones((128, 256), jnp.int8), jnp.ones(128)
    packed, groups = jnp.ones((128, 128), jnp.uint8), jnp.ones((128, 2))
    for override in ((32, 128, 128), None):
        with _rules.overriding(
            **(
                {"int8_blocks": override, "int4_groups_blocks": override}
                if override
                else {}
            )
        ):
            _tpu.int8_product(x, w, s, nk=True, interpret=INTERPRET)
            _tpu.int4_product(x, packed, groups, group_size=128, interpret=INTERPRET)
    rule = _rules.for_tpu()
    assert seen == [(32, 128, 128)] * 2 + [rule.int8_blocks, rule.int4_groups_blocks]


def test_operands_that_do_not_agree_are_type_errors():
    x = jnp.ones((2, 300))
    with pytest.raises(TypeError, match=r"x \(2, 300\), weights \(n, k\) \(4, 256\)"):
        _tpu.int8_product(x, jnp.ones((4, 256), jnp.int8), jnp.ones(4), nk=True)
    with pytest.raises(TypeError, match="int8 weights"):
        _tpu.int8_product(x, jnp.ones((4, 300)), jnp.ones(4), nk=True)
    with pytest.raises(TypeError, match="do not agree for group_size 64"):
        _tpu.int4_product(
            jnp.ones((2, 256)),
            jnp.ones((4, 128), jnp.uint8),
            jnp.ones((4, 2)),
            group_size=64,
        )
    with pytest.raises(ValueError, match="group_size 0"):
        _tpu.int4_product(
            jnp.ones((2, 256)),
            jnp.ones((4, 128), jnp.uint8),
            jnp.ones((4, 2)),
            group_size=0,
        )


def test_dot_algorithm_names_give_their_parts():
    """jax.default_matmul_precision also takes JAX's dot algorithms by name:
    each gets the bf16 parts that carry its precision."""
    for name, parts in [
        ("BF16_BF16_F32", 1),
        ("BF16_BF16_F32_X3", 2),
        ("BF16_BF16_F32_X6", 3),
        ("TF32_TF32_F32", 2),
        ("F32_F32_F32", 3),
        ("bfloat16", 1),
        ("float32", 3),
    ]:
        with jax.default_matmul_precision(name):
            assert _tpu.parts_for(None, "tpu") == parts, name


def test_bf16_parts_survive_xlas_excess_precision(rng):
    """x's 3 bf16 parts sum back to x exactly, the first is x rounded to bf16
    as a conversion rounds, and each is cut by integer arithmetic in the
    compiled program: XLA on a TPU (x's parts) and Mosaic
    (the tile kernel's weights) dropped a float32 -> bf16 -> float32 round
    trip (excess precision), which left the later parts 0 and the bf16-MXU
    kernels at one bf16 pass on a v5e; the CPU keeps such round trips, so the
    program's text is what this platform can check."""
    x = rng.standard_normal((8, 256)).astype(np.float32)
    x[0, :3] = [0.0, -1e-30, 3e30]  # zero, a tiny and a huge entry
    split = jax.jit(lambda x: _tpu._parts.bf16_parts(x, 3))
    parts, scales = split(x)
    assert parts.dtype == jnp.bfloat16 and scales.shape == (3, 8)
    np.testing.assert_array_equal(np.asarray(parts, np.float64).sum(0), x)
    first = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)  # NumPy-side rounding
    np.testing.assert_array_equal(np.asarray(parts[0], np.float32), first)
    hlo = split.lower(x).as_text()
    assert hlo.count("bitcast_convert") == 6 and "reduce_precision" not in hlo, hlo
