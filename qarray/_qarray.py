"""The quantized array: value class, hijax type, mapping spec and partition spec."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.hijax import (
    HiPspec,
    HiType,
    MappingSpec,
    ShapedArray,
    register_hitype,
)
from jax.sharding import NamedSharding

INT8 = jnp.dtype("int8")
UINT8 = jnp.dtype("uint8")  # int4 values, two per byte
FLOAT32 = jnp.dtype("float32")

# The manual-axis type of a value outside shard_map (nothing varies). Read off a
# fresh aval rather than imported, because its class lives in jax._src.
EMPTY_MAT = ShapedArray((), INT8).manual_axis_type


@dataclass(frozen=True)
class QArray:
    """An int8 array with one float32 scale per row (or, packed, an int4 array
    with one scale per group of a row: see below).

    Invariants (enforced by the primitives, the only code that builds one):

    - ``qvalue``: int8 ``[*lead, n]`` with every entry in ``[-127, 127]``;
    - ``scale``: float32 ``[*lead]`` with ``scale >= 0``, i.e.
      ``scale.shape == qvalue.shape[:-1]``;
    - the represented array is ``qvalue * scale[..., None]``;
    - for ``q = quantize(x)``: ``scale = max_j |x[..., j]| / 127`` and
      ``qvalue = round_half_even(x / scale[..., None])``; an all-zero row has
      ``scale = 0`` and ``qvalue = 0``.

    int4 (``quantize(x, bits=4, group_size=G)``, type ``q4[..., n]``):
    ``qvalue`` is uint8 ``[*lead, n / 2]``, two values in [-7, 7] per byte
    (4-bit two's complement, the low nibble holds the even index), and
    ``scale`` float32 ``[*lead, n / G]``, one per group of G consecutive
    entries of a row: ``x[..., j] ~ value[..., j] * scale[..., j // G]``.

    Under a trace a quantized array is a tracer of type ``q8[...]`` (or
    ``q4[...]``), not a ``QArray``: read ``qvalue``/``scale`` only on concrete
    values.
    """

    qvalue: Any
    scale: Any


def full_spec(sharding, ndim: int) -> tuple:
    """The sharding's partition spec as a tuple of exactly ``ndim`` entries."""
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def with_spec(sharding, spec) -> NamedSharding:
    """``sharding`` with its partition spec replaced."""
    return sharding.update(spec=jax.P(*spec))


def _format_dims(shape, spec) -> str:
    dims = []
    for size, part in zip(shape, spec, strict=True):
        if part is None:
            dims.append(str(size))
        elif isinstance(part, tuple):
            dims.append(f"{size}@({','.join(part)})")
        else:
            dims.append(f"{size}@{part}")
    return ",".join(dims)


def _format_varying(mat, mesh) -> str:
    varying = getattr(mat, "varying", frozenset())
    if not varying:
        return ""
    names = [name for name in mesh.axis_names if name in varying]
    return "{V:" + ",".join(names) + "}"


@dataclass(frozen=True)
class QArraySpec(MappingSpec):
    """``vmap``/``scan`` mapping spec: a QArray is mapped along its leading axis.

    A batch of ``b`` values of type ``q8[*s, n]`` is one ``q8[b, *s, n]``
    (its scales stack to ``f32[b, *s]``), so no data is needed.
    """


@dataclass(frozen=True)
class QArrayP(HiPspec):
    """``shard_map`` partition spec for a QArray.

    ``spec`` partitions the leading axes; ``qvalue`` and ``scale`` get the same
    spec, so every row travels with its scale and the last (row) axis of
    ``qvalue`` is never split.
    """

    spec: jax.P

    def to_lo(self):
        return (self.spec, self.spec)

    # tangents and cotangents of a QArray are dense float32 arrays that live
    # where the QArray's qvalue lives
    def to_tangent_spec(self):
        return self.spec

    def to_ct_spec(self):
        return self.spec.to_ct_spec()


@dataclass(frozen=True)
class QArrayTy(HiType):
    """The type of a QArray: prints as ``q8[2,3]`` (``q8[8@i,3]`` when sharded).

    ``sharding`` is the sharding of ``qvalue``; ``scale`` shards like it with
    the last axis dropped. ``mat`` is the manual-axis type inside
    ``shard_map`` (which mesh axes the value varies over), carried so that
    tangent and cotangent types match their primals under ``check_vma``.
    """

    shape: tuple[int, ...]
    sharding: NamedSharding
    mat: Any = EMPTY_MAT
    bits: int = 8  # 8: int8 per row; 4: packed int4 per group
    group_size: int | None = None  # int4: entries of a row per scale

    @staticmethod
    def like(aval, shape=None, spec=None, bits=8, group_size=None) -> QArrayTy:
        """The QArray type with ``aval``'s sharding and varying axes.

        ``shape``/``spec`` override the shape and partition spec; ``bits``
        and ``group_size`` give the int4 type.
        """
        shape = tuple(aval.shape) if shape is None else tuple(shape)
        if bits == 4 and shape and shape[-1] == 0:
            group_size = DEFAULT_GROUP_SIZE  # as kind_of_parts reads it
        sharding = aval.sharding
        if spec is not None:
            sharding = with_spec(sharding, spec)
        return QArrayTy(shape, sharding, aval.manual_axis_type, bits, group_size)

    def _from_qvalue(self, qvalue_ty) -> QArrayTy:
        """This type's kind (bits, group size) with the payload type
        ``qvalue_ty``'s shape (unpacked), sharding and varying axes."""
        shape = tuple(qvalue_ty.shape)
        if self.bits == 4:
            shape = (*shape[:-1], 2 * shape[-1])
        return QArrayTy.like(qvalue_ty, shape, None, self.bits, self.group_size)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def spec(self) -> tuple:
        return full_spec(self.sharding, self.ndim)

    # --- lowering: an int8 payload and a float32 scale per row (int4: a
    # packed uint8 payload and a scale per group, both of the type's rank)
    def lo_ty(self):
        spec = self.spec
        if self.bits == 4:
            *lead, n = self.shape
            return [
                ShapedArray(
                    (*lead, n // 2),
                    UINT8,
                    sharding=with_spec(self.sharding, spec),
                    manual_axis_type=self.mat,
                ),
                ShapedArray(
                    (*lead, n // self.group_size),
                    FLOAT32,
                    sharding=with_spec(self.sharding, spec),
                    manual_axis_type=self.mat,
                ),
            ]
        return [
            ShapedArray(
                self.shape,
                INT8,
                sharding=with_spec(self.sharding, spec),
                manual_axis_type=self.mat,
            ),
            ShapedArray(
                self.shape[:-1],
                FLOAT32,
                sharding=with_spec(self.sharding, spec[:-1]),
                manual_axis_type=self.mat,
            ),
        ]

    def lower_val(self, q):
        return [q.qvalue, q.scale]

    def raise_val(self, qvalue, scale):
        return QArray(qvalue, scale)

    # --- autodiff: tangents are the dense float32 arrays a QArray approximates
    def to_tangent_aval(self):
        return ShapedArray(
            self.shape,
            FLOAT32,
            sharding=with_spec(self.sharding, self.spec),
            manual_axis_type=self.mat,
        )

    # --- vmap and scan: batches stack along the leading axis
    def dec_rank(self, size, spec):
        _check_mapping_spec(spec)
        if self.ndim < 2 or (size is not None and self.shape[0] != size):
            raise TypeError(
                f"cannot map over a leading axis of size {size} of {self}: a "
                "mapped QArray needs rank >= 2 and a leading axis of that size."
            )
        return replace(
            self, shape=self.shape[1:], sharding=with_spec(self.sharding, self.spec[1:])
        )

    def inc_rank(self, size, spec):
        _check_mapping_spec(spec)
        return replace(
            self,
            shape=(size, *self.shape),
            sharding=with_spec(self.sharding, (None, *self.spec)),
        )

    def leading_axis_spec(self):
        return QArraySpec()

    # --- shard_map: delegate to the qvalue component's type
    def shard(self, mesh, manual_axes, check_vma, spec):
        qvalue_spec, _ = _check_pspec(spec).to_lo()
        qvalue_ty = self.lo_ty()[0].shard(mesh, manual_axes, check_vma, qvalue_spec)
        return self._from_qvalue(qvalue_ty)

    def unshard(self, mesh, check_vma, spec):
        qvalue_spec, _ = _check_pspec(spec).to_lo()
        qvalue_ty = self.lo_ty()[0].unshard(mesh, check_vma, qvalue_spec)
        return self._from_qvalue(qvalue_ty)

    def nospec(self, mesh, check_vma, all_names):
        # autodiff residuals are stacked along the leading axis across devices,
        # like array residuals; the scale needs a leading axis of its own
        if self.ndim < 2:
            raise TypeError(
                f"a {self} residual cannot cross a shard_map boundary: use a "
                "QArray of rank >= 2 inside shard_map under autodiff."
            )
        return QArrayP(self.lo_ty()[1].nospec(mesh, check_vma, all_names))

    def str_short(self, short_dtypes=False, mesh_axis_types=False):
        del short_dtypes, mesh_axis_types
        dims = _format_dims(self.shape, self.spec)
        return f"q{self.bits}[{dims}]{_format_varying(self.mat, self.sharding.mesh)}"

    __repr__ = str_short


def _check_mapping_spec(spec):
    if not isinstance(spec, QArraySpec):
        raise TypeError(
            "a QArray is mapped with qarray.QArraySpec() as its in_axes/out_axes "
            f"entry, got {spec!r}."
        )


def _check_pspec(spec):
    # JAX itself hands a plain P() to values that enter an eager shard_map
    # replicated; a plain spec means the same as QArrayP(spec)
    if isinstance(spec, jax.P):
        return QArrayP(spec)
    if not isinstance(spec, QArrayP):
        raise TypeError(
            "a QArray crosses shard_map with a qarray.QArrayP(P(...)) "
            f"in_specs/out_specs entry, got {spec!r}."
        )
    return spec


DEFAULT_GROUP_SIZE = 128  # int4: entries of a row per scale, GPTQ's and torchao's


def kind_of_parts(qvalue, scale) -> tuple[int, int | None]:
    """(bits, group_size) of a QArray's parts, read from their dtype and
    shapes (arrays or avals): int8 ``qvalue`` -> (8, None); uint8 ``qvalue
    [..., n / 2]`` with ``scale [..., n / G]`` -> (4, G). The one place the
    kind is inferred (the type, ``qarray.jit``'s parts, model files). Rows
    of no entries (n = 0) hold no group to measure: every G lays them out
    alike, and they read as ``DEFAULT_GROUP_SIZE``."""
    if qvalue.dtype != UINT8:
        return 8, None
    if qvalue.shape[-1] == 0:
        return 4, DEFAULT_GROUP_SIZE
    return 4, 2 * qvalue.shape[-1] // max(scale.shape[-1], 1)


def _typeof_qarray(q: QArray) -> QArrayTy:
    qvalue = jax.typeof(q.qvalue)
    bits, group_size = kind_of_parts(qvalue, q.scale)
    if bits == 8:
        return QArrayTy.like(qvalue)
    *lead, half = qvalue.shape
    return QArrayTy.like(qvalue, (*lead, 2 * half), None, bits, group_size)


register_hitype(QArray, _typeof_qarray)
