"""qarray's Pallas kernels (qarray/_tpu) against NumPy references in float64:
compiled on a TPU, in Pallas' interpreter elsewhere (CI's CPU).

Their precision is a number of parts of x: bf16 parts (one is x rounded to
bf16, 2**-9 an entry; two ~2**-17; three float32's) or int8 parts (each
quantizes per row what the last left: ~(1/254)**parts of the row's largest
entry). One int8 part is the int8-activation product, exact in its integer
sums.

Covers: qarray/_tpu/__init__.py, qarray/_tpu/_int8.py, qarray/_tpu/_int4.py,
qarray/_tpu/_vector.py, qarray/_tpu/_layout.py, qarray/_tpu/_parts.py"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from qarray import _formulations, _tpu
from qarray._numerics import quantize_groups_np, quantize_rows_np
from qarray._tpu import _parts as _tpu_parts

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
    with pytest.raises(ValueError, match="nk=False"):
        _tpu.int4_product(
            jnp.ones((2, 4)),
            jnp.ones((4, 64), jnp.uint8),
            jnp.ones((4, 1)),
            group_size=128,
            nk=False,
            interpret=INTERPRET,
        )
    with pytest.raises(ValueError, match="pair: the bytes kernel"):
        _tpu.int4_product(
            jnp.ones((2, 128)),
            jnp.ones((4, 64), jnp.uint8),
            jnp.ones((4, 1)),
            group_size=128,
            mxu="int8",
            parts=3,
            pair=True,
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


def test_int8_pair_is_one_16_bit_quantization_in_two_halves(rng):
    """``int8_pair``: x ~ s1 (254 q0 + q1) per row within half a step s1 =
    max|row| / (127 * 254), q0 the int8-activation quantization itself, s0
    = 254 s1; a zero row is all zeros with scales 0."""
    x = rng.standard_normal((6, 300)).astype(np.float32) * np.float32(
        [[1], [1e-3], [1e4], [1], [1], [1]]
    )
    x[3] = 0
    x[4, 7] = -40  # one entry far past the others
    parts, scales = (np.asarray(a) for a in _tpu_parts.int8_pair(jnp.asarray(x)))
    assert parts.dtype == np.int8 and parts.shape == (2, 6, 300)
    q0, s0 = quantize_rows_np(x)
    np.testing.assert_array_equal(parts[0][[0, 1, 2, 3, 5]], q0[[0, 1, 2, 3, 5]])
    np.testing.assert_allclose(scales[0], 254 * scales[1].astype(np.float64), rtol=1e-7)
    np.testing.assert_allclose(scales[1], s0 / 254, rtol=1e-6)
    assert np.abs(parts[1]).max() <= 127
    value = scales[1][:, None] * (254.0 * parts[0] + parts[1])
    np.testing.assert_allclose(scales[1], np.abs(x).max(1) / (127 * 254), rtol=1e-6)
    # within half a step of the fine grid (its rounding, and float32's in x's rest)
    assert (np.abs(value - x).max(1) <= 0.501 * scales[1]).all()
    assert not value[3].any() and not scales[:, 3].any()


@pytest.mark.parametrize("group_size", [128, 256, 512])
@pytest.mark.parametrize(
    "m,blocks", [(1, None), (8, None), (13, None), (64, None), (70, (32, 256, 256))]
)
def test_int4_bytes_on_x_as_a_pair_match_numpy(rng, m, blocks, group_size):
    """The bytes kernel on ``int8_pair``'s halves, whose sums meet in int32
    before each group's scale, and on int8 parts, of one block of rows
    (only its rows padded to 8 scaled: 1, 8 and 13 rows of int8's 32) or
    several (70 rows in blocks of 32); G 512: a group's int32 sums stay
    exact (255 * 127 * 128 * 512 < 2**31)."""
    k, n = 2048, 300
    for pair in (True, False):
        options = dict(mode="groups", mxu="int8", parts=2, pair=pair)
        options["blocks"] = blocks or (512, 256, 512)
        got, want = int4_case(rng, m, k, n, group_size, **options)
        assert got.shape == (m, n)
        assert rel_err(got, want) <= INT8_TOLERANCE[2]


def test_the_pair_stays_exact_up_to_its_largest_group():
    """x and the weights at their largest levels (x all ones: level 127 of
    each row; weights all -1: nibble -8, -128 on the MXU), every entry of a
    group the most its int32 sums can take: exact at G = 512, and G = 1024
    (whose sums would overflow) refused; linear_int4 leaves the pair there."""
    k, n = 2048, 128
    x = jnp.ones((4, k))
    for group_size in (512, 1024):
        packed, scale = quantize_groups_np(-np.ones((n, k)), group_size)
        options = dict(mode="groups", mxu="int8", parts=2, interpret=INTERPRET)
        if not _tpu.takes_pair(group_size):
            with pytest.raises(ValueError, match="group_size 1024"):
                _tpu.int4_product(
                    x, packed, scale, group_size=group_size, pair=True, **options
                )
            continue
        got = _tpu.int4_product(
            x, packed, scale, group_size=group_size, pair=True, **options
        )
        np.testing.assert_allclose(np.asarray(got), -k, rtol=1e-6)
    assert _tpu.takes_pair(512) and not _tpu.takes_pair(640)


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


@pytest.mark.parametrize("parts,tolerance", [(1, 2.0**-7), (3, 1e-6)])
@pytest.mark.parametrize("group_size", [32, 128, 256])
@pytest.mark.parametrize(
    "m,blocks", [(1, None), (70, (32, 128, 256))], ids=["one_block", "blocks"]
)
def test_the_vjps_int4_product_matches_numpy(
    rng, m, blocks, group_size, parts, tolerance
):
    """Mode tile with ``nk=False``: y_bar (m, n) @ W (n, k), the sums over N
    (300 rows of weights, padded to their blocks), the output's columns put
    back in K's order from the tile's (each block of K its even entries,
    then its odd ones), over several blocks of every axis; one bf16 part
    rounds the dequantized weights to bf16 as well as y_bar."""
    n, k = 300, {32: 1216, 128: 1280, 256: 2048}[group_size]
    g = rng.standard_normal((m, n)).astype(np.float32)
    packed, scale = quantize_groups_np(rng.standard_normal((n, k)), group_size)
    options = dict(mode="tile", parts=parts, nk=False, interpret=INTERPRET)
    if blocks:
        options["blocks"] = blocks
    got = _tpu.int4_product(g, packed, scale, group_size=group_size, **options)
    want = g.astype(np.float64) @ dequantized_int4(packed, scale, group_size)
    assert got.shape == (m, k) and got.dtype == jnp.float32
    assert rel_err(got, want) <= tolerance


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
    with pytest.raises(TypeError, match=r"x \(2, 256\).*y_bar \(m, n\)"):
        _tpu.int4_product(  # y_bar's width is the weights' rows (4), not K
            jnp.ones((2, 256)),
            jnp.ones((4, 128), jnp.uint8),
            jnp.ones((4, 4)),
            group_size=64,
            mode="tile",
            nk=False,
        )
    with pytest.raises(ValueError, match="group_size 0"):
        _tpu.int4_product(
            jnp.ones((2, 256)),
            jnp.ones((4, 128), jnp.uint8),
            jnp.ones((4, 2)),
            group_size=0,
        )


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
