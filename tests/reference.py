"""Independent NumPy references for qarray's numerics and gradients.

Nothing here imports qarray: these are the definitions the library is held to.
"""

import numpy as np


def quantize(x):
    """Symmetric per-row absmax int8: (qvalue int8[..., n], scale f32[...])."""
    x = np.asarray(x, np.float32)
    scale = (np.max(np.abs(x), axis=-1, initial=0) / np.float32(127)).astype(np.float32)
    divisor = np.where(scale > 0, scale, np.float32(1))[..., None]
    q = np.clip(np.round(x / divisor), -127, 127)  # np.round: half to even
    return q.astype(np.int8), scale


def dequantize(qvalue, scale):
    return qvalue.astype(np.float32) * np.asarray(scale, np.float32)[..., None]


def roundtrip(x):
    return dequantize(*quantize(x))


def matmul_q(x, qvalue, scale, activations="float32"):
    """x[..., k] @ q8[k, n] in float64, as the library's forward pass defines it."""
    x = np.asarray(x, np.float64)
    w = dequantize(qvalue, scale).astype(np.float64)
    if activations == "int8":
        # scales fold into x, then x is quantized per row
        folded = (x * scale).astype(np.float32)
        xq, xs = quantize(folded)
        return (xq.astype(np.float64) @ qvalue.astype(np.float64)) * xs[..., None]
    return x @ w


def linear_q(x, qvalue, scale, activations="float32"):
    """x[..., k] with q8[n, k] (weights stored (out, in)): x @ W.T in float64."""
    x = np.asarray(x, np.float64)
    if activations == "int8":
        # x is quantized per row as it is; the weight scales factor out
        xq, xs = quantize(np.asarray(x, np.float32))
        acc = xq.astype(np.float64) @ qvalue.astype(np.float64).T
        return acc * xs[..., None] * np.asarray(scale, np.float64)
    return x @ dequantize(qvalue, scale).astype(np.float64).T


def dense_vjp(x, w, g):
    """Cotangents of y = x @ w for output cotangent g: (g @ w.T, x^T g)."""
    x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
    gx = g @ w.T
    x2 = x.reshape(-1, x.shape[-1])
    g2 = g.reshape(-1, g.shape[-1])
    return gx, x2.T @ g2


def dense_jvp(x, w, tx, tw):
    """Tangent of y = x @ w: tx @ w + x @ tw."""
    x, w, tx, tw = (np.asarray(a, np.float64) for a in (x, w, tx, tw))
    return tx @ w + x @ tw


def equations(closed_jaxpr):
    """[(primitive name, input types, output types)] of a jaxpr's equations.

    Hi primitives are named by their class (jaxpr printing differs by jax
    version, so tests read the structure rather than the text).
    """
    out = []
    for eqn in closed_jaxpr.jaxpr.eqns:
        prim = eqn.params.get("_prim")
        name = type(prim).__name__ if prim is not None else eqn.primitive.name
        out.append(
            (
                name,
                [str(v.aval) for v in eqn.invars],
                [str(v.aval) for v in eqn.outvars],
            )
        )
    return out
