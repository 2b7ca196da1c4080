"""The hijax doc's tuple type: a container of any JAX values, hi types included."""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.experimental.hijax import HiPrim, HiType, MappingSpec, register_hitype

from ._ops import type_str


@dataclass(frozen=True)
class HiTup:
    """A tuple value; build it with ``make_tup``, read it with ``get_tuple_element``."""

    elts: tuple


@dataclass(frozen=True)
class TupSpec(MappingSpec):
    """One ``vmap`` axis entry per element: an int, None, or a hi type's spec.

    ``TupSpec((0, None))`` maps element 0 along its axis 0 and leaves element 1
    unmapped.
    """

    val: tuple


@dataclass(frozen=True)
class TupTy(HiType):
    """Type ``Tup{f32[3],f32[]}``: every method delegates to the element types."""

    tys: tuple

    def lo_ty(self):
        return [lo for ty in self.tys for lo in ty.lo_ty()]

    def lower_val(self, tup):
        return [
            lo
            for ty, elt in zip(self.tys, tup.elts, strict=True)
            for lo in ty.lower_val(elt)
        ]

    def raise_val(self, *los):
        elts, start = [], 0
        for ty in self.tys:
            width = len(ty.lo_ty())
            elts.append(ty.raise_val(*los[start : start + width]))
            start += width
        return HiTup(tuple(elts))

    def to_tangent_aval(self):
        return TupTy(tuple(ty.to_tangent_aval() for ty in self.tys))

    def dec_rank(self, size, spec):
        return TupTy(
            tuple(
                ty if s is None else ty.dec_rank(size, s)
                for ty, s in zip(self.tys, _spec_val(spec, self), strict=True)
            )
        )

    def inc_rank(self, size, spec):
        return TupTy(
            tuple(
                ty if s is None else ty.inc_rank(size, s)
                for ty, s in zip(self.tys, _spec_val(spec, self), strict=True)
            )
        )

    def str_short(self, short_dtypes=False, mesh_axis_types=False):
        return (
            "Tup{"
            + ",".join(t.str_short(short_dtypes, mesh_axis_types) for t in self.tys)
            + "}"
        )

    __repr__ = str_short


def _spec_val(spec, ty):
    if not isinstance(spec, TupSpec) or len(spec.val) != len(ty.tys):
        raise TypeError(
            f"a {ty} is mapped with a TupSpec of {len(ty.tys)} entries, got {spec!r}."
        )
    return spec.val


register_hitype(HiTup, lambda t: TupTy(tuple(jax.typeof(e) for e in t.elts)))


class MakeTup(HiPrim):
    """(a, b, ...) -> Tup{typeof(a), typeof(b), ...}."""

    def __init__(self, elt_avals):
        # materialise once: the element types are read twice (a one-shot
        # iterator would leave the declared tuple type empty under jit)
        elt_avals = tuple(elt_avals)
        self.in_avals = elt_avals
        self.out_aval = TupTy(elt_avals)
        self.params = {}
        super().__init__()

    def expand(self, *elts):
        return HiTup(elts)

    def batch(self, axis_data, args, dims):
        return make_tup(*args), TupSpec(tuple(dims))


class GetTupElt(HiPrim):
    """Tup{..., T_idx, ...} -> T_idx."""

    def __init__(self, tup_aval, idx):
        if not isinstance(tup_aval, TupTy):
            raise TypeError(
                f"get_tuple_element requires a tuple, got {type_str(tup_aval)}."
            )
        if not isinstance(idx, int) or not 0 <= idx < len(tup_aval.tys):
            raise ValueError(
                f"get_tuple_element requires 0 <= idx < {len(tup_aval.tys)}, "
                f"got idx={idx!r} for {tup_aval}."
            )
        self.in_avals = (tup_aval,)
        self.out_aval = tup_aval.tys[idx]
        self.params = {"idx": idx}
        super().__init__()

    def expand(self, tup):
        return tup.elts[self.idx]

    def batch(self, axis_data, args, dims):
        (tup,), (spec,) = args, dims
        out = get_tuple_element(tup, self.idx)
        # batch rules also run when nothing is batched
        return out, None if spec is None else spec.val[self.idx]


def make_tup(*elts):
    """A tuple value holding ``elts`` (arrays or hi values)."""
    return MakeTup(jax.typeof(e) for e in elts)(*elts)


def get_tuple_element(tup, idx):
    """Element ``idx`` (a static int) of a tuple value."""
    return GetTupElt(jax.typeof(tup), idx)(tup)
