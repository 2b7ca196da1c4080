"""``qarray.network.Network`` (published as ``qarray.tesseract.Network``):
the Tesseract contract's network (the ``layers`` field, a resident
``QARRAY_MODEL``) as an equinox module of ``qarray.nn.Linear`` layers."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import reshard

from .._primitives import unpack
from ..nn import Adapter, Linear
from ._shapes import NetworkShape, check_adapter_shapes, linear_shapes, network_shape

# applied after each layer's bias; gelu is the exact (erf) form, PyTorch's
# nn.GELU default
ACTIVATIONS = {
    "none": lambda h: h,
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
}


class Network(eqx.Module):
    """A stack of quantized layers: ``h -> activation_i(layers[i](h))``.

    ``layers``: ``Linear`` layers whose widths chain (layer i maps K_i to N_i,
    K_{i+1} = N_i); ``activation``: the nonlinearity after each (names in
    ``ACTIVATIONS``). ``x (..., K0) -> y (..., N_last)``.

    Leaves of a layer may carry leading batch axes that index x's leading
    axes, ``y[b] = net(x[b], params[b])`` (axes of size 1 broadcast): one
    request can hold per-example weights, as tesseract-jax's vmap sends them.
    Every output then carries those axes.

    ``mesh_axes=(data, model)`` runs it under explicit sharding (the mesh set
    with ``jax.set_mesh``): x's rows over ``data``, every layer's output
    channels over ``model``, each layer's contraction axis whole.

    ``adapters``: one ``Adapter`` (LoRA: ``a (..., rank, K_i)``, ``b (...,
    N_i, rank)``, leading axes batch axes as the layers' are) or None per
    layer, added to the layer's output before its activation:
    ``activation_i(layers[i](h) + adapters[i](h))``.
    """

    layers: tuple[Linear, ...]
    adapters: tuple[Adapter | None, ...] | None
    activation: tuple[str, ...] = eqx.field(static=True)
    mesh_axes: tuple[str, str] | None = eqx.field(static=True)

    def __init__(self, layers, activation=None, *, mesh_axes=None, adapters=None):
        layers = tuple(layers)
        if not layers or not all(isinstance(layer, Linear) for layer in layers):
            raise TypeError("Network requires one or more qarray.nn.Linear layers.")
        activation = ("none",) * len(layers) if activation is None else activation
        activation = tuple(activation)
        if len(activation) != len(layers):
            raise ValueError(
                f"Network requires one activation per layer: {len(layers)} layers, "
                f"got {len(activation)} activations."
            )
        for name in activation:
            if name not in ACTIVATIONS:
                raise ValueError(
                    f"Network requires activations in {tuple(ACTIVATIONS)}, got "
                    f"{name!r}."
                )
        for i, (a, b) in enumerate(itertools.pairwise(layers)):
            if a.out_features != b.in_features:
                raise TypeError(
                    f"Network requires the widths to chain: layers.[{i}] gives "
                    f"{a.out_features} features, layers.[{i + 1}] takes "
                    f"{b.in_features}."
                )
        self.layers, self.activation, self.mesh_axes = layers, activation, mesh_axes
        self.adapters = None if adapters is None else tuple(adapters)
        if self.adapters is not None:
            widths = [layers[0].in_features, *(a.out_features for a in layers)]
            try:
                check_adapter_shapes(widths, self._adapter_shapes())
            except ValueError as error:
                raise TypeError(str(error)) from None

    def shape(self, x_shape: tuple[int, ...]) -> NetworkShape:
        """The output shapes for an input of ``x_shape``; TypeError when the
        shapes do not fit (the message names ``layers.[i]`` fields)."""
        try:
            return network_shape(
                tuple(x_shape),
                [linear_shapes(a) for a in self.layers],
                self._adapter_shapes(),
            )
        except ValueError as error:
            raise TypeError(str(error)) from None

    def _adapter_shapes(self):
        if self.adapters is None:
            return None
        return [
            None if a is None else (jnp.shape(a.a), jnp.shape(a.b))
            for a in self.adapters
        ]

    @classmethod
    def from_request(cls, request: dict, resident: Network | None = None, *,
                     mesh_axes=None) -> Network:  # fmt: skip
        """The network a request asks for (the contract's input as a dict:
        ``layers`` or, when None, ``resident``; ``lora`` adapters;
        ``quantize_activations``)."""
        activations = "int8" if request["quantize_activations"] else "float32"
        adapters = None
        if request.get("lora") is not None:
            adapters = [
                None
                if e is None
                else Adapter(e["a"], e["b"], float(e["alpha"] or e["a"].shape[-2]))
                for e in request["lora"]
            ]
        if request["layers"] is None:
            network = resident.with_activations(activations)
            return dataclasses.replace(network, adapters=adapters)
        layers = []
        for layer in request["layers"]:
            w_q = layer["w_q"] or {"qvalue": None, "scale": None}
            qvalue = w_q["qvalue"]  # (abstract_eval: any integer dtype declared)
            if qvalue is not None:
                int4 = layer["precision"] == "int4"
                qvalue = qvalue.astype("uint8" if int4 else "int8")
            layers.append(
                Linear(
                    layer["w"],
                    layer["bias"],
                    qvalue=qvalue,
                    scale=w_q["scale"],
                    layout=layer["layout"],
                    activations=activations,
                    precision=layer["precision"],
                    group_size=layer["group_size"],
                )
            )
        activation = [layer["activation"] for layer in request["layers"]]
        return cls(layers, activation, mesh_axes=mesh_axes, adapters=adapters)

    def to_equinox(self) -> LayerStack:
        """This float32 network as ``eqx.nn.Linear`` layers (``LayerStack``:
        one example, ``(K0,) -> (N_last,)``), for what calibrates equinox
        models: ``qnn.quantize(net.to_equinox(), method="gptq", data=x)``,
        ``qnn.plan(..., method="awq")``; ``Network.from_equinox`` turns the
        result back. Every layer "nk" afterwards (eqx.nn.Linear's layout)."""
        linears = []
        for i, layer in enumerate(self.layers):
            if not layer.trainable or jnp.ndim(layer.weight) != 2:
                got = jnp.shape(layer.weight) if layer.trainable else "stored w_q"
                raise ValueError(
                    f"to_equinox: layers.[{i}] must be float32 weights without "
                    f"batch axes (a float32 model file's w), got {got}"
                )
            weight = jnp.asarray(layer.weight)
            weight = weight.T if layer.layout == "kn" else weight
            n, k = weight.shape
            linear = eqx.nn.Linear(
                k, n, use_bias=layer.bias is not None, key=jax.random.key(0)
            )
            linear = eqx.tree_at(lambda lin: lin.weight, linear, weight)
            if layer.bias is not None:
                linear = eqx.tree_at(lambda lin: lin.bias, linear, layer.bias)
            linears.append(linear)
        return LayerStack(tuple(linears), self.activation)

    @classmethod
    def from_equinox(cls, stack: LayerStack) -> Network:
        """A ``LayerStack`` (``to_equinox``'s, quantized or planned: its
        layers ``qarray.nn.Linear`` or float ``eqx.nn.Linear``) as a
        Network."""
        layers = [
            Linear(layer.weight, layer.bias, layout="nk", precision="float32")
            if isinstance(layer, eqx.nn.Linear)
            else layer
            for layer in stack.layers
        ]
        return cls(layers, stack.activation)

    def with_activations(self, activations: str) -> Network:
        """Every int8 layer with ``activations`` ("float32" or "int8") for its
        input (int4 layers are weight-only, float32 ones not quantized)."""
        return dataclasses.replace(
            self,
            layers=[
                dataclasses.replace(layer, activations=activations)
                if layer.precision == "int8"
                else layer
                for layer in self.layers
            ],
        )

    def __call__(self, x):
        return self.run(x)[0]

    def run(self, x, *, return_w_q: bool = False):
        """``(y, per_layer)``: the output and each layer's diagnostics,
        ``{"weight_error": f32[*batch], "w_q": {"qvalue", "scale"} | None}``
        (``w_q``: a trainable layer's quantized weights, with ``return_w_q``)."""
        x = jnp.asarray(x)
        shape = self.shape(x.shape)
        rank = len(shape.batch)

        def batched(a):  # batch axes first, size 1 where absent (as the layers')
            lead = a.ndim - 2
            return a.reshape(*a.shape[:lead], *(1,) * (rank - lead), *a.shape[lead:])

        net = dataclasses.replace(
            self, layers=[layer.with_batch_rank(rank) for layer in self.layers]
        )
        if self.adapters is not None:  # (past __init__'s check: 2-D adapters)
            padded = jax.tree.map(batched, self.adapters)
            net = eqx.tree_at(lambda n: n.adapters, net, padded)
        if self.mesh_axes is not None and rank == 0:
            return net._run_on_mesh(x, return_w_q)
        return _map_batch(
            lambda args: args[1]._run_one(args[0], return_w_q), shape.batch, (x, net)
        )

    def _run_one(self, h, return_w_q: bool):
        """One example: unbatched layers."""
        per_layer = []
        adapters = self.adapters or (None,) * len(self.layers)
        for layer, adapter, activation in zip(
            self.layers, adapters, self.activation, strict=True
        ):
            if self.mesh_axes is not None:
                data, model = self.mesh_axes
                # a sharded contraction axis is a TypeError in qarray's typing
                # rules: the rows go over data, the features stay whole
                h = reshard(h, jax.P(data, None))
                layer = layer.placed(reshard, model)
                if adapter is not None:
                    adapter = dataclasses.replace(
                        adapter,
                        a=reshard(adapter.a, jax.P(None, None)),
                        b=reshard(adapter.b, jax.P(model, None)),
                    )

            def update(h, adapter=adapter):
                return 0.0 if adapter is None else adapter(h)

            if layer.precision == "float32":  # not quantized: nothing to report
                h = ACTIVATIONS[activation](layer(h) + update(h))
                per_layer.append({"weight_error": layer.weight_error(), "w_q": None})
                continue
            qw = layer.quantized()
            h = ACTIVATIONS[activation](layer.product(h, qw) + update(h))
            w_q = None
            if return_w_q and layer.trainable:
                qvalue, scale = unpack(qw)
                w_q = {"qvalue": qvalue, "scale": scale}
            per_layer.append({"weight_error": layer.weight_error(qw), "w_q": w_q})
        return h, per_layer

    def _run_on_mesh(self, x, return_w_q: bool):
        """x's rows padded to a multiple of the data axis (rows are
        independent: the padding never reaches a real row)."""
        data, _ = self.mesh_axes
        lead, k = x.shape[:-1], x.shape[-1]
        m = math.prod(lead)
        size = jax.sharding.get_abstract_mesh().shape[data]
        rows = jnp.pad(x.reshape(m, k), ((0, -m % size), (0, 0)))
        y, per_layer = self._run_one(rows, return_w_q)
        y = reshard(y, jax.P(None, None))[:m]
        return y.reshape(*lead, y.shape[-1]), per_layer


class LayerStack(eqx.Module):
    """A network as equinox layers, on one example: ``x (K0,) ->
    activation_i(layers[i](h))`` (``Network.to_equinox``)."""

    layers: tuple
    activation: tuple[str, ...] = eqx.field(static=True)

    def __call__(self, x, *, key=None):
        for layer, activation in zip(self.layers, self.activation, strict=True):
            x = ACTIVATIONS[activation](layer(x))
        return x


def _map_batch(fn, batch: tuple[int, ...], args):
    """``fn`` mapped over the leading ``len(batch)`` axes of every array in
    ``args`` (each of size ``batch[i]`` or 1: size 1 broadcasts without a
    copy); every output gets those axes, at full size."""
    if not batch:
        return fn(args)
    size, rest = batch[0], batch[1:]
    inner = functools.partial(_map_batch, fn, rest)
    axes = jax.tree.map(lambda a: 0 if a.shape[0] == size and size != 1 else None, args)
    args = jax.tree.map(lambda a, ax: a if ax == 0 else a[0], args, axes)
    if size == 1:
        return jax.tree.map(lambda out: out[None], inner(args))
    return jax.vmap(inner, in_axes=(axes,), axis_size=size)(args)
