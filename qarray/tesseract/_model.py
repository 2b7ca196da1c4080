"""``ModelTesseract``: any equinox model, quantized and resident, as a
Tesseract with all five endpoints.

A Tesseract for your own model is a short ``tesseract_api.py``: the model's
skeleton, a ``forward(model, inputs) -> outputs`` on the request as a dict,
the input and output schemas, and one call::

    TESSERACT = ModelTesseract(Surrogate(key=jax.random.key(0)), forward,
                               model_file=HERE / "surrogate.safetensors")
    RUNTIME = TESSERACT.runtime          # qarray-serve reads its settings
    ...                                  # InputSchema, OutputSchema

    def apply(inputs: InputSchema) -> OutputSchema:
        return TESSERACT.apply(inputs)
    ...                                  # the other four endpoints alike

(module-level ``def``s, which ``tesseract build`` looks for).

The weights come from a safetensors file keyed by the model's pytree paths
(``qarray.checkpoint.save_tree``; ``QARRAY_MODEL`` overrides ``model_file``):
float weights are quantized at load with ``qarray.nn.quantize``, stored ones
used as they are, and the model stays on the device. Around it: the request
guard (``qarray-serve``), the size limits (``QARRAY_MAX_ELEMENTS`` on every
declared array with ``TESSERACT.limits.array``, and on every output and
Jacobian), the residual cache (apply keeps its pullback for the VJP that
follows), ``abstract_eval``, and every client error a 422 naming the field.

``batch_inputs=("log_k",)`` declares those inputs' leading axis a batch of
independent examples (and every output's): concurrent requests then merge
along it into one compiled call (``qarray.tesseract.MergedRows``; requests with
adapters as per-example adapters), up to ``QARRAY_MAX_BATCH_ROWS`` rows.

``lora_rank=r`` exposes LoRA adapters on the resident model as inputs: the
API's InputSchema declares ``lora: TESSERACT.Lora = None``, a list of one
``{a, b}`` (or null) per stored quantized layer of the model (Linear, Conv,
ConvTranspose, Embedding, SpectralConv, a recurrent cell's two matrices; tree
order, ``TESSERACT.lora_shapes``: ``qarray.nn.adapter_shapes``); a request's
adapters are added to those layers (``qarray.nn.with_adapters``) before
``forward`` runs, and are
differentiable (``lora.[i].a``, ``lora.[i].b``): a client fine-tunes the
resident int8 / int4 model (QLoRA) by sending and receiving the adapters.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from tesseract_core.runtime import Array, Differentiable, Float32

from ..checkpoint import ModelFileError, load_quantized
from ..nn import QuantConfig, adapter_shapes, with_adapters
from ._endpoints import Endpoints
from ._limits import require_finite
from ._runtime import Runtime
from ._settings import Settings


class ModelTesseract:
    """One equinox model served quantized (module doc).

    ``skeleton``: the float model (its class built with any key: the file
    supplies every array, the skeleton every static field, so keep values
    learned or fitted in training, such as output scales, as array leaves);
    ``forward(model, inputs)``: the outputs (a dict of
    arrays) for a request's inputs (the InputSchema as a dict of NumPy
    arrays and other values), traced under ``jax.jit``; ``batch_inputs``:
    the inputs whose leading axis indexes independent examples (module doc);
    ``config`` (a ``QuantConfig``) and ``quantize_options``: passed to
    ``qarray.nn.quantize`` (``where``,
    ``activations``).
    """

    def __init__(
        self,
        skeleton: eqx.Module,
        forward: Callable[[Any, dict], dict],
        *,
        model_file: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
        batch_inputs: Sequence[str] = (),
        config: QuantConfig | None = None,
        **quantize_options,
    ):
        settings = Settings.from_env(environ)
        if settings.model is None:
            if model_file is None:
                raise RuntimeError("ModelTesseract needs model_file or QARRAY_MODEL")
            settings = dataclasses.replace(settings, model=str(model_file))
        if settings.mesh:
            raise RuntimeError(
                "QARRAY_MESH: a ModelTesseract runs on one device (unset it)"
            )

        def load(path: str, mesh) -> Any:
            try:
                model = load_quantized(path, skeleton, config, **quantize_options)
            except ModelFileError as error:
                raise RuntimeError(f"QARRAY_MODEL: {error}") from None
            model = jax.tree.map(jnp.asarray, model)
            size = sum(
                a.nbytes for a in jax.tree.leaves(eqx.filter(model, eqx.is_array))
            )
            print(  # for whoever reads the server's log
                f"QARRAY_MODEL: {path}: {size / 2**10:.1f} KiB resident",
                file=sys.stderr,
                flush=True,
            )
            return model

        self.runtime = Runtime.from_settings(settings, load_model=load)
        self.limits = self.runtime.limits
        self.model = self.runtime.resident
        self.forward = forward
        self.batch_inputs = tuple(batch_inputs)
        self.endpoints = Endpoints(
            self.runtime,
            self._run,
            lambda: (self.model,),
            self.batch_inputs,
            run_rows=self._run_rows,
        )
        self.lora_shapes: list[tuple[tuple, tuple]] = []
        if lora_rank is not None:
            self._serve_adapters(lora_rank, lora_alpha)

    def _serve_adapters(self, rank: int, alpha: float | None) -> None:
        """``Lora``: the InputSchema field's type (module doc)."""
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"lora_rank must be a positive int, got {rank!r}")
        self.lora_shapes = adapter_shapes(self.model, rank)
        if not self.lora_shapes:
            raise RuntimeError(
                "lora_rank: the model has no stored quantized layer to adapt "
                "(Linear, Conv, ConvTranspose, Embedding, SpectralConv, a "
                "GRUCell's or LSTMCell's matrices)"
            )
        self.lora_alpha = float(rank if alpha is None else alpha)
        weights = Annotated[
            Differentiable[Array[..., Float32]], self.limits.array("float32")
        ]

        class Adapter(BaseModel):
            """One layer's LoRA adapter: ``(alpha / rank) (x a^T) b^T``
            added to its output (a convolution's ``a`` is kernel-shaped, a
            SpectralConv's complex: ``qarray.nn.adapter_shapes``)."""

            a: weights = Field(
                description="(rank, K, *kernel); SpectralConv: (rank, C, *modes, 2)"
            )
            b: weights = Field(description="(N, rank); SpectralConv: (N, rank, 2)")

            model_config = ConfigDict(extra="forbid")

        self.Lora = Annotated[
            list[Adapter | None] | None, AfterValidator(self._checked_adapters)
        ]

    def _checked_adapters(self, entries):
        """A request's ``lora``, once its count and shapes fit the model."""
        if entries is None:
            return None
        if len(entries) != len(self.lora_shapes):
            raise ValueError(
                f"lora has {len(entries)} entries: the model has "
                f"{len(self.lora_shapes)} adapted layers (one {{a, b}} or null each)"
            )
        for i, (entry, shapes) in enumerate(
            zip(entries, self.lora_shapes, strict=True)
        ):
            if entry is None:
                continue
            for name, want in zip(("a", "b"), shapes, strict=True):
                got = tuple(np.shape(getattr(entry, name)))
                # leading axes of size 1 (tesseract-jax's vmap adds them) broadcast
                lead = got[: len(got) - len(want)]
                if got[len(lead) :] != want or any(d != 1 for d in lead):
                    raise ValueError(
                        f"lora.[{i}].{name} must be {want} for the model's adapted "
                        f"layer {i}, got {got}"
                    )
                require_finite(f"lora.[{i}].{name}", getattr(entry, name))
        return entries

    def _run(self, inputs: dict, model) -> dict:
        entries = inputs.get("lora") if self.lora_shapes else None
        if entries is not None:
            pairs = [
                None
                if e is None
                else tuple(
                    jnp.reshape(e[name], shape)
                    for name, shape in zip(("a", "b"), shapes, strict=True)
                )
                for e, shapes in zip(entries, self.lora_shapes, strict=True)
            ]
            model = with_adapters(model, pairs, alpha=self.lora_alpha)
        return self.forward(model, inputs)

    def _run_rows(self, inputs: dict, model) -> dict:
        """``_run`` on merged rows: adapters gathered one per row (``MergedRows``)
        apply to their own row, each row its own call of ``forward``."""
        if not any(e is not None for e in inputs.get("lora") or ()):
            return self._run(inputs, model)

        def one(row):
            row = dict(row)
            for name in self.batch_inputs:
                row[name] = jax.tree.map(lambda a: a[None], row[name])
            return jax.tree.map(lambda a: a[0], self._run(row, model))

        return eqx.filter_vmap(one)(inputs)

    def apply_jit(self, inputs: dict) -> dict:
        """What tesseract-core's jax_recipes differentiate."""
        return self.endpoints.apply_jit(inputs)

    def output_shapes(self, inputs: dict) -> dict[str, jax.ShapeDtypeStruct]:
        """The outputs' shapes and dtypes for these inputs (traced once per
        input signature); a 422 when the model cannot take them, or an
        output would pass QARRAY_MAX_ELEMENTS."""
        return self.endpoints.output_shapes(inputs)

    # --- the endpoints: the API module's functions call these (``Endpoints``
    # checks the paths and vectors, merges rows given as ``batch_inputs``,
    # keeps apply's pullback)

    def apply(self, inputs: BaseModel) -> dict:
        """The model's outputs."""
        return self.endpoints.apply(inputs)

    def abstract_eval(self, abstract_inputs) -> dict:
        """Output shapes and dtypes from input shapes and dtypes."""
        return self.endpoints.abstract_eval(abstract_inputs)

    def jacobian(self, inputs: BaseModel, jac_inputs, jac_outputs) -> dict:
        """d outputs / d inputs, each of shape output.shape + input.shape."""
        return self.endpoints.jacobian(inputs, jac_inputs, jac_outputs)

    def jacobian_vector_product(
        self, inputs: BaseModel, jvp_inputs, jvp_outputs, tangent_vector
    ) -> dict:
        """Tangents of jvp_outputs for tangents of jvp_inputs."""
        return self.endpoints.jacobian_vector_product(
            inputs, jvp_inputs, jvp_outputs, tangent_vector
        )

    def vector_jacobian_product(
        self, inputs: BaseModel, vjp_inputs, vjp_outputs, cotangent_vector
    ) -> dict:
        """Cotangents of vjp_inputs for cotangents of vjp_outputs."""
        return self.endpoints.vector_jacobian_product(
            inputs, vjp_inputs, vjp_outputs, cotangent_vector
        )
