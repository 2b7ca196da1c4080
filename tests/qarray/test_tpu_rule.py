"""Which of qarray/_tpu's kernels, and which form of x, a TPU's products
take: the TPU rule's rows and blocks (``qarray/_rules.py``, ``TPU``), the
parts each precision asks for, the kernels only where they compile and where
XLA does not partition the program. The kernels' numerics:
test_tpu_kernels.py.

Covers: qarray/_tpu/_available.py, qarray/_tpu/_parts.py"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qarray as qa
from qarray import _formulations, _rules, _tpu
from qarray._tpu import _available


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


def test_the_int4_strategies_follow_the_tpu_rule(monkeypatch):
    rule = _rules.for_tpu()
    monkeypatch.setattr(_formulations, "_tpu_available", lambda: True)
    monkeypatch.setattr(_formulations, "_partitioned", lambda: False)

    def strategy(m, group, activations, parts=1):
        return _formulations.int4_tpu_strategy(m, group, activations, parts)

    # G a multiple of 128: the groups mode, weight-only and W4A8 (the bytes
    # kernel, or at one row of the default precision the shifts: below);
    # weight-only at one bf16 pass the tile kernel past the bytes' rows at
    # that pass; past its rows XLA's, weight-only on the bytes read as
    # jnp.int4 at one bf16 pass, the float32 dequantization at finer
    # precisions and for W4A8
    for activations in ("float32", "int8"):
        assert strategy(1, 128, activations) == "pallas_groups"
    bytes_rows = rule.int4_bytes_max_rows
    assert strategy(bytes_rows, 256, "int8") == "pallas_groups"
    assert strategy(bytes_rows, 256, "float32", parts=3) == "pallas_groups"
    one_pass = rule.int4_bytes_pass_max_rows
    assert strategy(one_pass, 128, "float32") == "pallas_groups"
    assert strategy(one_pass + 1, 128, "float32") == "pallas_tile"
    assert strategy(rule.int4_tile_max_rows, 256, "float32") == "pallas_tile"
    past = max(rule.int4_bytes_max_rows, rule.int4_tile_max_rows) + 1
    assert strategy(past, 128, "float32") == "int4_bf16"
    assert strategy(past, 128, "float32", parts=3) == "dequantize"
    assert strategy(past, 128, "int8") == "dequantize"
    # other sizes: the shifts, then the tile, weight-only
    assert strategy(rule.int4_groups_max_rows, 32, "float32") == "pallas_groups"
    assert strategy(rule.int4_groups_max_rows + 1, 64, "float32") == "pallas_tile"
    assert strategy(rule.int4_tile_max_rows + 1, 64, "float32") == "int4_bf16"
    assert strategy(1, 64, "int8") == "dequantize"  # W4A8: XLA's
    # G / 2 neither divides 128 nor is a multiple of it: XLA's
    assert strategy(1, 96, "float32") == "int4_bf16"
    assert strategy(1, 96, "float32", parts=2) == "dequantize"
    assert strategy(1, 0, "float32") == "int4_bf16"  # k = 0: no groups
    monkeypatch.setattr(_formulations, "_tpu_available", lambda: False)
    assert strategy(1, 128, "float32") == "int4_bf16"
    assert strategy(1, 128, "int8") == "dequantize"


def test_int4_on_a_tpu_lowers_the_strategy_its_precision_takes(monkeypatch):
    """linear_q on int4 weights exported for a TPU (``jax.export``, the TPU's
    branch traced as on a chip, its kernels taken as not compiling, as on a
    chip whose libtpu refuses them): at the default precision XLA's
    int4_bf16 (the bytes read as jnp.int4, so the program holds int4
    values), at the highest, or with the weights' precision the highest, the
    float32 dequantization (no int4 values), and on CPU (this backend's
    lowering) neither."""
    from jax import export

    import qarray as qa

    monkeypatch.setattr(_formulations, "_on_tpu", lambda: True)
    monkeypatch.setattr(_formulations, "_tpu_available", lambda: False)
    q = qa.quantize(jnp.ones((256, 256)), bits=4, group_size=128)
    x = jax.ShapeDtypeStruct((4, 256), jnp.float32)

    def product(precision):
        return jax.jit(lambda x: qa.linear_q(x, q, precision=precision))

    def on_a_tpu(precision):
        return export.export(product(precision), platforms=["tpu"])(x).mlir_module()

    assert "xi4>" in on_a_tpu(lax.Precision.DEFAULT)
    assert "xi4>" not in on_a_tpu(lax.Precision.HIGHEST)
    assert "xi4>" not in on_a_tpu((lax.Precision.DEFAULT, lax.Precision.HIGHEST))
    monkeypatch.setattr(_formulations, "_on_tpu", lambda: False)
    assert "xi4>" not in product(lax.Precision.DEFAULT).lower(x).as_text()


def test_int4s_x_cotangent_on_a_tpu_reads_the_weights_as_int4(monkeypatch):
    """The VJP's product for x on int4 weights, exported for a TPU: for a
    layer past one float32 block (256 x 2048: 2 MiB) at one bf16 pass it
    reads the bytes as jnp.int4 (bf16 blocks); at the highest precision, or
    with the weights' the highest, float32 blocks by shifts; a layer within
    one block keeps the float32 whole form at any precision (its product
    carries the weights' tangent). The forward is held to dequantize here,
    so only the backward can hold int4 values; and it still transforms:
    vmap of grad over stacked int4 weights, the platform's branches taking
    their parts as plain arrays."""
    from jax import export

    import qarray as qa

    monkeypatch.setattr(_formulations, "_on_tpu", lambda: True)
    monkeypatch.setattr(_formulations, "int4_tpu_strategy", lambda *args: "dequantize")

    def backward(q, precision):
        def ct_x(x):
            y, pull = jax.vjp(lambda x: qa.linear_q(x, q, precision=precision), x)
            return pull(y)[0]

        x = jax.ShapeDtypeStruct((4, jax.typeof(q).shape[1]), jnp.float32)
        return export.export(jax.jit(ct_x), platforms=["tpu"])(x).mlir_module()

    large = qa.quantize(jnp.ones((256, 2048)), bits=4, group_size=128)
    assert "xi4>" in backward(large, lax.Precision.DEFAULT)
    assert "xi4>" not in backward(large, lax.Precision.HIGHEST)
    pair = (lax.Precision.DEFAULT, lax.Precision.HIGHEST)
    assert "xi4>" not in backward(large, pair)
    small = qa.quantize(jnp.ones((256, 256)), bits=4, group_size=128)
    assert "xi4>" not in backward(small, lax.Precision.DEFAULT)

    ws = jnp.stack([jnp.ones((256, 2048)), -jnp.ones((256, 2048))])
    stacked = jax.vmap(
        lambda w: qa.quantize(w, bits=4, group_size=128), out_axes=qa.QArraySpec()
    )(ws)

    def loss(x, q):
        return jnp.sum(qa.linear_q(x, q, precision=lax.Precision.DEFAULT) ** 2)

    grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, qa.QArraySpec())))(
        jnp.ones((2, 3, 2048)), stacked
    )
    # this CPU runs the default branch: g = 2 y, y = x @ W.T, W = +-1
    want = 2 * 2048.0 * 256.0
    np.testing.assert_allclose(np.asarray(grads[0]), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads[1]), want, rtol=1e-6)


def test_int4s_x_cotangent_takes_the_tile_kernel_where_it_runs(monkeypatch):
    """Where the TPU's kernels run, the VJP's product for x on int4 weights
    at one bf16 pass is the tile kernel (one Mosaic call, no jnp.int4 read)
    up to the rule's int4_tile_max_rows rows of y_bar, past them the bf16
    blocks; vmap of grad over stacked int4 weights lowers through it too."""
    from jax import export

    import qarray as qa

    monkeypatch.setattr(_formulations, "_on_tpu", lambda: True)
    monkeypatch.setattr(_formulations, "_tpu_available", lambda: True)
    monkeypatch.setattr(_formulations, "_partitioned", lambda: False)
    monkeypatch.setattr(_formulations, "int4_tpu_strategy", lambda *args: "dequantize")
    q = qa.quantize(jnp.ones((256, 2048)), bits=4, group_size=128)

    def lowered(fn, *shapes):
        return export.export(jax.jit(fn), platforms=["tpu"])(*shapes).mlir_module()

    def ct_x(x):
        y, pull = jax.vjp(
            lambda x: qa.linear_q(x, q, precision=lax.Precision.DEFAULT), x
        )
        return pull(y)[0]

    rows = _rules.for_tpu().int4_tile_max_rows
    text = lowered(ct_x, jax.ShapeDtypeStruct((rows, 2048), jnp.float32))
    assert "tpu_custom_call" in text and "xi4>" not in text
    text = lowered(ct_x, jax.ShapeDtypeStruct((rows + 1, 2048), jnp.float32))
    assert "tpu_custom_call" not in text and "xi4>" in text

    stacked = jax.vmap(
        lambda w: qa.quantize(w, bits=4, group_size=128), out_axes=qa.QArraySpec()
    )(jnp.ones((2, 256, 2048)))

    def loss(x, q):
        return jnp.sum(qa.linear_q(x, q, precision=lax.Precision.DEFAULT) ** 2)

    grads = jax.vmap(jax.grad(loss), in_axes=(0, qa.QArraySpec()))
    x = jax.ShapeDtypeStruct((2, 3, 2048), jnp.float32)
    assert "tpu_custom_call" in lowered(grads, x, stacked)


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
    xla = ("dequantize", "int4_bf16")

    def chosen():
        return (
            _formulations.choose_strategy(8, 1024, 1024, "float32", "tpu", "nk"),
            _formulations.int4_tpu_strategy(8, 128, "float32", 1),
        )

    one_device = jax.device_count() == 1
    assert chosen() == (kernels if one_device else xla)
    size = min(2, jax.device_count())
    mesh = jax.make_mesh((size,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        assert chosen() == (kernels if size == 1 else xla)
        seen = []

        def per_device(x):
            seen.append(chosen())
            return x

        x = jax.reshard(jnp.ones((size, 4)), jax.P("i"))
        jax.shard_map(per_device, in_specs=jax.P("i"), out_specs=jax.P("i"))(x)
        assert seen == [kernels]


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
            _tpu.int8_product(x, w, s, nk=True, interpret=not _tpu.available())
            _tpu.int4_product(
                x, packed, groups, group_size=128, interpret=not _tpu.available()
            )
    rule = _rules.for_tpu()
    assert seen == [(32, 128, 128)] * 2 + [rule.int8_blocks, rule.int4_groups_blocks]


@pytest.mark.parametrize(
    "precision,m,pair",
    [
        (lax.Precision.DEFAULT, 1, True),
        (lax.Precision.DEFAULT, 64, True),
        (lax.Precision.DEFAULT, 65, False),
        (lax.Precision.HIGHEST, 8, False),
    ],
)
def test_int4_bytes_take_x_as_a_pair_up_to_its_rows(monkeypatch, precision, m, pair):
    """linear_int4 on the bytes kernel (G = 128) at the default precision
    (x's two int8 parts) takes them as ``int8_pair`` up to the rule's
    int4_pair_max_rows, at the rule's int4_bytes_blocks; three parts
    ("highest") never."""
    from qarray._tpu import _int4

    seen = []
    original = _int4._jitted
    monkeypatch.setattr(
        _int4,
        "_jitted",
        lambda *a, **kw: seen.append(kw) or original(*a, **kw),
    )
    packed, scale = jnp.ones((128, 128), jnp.uint8), jnp.ones((128, 2))
    with _rules.overriding(int4_bf16_max_rows=0):
        _formulations.linear_int4(
            jnp.ones((m, 256)),
            packed,
            scale,
            strategy="pallas_groups",
            precision=precision,
        )
    (options,) = seen
    assert options["pair"] is pair and options["mxu"] == "int8"
    assert options["blocks"] == _rules.for_tpu().int4_bytes_blocks
    # groups whose pair sums would overflow int32 keep the two parts
    seen.clear()
    with _rules.overriding(int4_bf16_max_rows=0):
        _formulations.linear_int4(
            jnp.ones((m, 2048)),
            jnp.ones((128, 1024), jnp.uint8),
            jnp.ones((128, 2)),
            strategy="pallas_groups",
            precision=precision,
        )
    assert seen[0]["pair"] is False


def test_the_int4_tile_kernel_blocks_k_by_its_groups_not_by_eight(monkeypatch):
    """The tile kernel's scales block spans a block's groups along its last
    axis, so large groups keep the rule's K block (the groups kernels' tiles
    take 8 groups a block); jnp.int4 weights never take the bytes' blocks."""
    from qarray._tpu import _int4

    rule = _rules.for_tpu()
    blocks = rule.int4_tile_blocks
    _, _, (kp2, bk2) = _int4.padded_blocks(8, 4096, 8192, 512, jnp.bfloat16, blocks, 1)
    assert (kp2, bk2) == (4096, blocks[2])
    _, _, (_, groups_bk2) = _int4.padded_blocks(8, 4096, 8192, 512, jnp.int8, blocks)
    assert groups_bk2 == 4096  # 8 groups of 512 bytes
    seen = []
    original = _int4._jitted
    monkeypatch.setattr(
        _int4,
        "_jitted",
        lambda *a, **kw: seen.append(kw["blocks"]) or original(*a, **kw),
    )
    x, scale = jnp.ones((2, 256)), jnp.ones((128, 2))
    for weights in (jnp.ones((128, 128), jnp.uint8), jnp.ones((128, 256), jnp.int4)):
        _tpu.int4_product(
            x,
            weights,
            scale,
            group_size=128,
            mxu="int8",
            parts=2,
            interpret=not _tpu.available(),
        )
    assert seen == [rule.int4_bytes_blocks, rule.int4_groups_blocks]


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


def test_the_int4_tile_cotangent_and_its_derivatives_match_numpy():
    """The VJP's int4 tile kernel (``_int4_tile_cotangent``: y_bar @ W, one
    bf16 pass, interpreted off a TPU) against NumPy: its value, its JVP in
    y_bar and in the scales, and grad of a function of it (its transpose,
    which a Pallas call lacks: the bf16 blocks' derivatives stand in), so a
    second derivative through the backward runs."""
    from qarray import _primitives
    from qarray._numerics import quantize_groups_np

    rng = np.random.default_rng(5)
    m, n, k, group = 3, 200, 512, 128
    g = rng.standard_normal((m, n)).astype(np.float32)
    packed, scale = quantize_groups_np(rng.standard_normal((n, k)), group)
    nibbles = np.stack([packed & 15, packed >> 4], -1).reshape(n, k).astype(np.int16)
    nibbles = np.where(nibbles > 7, nibbles - 16, nibbles).astype(np.float64)
    dense = nibbles * np.repeat(scale.astype(np.float64), group, 1)

    def product(g, scale):
        return _primitives._int4_tile_cotangent(group, g, jnp.asarray(packed), scale)

    def close(got, want):
        got = np.asarray(got, np.float64)
        assert np.linalg.norm(got - want) <= 2.0**-7 * np.linalg.norm(want)

    close(product(g, scale), g @ dense)
    t_g = rng.standard_normal((m, n)).astype(np.float32)
    t_s = rng.standard_normal(scale.shape).astype(np.float32)
    value, tangent = jax.jvp(product, (g, scale), (t_g, t_s))
    close(value, g @ dense)
    t_dense = nibbles * np.repeat(t_s.astype(np.float64), group, 1)
    close(tangent, t_g @ dense + g @ t_dense)
    weights = rng.standard_normal((m, k)).astype(np.float32)
    grad_g = jax.grad(lambda g: jnp.sum(weights * product(g, scale)))(g)
    close(grad_g, weights @ dense.T)
    # second order: d/dg of the gradient of sum(product(g)^2) / 2 in g
    hvp = jax.jvp(
        jax.grad(lambda g: jnp.sum(product(g, scale) ** 2) / 2), (g,), (t_g,)
    )[1]
    close(hvp, t_g @ dense @ dense.T)
