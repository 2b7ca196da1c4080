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


def _conv_windows(x_shape, w_shape, strides, pads, dilation):
    """For each kernel offset: the strided slices of the padded input that
    meet it, and the output's spatial shape."""
    nsp = len(w_shape) - 2
    padded = [x_shape[2 + i] + sum(pads[i]) for i in range(nsp)]
    out = [
        (padded[i] - (w_shape[2 + i] - 1) * dilation[i] - 1) // strides[i] + 1
        for i in range(nsp)
    ]
    windows = []
    for off in np.ndindex(*w_shape[2:]):
        starts = [off[i] * dilation[i] for i in range(nsp)]
        sl = tuple(
            slice(starts[i], starts[i] + strides[i] * (out[i] - 1) + 1, strides[i])
            for i in range(nsp)
        )
        windows.append((off, (slice(None), slice(None), *sl)))
    return windows, out


def conv(x, w, strides, pads, dilation, groups=1):
    """Channels-first convolution in float64, by kernel offsets.

    x (B, C, *spatial) or (C, *spatial); w (O, C / groups, *kernel);
    pads ((low, high), ...) of zeros; as lax.conv_general_dilated defines it.
    """
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    single = x.ndim == w.ndim - 1
    x = x[None] if single else x
    xp = np.pad(x, [(0, 0), (0, 0), *pads])
    windows, out = _conv_windows(x.shape, w.shape, strides, pads, dilation)
    o, cin = w.shape[0] // groups, w.shape[1]
    y = np.zeros((x.shape[0], w.shape[0], *out))
    for off, sl in windows:
        patch = xp[sl]
        for g in range(groups):
            wg = w[(slice(g * o, (g + 1) * o), slice(None), *off)]
            y[:, g * o : (g + 1) * o] += np.einsum(
                "bc...,oc->bo...", patch[:, g * cin : (g + 1) * cin], wg
            )
    return y[0] if single else y


def conv_vjp(x, w, g, strides, pads, dilation, groups=1):
    """Cotangents (of x, of w) of ``conv`` for output cotangent g."""
    x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
    single = x.ndim == w.ndim - 1
    x, g = (x[None], g[None]) if single else (x, g)
    xp = np.pad(x, [(0, 0), (0, 0), *pads])
    windows, _ = _conv_windows(x.shape, w.shape, strides, pads, dilation)
    o, cin = w.shape[0] // groups, w.shape[1]
    gxp, gw = np.zeros_like(xp), np.zeros_like(w)
    for off, sl in windows:
        patch = xp[sl]
        for grp in range(groups):
            outs, ins = slice(grp * o, (grp + 1) * o), slice(grp * cin, (grp + 1) * cin)
            wg = w[(outs, slice(None), *off)]
            region = gxp[sl]  # a view: accumulate into the padded cotangent
            region[:, ins] += np.einsum("bo...,oc->bc...", g[:, outs], wg)
            summed = [0, *range(2, g.ndim)]  # examples and positions
            gw[(outs, slice(None), *off)] += np.tensordot(
                g[:, outs], patch[:, ins], axes=(summed, summed)
            )
    crop = tuple(
        slice(lo, lo + n) for (lo, _), n in zip(pads, x.shape[2:], strict=True)
    )
    gx = gxp[(slice(None), slice(None), *crop)]
    return (gx[0] if single else gx), gw


def lhs_dilate(x, lhs_dilation):
    """x (..., *spatial) with ``l - 1`` zeros between neighbours along each of
    its last ``len(lhs_dilation)`` axes (lax's lhs_dilation)."""
    x = np.asarray(x)
    nsp = len(lhs_dilation)
    spatial = x.shape[x.ndim - nsp :]
    shape = (
        *x.shape[: x.ndim - nsp],
        *((n - 1) * d + 1 for n, d in zip(spatial, lhs_dilation, strict=True)),
    )
    out = np.zeros(shape, x.dtype)
    out[(Ellipsis, *(slice(None, None, d) for d in lhs_dilation))] = x
    return out


def conv_q(
    x,
    qvalue,
    scale,
    kernel_size,
    strides,
    pads,
    dilation,
    groups=1,
    activations="float32",
):
    """conv_q in float64: weights qvalue (O, C/groups * prod(kernel)) with one
    scale per output channel; int8 activations: one scale per example."""
    w = dequantize(qvalue, scale).reshape(qvalue.shape[0], -1, *kernel_size)
    if activations == "int8":
        x = np.asarray(x, np.float32)
        nsp = len(kernel_size)
        lead = x.shape[: x.ndim - nsp - 1]
        xq, xs = quantize(x.reshape(*lead, -1))
        acc = conv(
            xq.reshape(x.shape),
            qvalue.reshape(w.shape),
            strides,
            pads,
            dilation,
            groups,
        )
        return (
            acc
            * xs.reshape(*lead, 1, *(1,) * nsp)
            * np.asarray(scale, np.float64).reshape(-1, *(1,) * nsp)
        )
    return conv(x, w, strides, pads, dilation, groups)


def quantize4(x, group_size):
    """Symmetric absmax int4 per group of a row: (values int8[..., n] in
    [-7, 7], scale f32[..., n / group_size])."""
    x = np.asarray(x, np.float32)
    *lead, n = x.shape
    groups = x.reshape(*lead, n // group_size, group_size)
    scale = (np.max(np.abs(groups), axis=-1, initial=0) / np.float32(7)).astype(
        np.float32
    )
    divisor = np.where(scale > 0, scale, np.float32(1))[..., None]
    values = np.clip(np.round(groups / divisor), -7, 7).astype(np.int8)
    return values.reshape(*lead, n), scale


def pack4(values):
    """int8[..., n] in [-8, 7] -> uint8[..., n / 2], low nibble = even index."""
    nibbles = (values.astype(np.int16) & 0xF).astype(np.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def dequantize4(values, scale):
    *lead, n = values.shape
    groups = values.reshape(*lead, scale.shape[-1], -1).astype(np.float32)
    return (groups * np.asarray(scale, np.float32)[..., None]).reshape(*lead, n)


def roundtrip4(x, group_size):
    return dequantize4(*quantize4(x, group_size))


def unpack4(packed):
    """uint8[..., n / 2] -> int8[..., n]: 4-bit two's complement nibbles,
    the low one first."""
    packed = np.asarray(packed, np.uint8)
    low = (packed & 0xF).astype(np.int8)
    high = (packed >> 4).astype(np.int8)
    low = np.where(low > 7, low - 16, low)
    high = np.where(high > 7, high - 16, high)
    return (
        np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.int8)
    )


def spectral_conv(x, w, modes):
    """An FNO Fourier layer in float64/complex128: x (..., C, *spatial) real,
    w complex (C, out, *modes); the m lowest frequencies of each axis
    (0..m-1 on the last, rFFT, axis; 0..ceil(m/2)-1 and the floor(m/2)
    negative ones on the others) mixed, the rest zero."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.complex128)
    nsp = len(modes)
    spatial = x.shape[x.ndim - nsp :]
    axes = tuple(range(x.ndim - nsp, x.ndim))
    spectrum = np.fft.rfftn(x, axes=axes)
    index = []
    for i, (n, m) in enumerate(zip(spatial, modes, strict=True)):
        if i == nsp - 1:
            index.append(np.arange(m))
        else:
            index.append(np.r_[0 : (m + 1) // 2, n - m // 2 : n])
    grid = np.ix_(*index)
    kept = spectrum[(..., slice(None), *grid)]
    lead = x.shape[: x.ndim - nsp - 1]
    out = np.zeros((*lead, w.shape[1], *spectrum.shape[x.ndim - nsp :]), np.complex128)
    letters = "xyz"[:nsp]
    mixed = np.einsum(f"...i{letters},io{letters}->...o{letters}", kept, w)
    out[(..., slice(None), *grid)] = mixed
    return np.fft.irfftn(out, s=spatial, axes=axes)


def linear_jacobian(fn, at):
    """d fn / d at for fn linear in ``at`` (a real array): shape
    out.shape + at.shape, column by column."""
    at = np.asarray(at, np.float64)
    columns = []
    for i in range(at.size):
        e = np.zeros(at.size)
        e[i] = 1
        columns.append(np.asarray(fn(e.reshape(at.shape))).ravel())
    out_shape = np.shape(fn(at))
    return np.stack(columns, -1).reshape(*out_shape, *at.shape)


def spectral_roundtrip(parts, precision="int8", group_size=None):
    """SpectralConv weights (in, out, *modes, 2) (real, imaginary) after
    their rows (out * prod(modes), 2 in) are quantized and dequantized, as
    complex (in, out, *modes): what the quantized layer multiplies by."""
    parts = np.asarray(parts, np.float32)
    moved = np.moveaxis(parts, 0, -2)  # (out, *modes, in, 2)
    rows = moved.reshape(-1, 2 * parts.shape[0])
    back = roundtrip4(rows, group_size) if precision == "int4" else roundtrip(rows)
    back = np.moveaxis(back.reshape(moved.shape), -2, 0)
    return back[..., 0] + 1j * back[..., 1]


def gptq(w, h, bits=8, group_size=None, damp=0.01, act_order=False):
    """GPTQ as the paper states it, one column at a time with every later
    column updated at once, in float64: (values (out, K), scales). int8: one
    scale per row from the original weights; int4: a group's scale from its
    columns as updated when the first is reached (with act_order: the
    original weights' group scales)."""
    w = np.array(w, np.float64)
    h = np.array(h, np.float64)
    out, k = w.shape
    qmax = 127 if bits == 8 else 7
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * np.mean(np.diag(h)) * np.eye(k)
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    hinv = np.linalg.inv(h[np.ix_(order, order)])
    u = np.linalg.cholesky(hinv).T  # upper, hinv = u^T u
    original = w.copy()
    w = w[:, order]
    values = np.zeros((out, k))
    if bits == 8:
        row_scale = np.abs(original).max(1) / qmax
    groups = np.zeros((out, k // group_size)) if bits == 4 else None
    if bits == 4 and act_order:
        groups = np.abs(original.reshape(out, -1, group_size)).max(-1) / qmax
    for i in range(k):
        column = order[i]
        if bits == 8:
            scale = row_scale
        else:
            g = column // group_size
            if not act_order and column % group_size == 0:
                groups[:, g] = np.abs(w[:, i : i + group_size]).max(1) / qmax
            scale = groups[:, g]
        q = np.clip(np.round(w[:, i] / np.where(scale > 0, scale, 1)), -qmax, qmax)
        values[:, i] = q
        error = (w[:, i] - q * scale) / u[i, i]
        w[:, i + 1 :] -= np.outer(error, u[i, i + 1 :])
    values = values[:, np.argsort(order)]
    return values, (row_scale if bits == 8 else groups)
