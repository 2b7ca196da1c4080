"""Start-up configuration: every ``QARRAY_*`` variable a qarray Tesseract
and its server read, read and checked once.

Three kinds are read elsewhere, on purpose: the library's own two below
this package (``QARRAY_KERNELS`` in ``qarray._ffi``, ``QARRAY_CPU_ISA`` by
the kernels' loader in ``qarray/_cpu/dispatch.cc``), and the two that
``qarray-serve serve`` sets for its workers, not a user
(``QARRAY_SERVE_WORKER_SLOTS`` in ``_server``, ``QARRAY_SERVE_SHARED_WEIGHTS``
in ``_shared_weights``). docs/configuration.md lists the user's ones.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field


class SettingsError(ValueError):
    """A ``QARRAY_*`` variable that cannot be used; the message names it."""


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * 2**30


def _setting(env: str, default, doc: str, minimum: int | None = None, shown=None):
    """A settings field read from ``env``; ``default`` may be a callable of
    the machine; ``shown``: how the docs print a computed default."""
    metadata = {"env": env, "doc": doc, "minimum": minimum, "shown": shown}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Settings:
    """What a qarray Tesseract and its server are configured with.

    Built once at start-up by ``Settings.from_env()`` and shared by the
    request guard and the Tesseract (``Runtime.settings``); the docs' table of
    environment variables is generated from these fields.
    """

    max_elements: int = _setting(
        "QARRAY_MAX_ELEMENTS",
        2**25,
        "Largest array accepted (declared shape, any field, checked before it is "
        "decoded), largest result and largest Jacobian, in elements.",
        minimum=1,
    )
    max_layers: int = _setting(
        "QARRAY_MAX_LAYERS", 64, "Most layers in one request.", minimum=1
    )
    max_work: int = _setting(
        "QARRAY_MAX_WORK",
        2**27,
        "Most elements of activations one request may compute: x and every "
        "layer's output over all rows and batch axes (times y's size for a "
        "Jacobian), checked on the declared shapes before any array is decoded.",
        minimum=1,
    )
    max_request_bytes: int = _setting(
        "QARRAY_MAX_REQUEST_BYTES",
        256 * 2**20,
        "Largest request body (413 beyond it, decided on Content-Length before "
        "reading).",
        minimum=1,
    )
    max_inflight_bytes: int = _setting(
        "QARRAY_MAX_INFLIGHT_BYTES",
        lambda: _machine_memory() // 16,
        "Request bytes in flight in one process (being read, waiting or "
        "computing): a request that would pass it gets 503 with Retry-After "
        "before its body is read. Never below QARRAY_MAX_REQUEST_BYTES.",
        minimum=1,
        shown="1/16 of the machine's memory",
    )
    max_concurrency: int = _setting(
        "QARRAY_MAX_CONCURRENCY",
        1,
        "Computations at once per process (a merged batch counts once); the "
        "other requests wait, their bytes counted in flight. Each computation "
        "uses every core (XLA's threads): one at a time measured best on CPU "
        "(`make bench`, suite load).",
        minimum=1,
    )
    max_batch_rows: int = _setting(
        "QARRAY_MAX_BATCH_ROWS",
        64,
        "Rows of x that concurrent requests on a resident model merge into one "
        "compiled call at most (dynamic batching: apply, vector_jacobian_product, "
        "jacobian_vector_product with the same shapes and paths); 1 turns "
        "batching off. A request with more rows runs alone.",
        minimum=1,
    )
    batch_wait_ms: int = _setting(
        "QARRAY_BATCH_WAIT_MS",
        0,
        "Longest a batch waits for more requests before it computes, in ms. 0: "
        "it takes what queued while the previous batch computed, and a request "
        "alone on an idle server never waits.",
        minimum=0,
    )
    vjp_cache_size: int = _setting(
        "QARRAY_VJP_CACHE_SIZE",
        8,
        "Entries in the VJP residual cache (apply's pullback, kept for the "
        "vector_jacobian_product that follows it); 0 turns it off. After this "
        "many applies with no VJP request (inference traffic) apply stops "
        "storing pullbacks until the next VJP request.",
        minimum=0,
    )
    vjp_cache_min_flops: int = _setting(
        "QARRAY_VJP_CACHE_MIN_FLOPS",
        2**16,
        "A network with a nonlinearity stores its pullback when its products "
        "cost at least this many flops (below it, recomputing is cheaper: "
        "`make bench`, suite cache).",
        minimum=0,
    )
    vjp_cache_min_intensity: int = _setting(
        "QARRAY_VJP_CACHE_MIN_INTENSITY",
        0,
        "0 (the default): every apply stores its pullback, linear or not, "
        "whatever its size (a hit measured faster than recomputing at every "
        "size in a training loop: `make bench`, suite cache). Above 0: a linear "
        "network stores it only when its products cost at least this many "
        "flops per input element, a nonlinear one from "
        "QARRAY_VJP_CACHE_MIN_FLOPS.",
        minimum=0,
    )
    model: str | None = _setting(
        "QARRAY_MODEL",
        None,
        "A model file (safetensors) loaded at start-up and kept on the device "
        "quantized: requests that omit `layers` run it.",
    )
    mesh: str | None = _setting(
        "QARRAY_MESH",
        None,
        "Unset: one device. `auto`: every local device on a `data` axis (rows of "
        "x split). `data=D,model=M`: rows over `data`, every layer's output "
        "channels over `model`.",
    )

    def __post_init__(self):
        if self.max_inflight_bytes < self.max_request_bytes:
            object.__setattr__(self, "max_inflight_bytes", self.max_request_bytes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings the environment gives (unset or empty: the default);
        SettingsError naming the variable when one is not usable."""
        environ = os.environ if environ is None else environ
        given = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["env"], "").strip()
            if not raw:
                continue
            given[f.name] = _parse(f, raw)
        return cls(**given)

    @classmethod
    def markdown_table(cls) -> str:
        """The environment variables as a markdown table (for the docs)."""
        lines = ["| variable | default | what |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            shown = f.metadata["shown"]
            if shown is None:
                default = "unset" if f.default is None else f"`{f.default}`"
            else:
                default = shown
            lines.append(f"| `{f.metadata['env']}` | {default} | {f.metadata['doc']} |")
        return "\n".join(lines)


def _parse(f: dataclasses.Field, raw: str):
    name, minimum = f.metadata["env"], f.metadata["minimum"]
    if minimum is None:  # a string setting
        return raw
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}.") from None
    if value < minimum:
        raise SettingsError(f"{name} must be >= {minimum}, got {value}.")
    return value
