"""NumPy reference for the served network, and request builders for tests.

Independent of qarray and of tesseract_api: the network's forward pass in
float64 from support/reference.py's quantizer, and its straight-through VJP by
hand (dense products, the activations' derivatives written out).
Batch axes follow the contract: leading axes of any weight, scale or bias
index x's leading axes from the left; axes of size 1 broadcast.
"""

import math

import numpy as np

from support import reference as ref

ACTIVATIONS = ("none", "relu", "gelu", "tanh", "sigmoid", "silu")
_erf = np.vectorize(math.erf)


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def act(name, z):
    if name == "none":
        return z
    if name == "relu":
        return np.maximum(z, 0)
    if name == "gelu":  # exact (erf) form
        return 0.5 * z * (1 + _erf(z / np.sqrt(2)))
    if name == "tanh":
        return np.tanh(z)
    if name == "sigmoid":
        return _sigmoid(z)
    if name == "silu":
        return z * _sigmoid(z)
    raise ValueError(name)


def act_grad(name, z):
    if name == "none":
        return np.ones_like(z)
    if name == "relu":
        return (z > 0).astype(z.dtype)
    if name == "gelu":
        cdf = 0.5 * (1 + _erf(z / np.sqrt(2)))
        return cdf + z * np.exp(-(z**2) / 2) / np.sqrt(2 * np.pi)
    if name == "tanh":
        return 1 - np.tanh(z) ** 2
    if name == "sigmoid":
        s = _sigmoid(z)
        return s * (1 - s)
    if name == "silu":
        s = _sigmoid(z)
        return s + z * s * (1 - s)
    raise ValueError(name)


# --- one example (no batch axes)


def quantized(layer):
    """(qvalue, scale) of a layer as the server multiplies by."""
    if "w" in layer:
        return ref.quantize(layer["w"])
    return layer["w_q"]["qvalue"], layer["w_q"]["scale"]


def dense_kn(layer):
    """The layer's dequantized weights as a (K, N) float64 matrix (int4:
    per group of layer["group_size"]; float32: as given)."""
    precision = layer.get("precision", "int8")
    if precision == "float32":
        w = np.asarray(layer["w"], np.float64)
    elif precision == "int4":
        group = layer.get("group_size", 128)
        if "w" in layer:
            w = ref.roundtrip4(layer["w"], group).astype(np.float64)
        else:
            values = ref.unpack4(layer["w_q"]["qvalue"])
            w = ref.dequantize4(values, layer["w_q"]["scale"]).astype(np.float64)
    else:
        w = ref.dequantize(*quantized(layer)).astype(np.float64)
    return w if layer.get("layout", "kn") == "kn" else w.T


def _product(h, layer, quantize_activations):
    qvalue, scale = quantized(layer)
    if not quantize_activations:
        return h @ dense_kn(layer)
    if layer.get("layout", "kn") == "kn":
        return ref.matmul_q(h, qvalue, scale, "int8")
    # "nk": per-output-channel scales factor out of the int8 product
    hq, hs = ref.quantize(h.astype(np.float32))
    acc = hq.astype(np.float64) @ qvalue.astype(np.float64).T
    return acc * hs[..., None] * scale.astype(np.float64)


def _adapter_scale(adapter):
    """alpha / rank of a LoRA adapter (alpha defaults to the rank)."""
    rank = np.shape(adapter["a"])[0]
    return (adapter.get("alpha") or rank) / rank


def forward_one(x, layers, quantize_activations=False, lora=None):
    """y and the per-layer (input, pre-activation) pairs, in float64; ``lora``
    (one adapter {a, b, alpha} or None per layer) adds (alpha / rank) (h
    a^T) b^T before each activation."""
    h = np.asarray(x, np.float64)
    trace = []
    lora = lora or [None] * len(layers)
    for layer, adapter in zip(layers, lora, strict=True):
        z = _product(h, layer, quantize_activations)
        if "bias" in layer:
            z = z + layer["bias"]
        if adapter is not None:
            a, b = (np.asarray(adapter[k], np.float64) for k in ("a", "b"))
            z = z + _adapter_scale(adapter) * (h @ a.T) @ b.T
        trace.append((h, z))
        h = act(layer.get("activation", "none"), z)
    return h, trace


def vjp_one(x, layers, g, quantize_activations=False, lora=None):
    """Straight-through cotangents {path: array} of every differentiable input
    (an adapter's ``lora.[i].a`` and ``lora.[i].b`` too)."""
    _, trace = forward_one(x, layers, quantize_activations, lora)
    out = {}
    g = np.asarray(g, np.float64)
    lora = lora or [None] * len(layers)
    for i in reversed(range(len(layers))):
        layer = layers[i]
        h, z = trace[i]
        gz = g * act_grad(layer.get("activation", "none"), z)
        through_adapter = 0.0
        if lora[i] is not None:
            a, b = (np.asarray(lora[i][k], np.float64) for k in ("a", "b"))
            s = _adapter_scale(lora[i])
            rows, grows = h.reshape(-1, h.shape[-1]), gz.reshape(-1, gz.shape[-1])
            low = rows @ a.T  # (rows, rank)
            out[f"lora.[{i}].b"] = s * grows.T @ low
            g_low = s * grows @ b  # (rows, rank)
            out[f"lora.[{i}].a"] = g_low.T @ rows
            through_adapter = (g_low @ a).reshape(h.shape)
        w = dense_kn(layer)
        gw = h.reshape(-1, h.shape[-1]).T @ gz.reshape(-1, gz.shape[-1])  # (K, N)
        if layer.get("layout", "kn") == "nk":
            gw = gw.T
        if "w" in layer:
            out[f"layers.[{i}].w"] = gw
        elif layer.get("precision", "int8") == "int4":
            values = ref.unpack4(layer["w_q"]["qvalue"]).astype(np.float64)
            groups = layer["w_q"]["scale"].shape[-1]
            prod = (gw * values).reshape(*values.shape[:-1], groups, -1)
            out[f"layers.[{i}].w_q.scale"] = prod.sum(axis=-1)
        else:
            out[f"layers.[{i}].w_q.scale"] = np.sum(
                gw * layer["w_q"]["qvalue"], axis=-1
            )
        if "bias" in layer:
            out[f"layers.[{i}].bias"] = gz.reshape(-1, gz.shape[-1]).sum(axis=0)
        g = gz @ w.T + through_adapter
    out["x"] = g
    return out


# --- batch axes: one example at a time, by index


def _arrays(inputs):
    """{path: array} of every array in a request (differentiable or not)."""
    out = {"x": inputs["x"]}
    for i, layer in enumerate(inputs["layers"]):
        for key in ("w", "bias"):
            if key in layer:
                out[f"layers.[{i}].{key}"] = layer[key]
        if "w_q" in layer:
            out[f"layers.[{i}].w_q.qvalue"] = layer["w_q"]["qvalue"]
            out[f"layers.[{i}].w_q.scale"] = layer["w_q"]["scale"]
    return out


def _core_rank(path, inputs=None):
    """The axes of the array at ``path`` that are not batch axes (an int4
    layer's scale: two, one per group of each row)."""
    if path == "x":
        return None
    if path.endswith(".w_q.scale") and inputs is not None:
        i = int(path.split("[")[1].split("]")[0])
        if inputs["layers"][i].get("precision") == "int4":
            return 2
    return 2 if path.endswith((".w", ".qvalue")) else 1


def batch_shape(inputs):
    """The network's batch axes: every array's, broadcast from the left."""
    axes = []
    for path, a in _arrays(inputs).items():
        core = _core_rank(path, inputs)
        if core is None:
            continue
        for i, d in enumerate(np.shape(a)[: np.ndim(a) - core]):
            if i == len(axes):
                axes.append(d)
            elif d != 1:
                axes[i] = d
    x_lead = np.shape(inputs["x"])[: len(axes)]
    return tuple(d if d != 1 else xd for d, xd in zip(axes, x_lead, strict=True))


def _index(array, core, b):
    """array[b], with size-1 (broadcast) and missing batch axes taken as 0."""
    nb = np.ndim(array) - core
    idx = tuple(0 if np.shape(array)[i] == 1 else b[i] for i in range(nb))
    return idx


def example(inputs, b):
    """(x, layers) of example ``b`` (a tuple over the batch axes)."""
    x = inputs["x"]
    x_b = x[tuple(0 if x.shape[i] == 1 else bi for i, bi in enumerate(b))]
    layers = []
    for layer in inputs["layers"]:
        keep = ("layout", "activation", "precision", "group_size")
        one = {k: v for k, v in layer.items() if k in keep}
        for key in ("w", "bias"):
            if key in layer:
                core = 2 if key == "w" else 1
                one[key] = layer[key][_index(layer[key], core, b)]
        if "w_q" in layer:
            q, s = layer["w_q"]["qvalue"], layer["w_q"]["scale"]
            scale_core = 2 if layer.get("precision") == "int4" else 1
            one["w_q"] = {
                "qvalue": q[_index(q, 2, b)],
                "scale": s[_index(s, scale_core, b)],
            }
        layers.append(one)
    return x_b, layers


def forward(inputs):
    """y over every example, float64."""
    shape = batch_shape(inputs)
    quantize_activations = inputs.get("quantize_activations", False)
    ys = [
        forward_one(*example(inputs, b), quantize_activations)[0]
        for b in np.ndindex(*shape)
    ]
    return np.stack(ys).reshape(*shape, *ys[0].shape) if shape else ys[0]


def vjp(inputs, g):
    """{path: cotangent} over every example; broadcast arrays sum theirs."""
    shape = batch_shape(inputs)
    quantize_activations = inputs.get("quantize_activations", False)
    arrays = _arrays(inputs)
    out = {}
    for b in np.ndindex(*shape):
        x_b, layers = example(inputs, b)
        for path, ct in vjp_one(x_b, layers, g[b], quantize_activations).items():
            array = arrays[path]
            if path == "x":
                idx = tuple(
                    0 if d == 1 else bi
                    for d, bi in zip(array.shape[: len(b)], b, strict=True)
                )
            else:
                idx = _index(array, _core_rank(path, inputs), b)
            total = out.setdefault(path, np.zeros(np.shape(array), np.float64))
            total[idx] += ct
    return out


def weight_error(w, precision="int8", group_size=128):
    w64 = np.asarray(w, np.float64)
    norm = np.linalg.norm(w64)
    if precision == "float32" or norm == 0:
        return 0.0
    if precision == "int4":
        return np.linalg.norm(w64 - ref.roundtrip4(w, group_size)) / norm
    return np.linalg.norm(w64 - ref.roundtrip(w)) / norm


def diff_paths(inputs):
    """Every differentiable path a request gives."""
    paths = ["x"]
    for i, layer in enumerate(inputs["layers"]):
        paths.append(f"layers.[{i}].w" if "w" in layer else f"layers.[{i}].w_q.scale")
        if "bias" in layer:
            paths.append(f"layers.[{i}].bias")
    return paths


def at(inputs, path):
    """The array at a differentiable path of a request."""
    return _arrays(inputs)[path]


def normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def make_layer(rng, k, n, layout="kn", kind="w", bias=True, activation="none",
               batch=()):  # fmt: skip
    """A layer mapping width k to n, with leading batch axes ``batch``."""
    shape = (*batch, k, n) if layout == "kn" else (*batch, n, k)
    w = normal(rng, shape)
    layer = {"layout": layout, "activation": activation}
    if kind == "w":
        layer["w"] = w
    else:
        qvalue, scale = ref.quantize(w)
        layer["w_q"] = {"qvalue": qvalue, "scale": scale}
    if bias:
        layer["bias"] = normal(rng, (*batch, n))
    return layer


def three_layer(rng, layout="kn", x_shape=(3, 6), widths=(5, 4, 2), kinds=None,
                activations=("relu", "tanh", "none"), **extra):  # fmt: skip
    """A 3-layer network request: x of x_shape, widths N_0..N_2."""
    kinds = kinds or ("w", "w_q", "w")
    layers, k = [], x_shape[-1]
    for n, kind, activation in zip(widths, kinds, activations, strict=True):
        layers.append(make_layer(rng, k, n, layout, kind, True, activation))
        k = n
    return {"x": normal(rng, x_shape), "layers": layers, **extra}


def jacobian(inputs, path):
    """Reference d y / d path, from the reference VJP (shape y + input)."""
    y_shape = forward(inputs).shape
    size = math.prod(y_shape)
    rows = []
    for i in range(size):
        g = np.zeros(size)
        g[i] = 1
        rows.append(vjp(inputs, g.reshape(y_shape))[path])
    return np.stack(rows).reshape(y_shape + np.shape(at(inputs, path)))
