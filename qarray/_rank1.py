"""The hijax doc's rank-1 matrix type: an m x n matrix kept as col (x) row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.hijax import HiPrim, HiType, ShapedArray, register_hitype
from jax.sharding import NamedSharding

from ._ops import CompiledWhenEager, Parts, type_str
from ._qarray import FLOAT32, full_spec, with_spec


@dataclass(frozen=True)
class Rank1:
    """The matrix ``outer(col, row)``: ``col`` f32[m], ``row`` f32[n].

    Never materialised: ops consume the factors directly.
    """

    col: Any
    row: Any


@dataclass(frozen=True)
class Rank1Ty(HiType):
    """Type ``r1[m,n]``; ``sharding`` is that of the dense matrix represented.

    The dense row axis is carried by ``col``, the dense column axis by ``row``.
    """

    shape: tuple[int, int]
    sharding: NamedSharding

    def lo_ty(self):
        (m, n), (row_part, col_part) = self.shape, full_spec(self.sharding, 2)
        return [
            ShapedArray((m,), FLOAT32, sharding=with_spec(self.sharding, (row_part,))),
            ShapedArray((n,), FLOAT32, sharding=with_spec(self.sharding, (col_part,))),
        ]

    def lower_val(self, r1):
        return [r1.col, r1.row]

    def raise_val(self, col, row):
        return Rank1(col, row)

    # rank-1 matrices are not closed under addition: tangents are dense
    def to_tangent_aval(self):
        spec = full_spec(self.sharding, 2)
        return ShapedArray(self.shape, FLOAT32, sharding=with_spec(self.sharding, spec))

    def str_short(self, short_dtypes=False, mesh_axis_types=False):
        del short_dtypes, mesh_axis_types
        dims = [
            str(d) if p is None else f"{d}@{p}"
            for d, p in zip(self.shape, full_spec(self.sharding, 2), strict=True)
        ]
        return f"r1[{','.join(dims)}]"

    __repr__ = str_short


def _dense_sharding(col_aval, row_aval):
    (col_part,) = full_spec(col_aval.sharding, 1)
    (row_part,) = full_spec(row_aval.sharding, 1)
    return with_spec(col_aval.sharding, (col_part, row_part))


register_hitype(
    Rank1,
    lambda r1: Rank1Ty(
        (r1.col.shape[0], r1.row.shape[0]),
        _dense_sharding(jax.typeof(r1.col), jax.typeof(r1.row)),
    ),
)


def _require_vector(name, what, aval):
    if not isinstance(aval, ShapedArray) or aval.dtype != FLOAT32 or aval.ndim != 1:
        raise TypeError(
            f"{name} requires {what} to be a float32 vector, got {type_str(aval)}."
        )


class Outer(CompiledWhenEager, HiPrim):
    """f32[m], f32[n] -> r1[m,n]."""

    def __init__(self, col_aval, row_aval):
        _require_vector("outer", "col", col_aval)
        _require_vector("outer", "row", row_aval)
        self.in_avals = (col_aval, row_aval)
        self.out_aval = Rank1Ty(
            (col_aval.shape[0], row_aval.shape[0]), _dense_sharding(col_aval, row_aval)
        )
        self.params = {}
        super().__init__()

    def expand(self, col, row):
        return Rank1(col, row)

    def vjp_fwd(self, nzs_in, col, row):
        return self(col, row), (col, row)

    def vjp_bwd_retval(self, res, g):  # g is dense: f32[m, n]
        col, row = res
        return g @ row, col @ g


class Factors(Parts, HiPrim):
    """r1[m,n] -> (f32[m], f32[n]): the accessor rules use instead of attributes."""

    def __init__(self, r1_aval):
        if not isinstance(r1_aval, Rank1Ty):
            raise TypeError(f"factors requires a Rank1 (r1), got {type_str(r1_aval)}.")
        super().__init__(r1_aval)

    def expand(self, r1):
        return (r1.col, r1.row)


class MatmulR1(CompiledWhenEager, HiPrim):
    """f32[b, m] @ r1[m, n] -> f32[b, n], without forming the m x n matrix."""

    def __init__(self, x_aval, r1_aval):
        if not isinstance(r1_aval, Rank1Ty):
            raise TypeError(
                f"matmul_r1 requires r1 to be a Rank1 (r1), got {type_str(r1_aval)}."
            )
        if not (
            isinstance(x_aval, ShapedArray)
            and x_aval.dtype == FLOAT32
            and x_aval.ndim == 2
            and x_aval.shape[1] == r1_aval.shape[0]
        ):
            raise TypeError(
                "matmul_r1 requires a float32 matrix x with x.shape[1] == "
                f"r1.shape[0], got {type_str(x_aval)} @ {type_str(r1_aval)}."
            )
        x_spec, r1_spec = full_spec(x_aval.sharding, 2), full_spec(r1_aval.sharding, 2)
        self.in_avals = (x_aval, r1_aval)
        self.out_aval = ShapedArray(
            (x_aval.shape[0], r1_aval.shape[1]),
            FLOAT32,
            sharding=with_spec(x_aval.sharding, (x_spec[0], r1_spec[1])),
        )
        self.params = {}
        super().__init__()

    def expand(self, x, r1):
        return jnp.outer(x @ r1.col, r1.row)  # never materialise col (x) row

    def vjp_fwd(self, nzs_in, x, r1):
        col, row = factors(r1)  # rules are traced code: primitives, not attributes
        return self(x, r1), (x, col, row)

    def vjp_bwd_retval(self, res, g):
        x, col, row = res
        return jnp.outer(g @ row, col), x.T @ g


def outer(col, row):
    """The rank-1 matrix ``col (x) row`` as an r1[m, n] value."""
    return Outer(jax.typeof(col), jax.typeof(row))(col, row)


def factors(r1):
    """The factors ``(col, row)`` of a rank-1 matrix."""
    return Factors(jax.typeof(r1))(r1)


def matmul_r1(x, r1):
    """f32[b, m] @ r1[m, n] -> f32[b, n]."""
    return MatmulR1(jax.typeof(x), jax.typeof(r1))(x, r1)
