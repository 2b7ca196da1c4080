"""``qarray-serve``, every command: ``serve`` (the guarded server,
``_server.serve``), ``convert SRC DST`` (``convert_main``: a PyTorch state
dict to a model file, calibrated with ``--method`` / ``--smoothquant`` /
``--static`` on ``--data``), ``evaluate MODEL DATA`` and ``plan MODEL DATA
--budget E --out DST`` (``accuracy_main``: the accuracy of a float32 model
quantized, per layer, and a mixed-precision model file within an error
budget: ``qarray.nn.evaluate`` / ``qarray.nn.plan``); any other command runs
as ``tesseract-runtime`` would run it. DATA is an ``.npz`` whose array ``x``
holds inputs.

MODEL is one of: a float32 model file of the Tesseract's network (dense
``w``; calibrated methods run on it as ``Network.to_equinox``, and the
files they write have "nk" layers); a PyTorch state dict with ``--layers``
(as ``qarray-serve convert`` takes them, converted in memory); a float32
file of any equinox model keyed by its pytree paths with ``--like
FILE.py:NAME`` (or ``module:NAME``), where ``NAME(jax.random.key(0))``
builds the model's skeleton.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .._ops import DEFAULT_GROUP_SIZE, PRECISIONS, check_group_size
from ..checkpoint import (
    ModelFileError,
    load_model,
    load_tree,
    save_network,
    save_tree,
)
from ..checkpoint.pytorch import convert_state_dict, convert_tree
from ..network import ACTIVATIONS, Network
from ..nn import Linear, QuantConfig, apply_plan, quantize
from ..nn import evaluate as evaluate_model
from ..nn import plan as plan_model

METHODS = QuantConfig.methods


def main(argv: list[str] | None = None) -> int | None:
    """``qarray-serve COMMAND ...`` (module doc)."""
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else (None, [])
    if command == "serve":
        from ._server import serve  # the server's imports, for serve alone

        return serve(rest)
    if command == "convert":
        return convert_main(rest)
    if command in ("evaluate", "plan"):
        return accuracy_main(rest, command)
    from tesseract_core.runtime.cli import main as runtime_main

    sys.argv = ["tesseract-runtime", *argv]
    return runtime_main()


def parse_layers(text: str) -> list[tuple[str, ...]]:
    """``fc1:relu,fc2:none:float32`` -> ``[("fc1", "relu"), ("fc2", "none",
    "float32")]`` (activation "none" where not given)."""
    layers = []
    for item in text.split(","):
        name, *rest = item.strip().split(":")
        activation = rest[0] if rest and rest[0] else "none"
        layers.append((name, activation, *rest[1:2]))
    return layers


def on_device(model):
    """``model`` with its NumPy leaves (a model file's) as JAX arrays:
    equinox layers index their weights with traced values."""
    return jax.tree.map(
        lambda a: jnp.asarray(a) if isinstance(a, np.ndarray) else a, model
    )


def float_network(path) -> Network:
    """The model file's network in float32 (dense ``w`` layers only)."""
    stored = load_model(path)
    layers = []
    for i, layer in enumerate(stored):
        if layer.w is None:
            raise ModelFileError(
                f"{path}: layers.{i} is stored quantized (w_q): evaluate and plan "
                "take a float32 model file (dense w), e.g. from qarray-serve "
                "convert --precision float32"
            )
        layers.append(
            Linear(layer.w, layer.bias, layout=layer.layout, precision="float32")
        )
    return Network(layers, [layer.activation for layer in stored])


def skeleton_of(spec: str):
    """``NAME(jax.random.key(0))`` for ``FILE.py:NAME`` or ``module:NAME``."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ModelFileError(f"--like {spec!r}: give FILE.py:NAME or module:NAME")
    try:
        if where.endswith(".py"):
            file = Path(where).resolve()
            # the file's own imports (its siblings) resolve as when run there
            sys.path.insert(0, str(file.parent))
            module_spec = importlib.util.spec_from_file_location(file.stem, file)
            if module_spec is None or not file.is_file():
                raise ModelFileError(f"--like {spec!r}: no file {where}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[file.stem] = module  # dataclasses look classes up there
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        return getattr(module, name)(jax.random.key(0))
    except ModelFileError:
        raise
    except Exception as error:  # the user's code: say which and why
        raise ModelFileError(
            f"--like {spec!r}: could not build the model ({type(error).__name__}: "
            f"{error})"
        ) from None


def load_float_model(args):
    """(the float32 model, ``write(dst, plan_report)``) for the arguments."""
    if args.like:
        if args.layers:
            raise ModelFileError("give --layers (a network) or --like (a tree)")
        # a stored (quantized) file's tensors do not match the float model's
        # leaves: load_tree names them
        model = load_tree(args.model, skeleton_of(args.like))

        def write(dst, report, data=None):
            metadata = {"method": report.get("method", "rtn")}
            save_tree(dst, apply_plan(model, report, data), metadata=metadata)

        return model, write
    if args.layers:
        layers = [item[:2] for item in parse_layers(args.layers)]  # float32
        with tempfile.TemporaryDirectory() as scratch:
            converted = Path(scratch) / "float32.safetensors"
            convert_state_dict(args.model, converted, layers, "float32")
            network = float_network(converted)
    else:
        network = float_network(args.model)
    if args.method != "rtn":  # the calibrators take eqx.nn.Linear layers
        stack = network.to_equinox()
        return stack, lambda dst, report, data=None: save_network(
            dst, Network.from_equinox(apply_plan(stack, report, data))
        )
    return network, lambda dst, report, data=None: save_network(
        dst, apply_plan(network, report)
    )


def check_data(model, x, path) -> None:
    """``x`` fits the model (its leading axis the examples)."""
    try:
        forward = jax.vmap(on_device(model))
        jax.eval_shape(forward, jax.ShapeDtypeStruct(x.shape, x.dtype))
    except (TypeError, ValueError) as error:
        first = str(error).splitlines()[0][:300]
        raise ModelFileError(
            f"{path}: x {x.shape} does not fit the model ({first})"
        ) from None


def read_data(path) -> np.ndarray:
    try:
        with np.load(path) as data:
            if "x" not in data:
                raise ModelFileError(f"{path}: no array 'x' (found {list(data)})")
            x = np.asarray(data["x"])
            # integer inputs (an embedding's indices) stay as they are
            return x if np.issubdtype(x.dtype, np.integer) else x.astype(np.float32)
    except (OSError, ValueError) as error:
        raise ModelFileError(f"{path}: not a readable .npz file ({error})") from None


def _number(value, spec: str) -> str:
    """``value`` formatted, or "-" for a metric not measured (the gradient of
    integer inputs)."""
    return "-" if value is None else format(value, spec)


def _table(report: dict) -> str:
    rows = [
        "layer  shape           precision  weight SQNR  alone: output rel L2  "
        "gradient rel L2  gradient cos"
    ]
    for layer in report["layers"]:
        rows.append(
            f"{layer['layer']:5d}  {tuple(layer['shape'])!s:<14}  "
            f"{layer['precision']:<9}  {layer['weight_sqnr_db']:8.1f} dB  "
            f"{layer['alone_output_rel_l2']:20.3e}  "
            f"{_number(layer['alone_gradient_rel_l2'], '.3e'):>15}  "
            f"{_number(layer['alone_gradient_cosine'], '.6f'):>12}"
        )
    model = report["model"]
    rows.append(
        f"model: output rel L2 {model['output_rel_l2']:.3e} (SQNR "
        f"{model['output_sqnr_db']:.1f} dB), input gradient rel L2 "
        f"{_number(model['gradient_rel_l2'], '.3e')}, cosine "
        f"{_number(model['gradient_cosine'], '.6f')}"
    )
    return "\n".join(rows)


def accuracy_main(argv: list[str], command: str) -> int:
    parser = argparse.ArgumentParser(
        prog=f"qarray-serve {command}",
        description=(__doc__ or "").split("\n\n")[0].replace("\n", " "),
    )
    parser.add_argument(
        "model",
        help="float32 model file (.safetensors): the network's, a PyTorch state "
        "dict with --layers, or any equinox model's with --like",
    )
    parser.add_argument("data", help=".npz with an array 'x' of inputs")
    parser.add_argument(
        "--layers",
        help="MODEL is a PyTorch state dict: its layers NAME:ACTIVATION in "
        "order, as qarray-serve convert takes them (e.g. fc1:relu,fc2)",
    )
    parser.add_argument(
        "--like",
        help="MODEL is keyed by an equinox model's pytree paths: FILE.py:NAME or "
        "module:NAME, NAME(jax.random.key(0)) building the model",
    )
    parser.add_argument(
        "--group-size", type=int, default=DEFAULT_GROUP_SIZE, help="int4 groups"
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="rtn",
        help="rtn (round-to-nearest), gptq or awq (calibrated on --data)",
    )
    parser.add_argument(
        "--calibration",
        "--data",
        dest="calibration",
        help="with --method gptq / awq: .npz with an array 'x' of calibration "
        "inputs (default: DATA)",
    )
    parser.add_argument("--json", help="also write the report as JSON here")
    if command == "evaluate":
        parser.add_argument(
            "--precision",
            choices=[p for p in PRECISIONS if p != "float32"],
            default="int8",
        )
    else:
        parser.add_argument(
            "--budget", type=float, required=True, help="max rel L2 error"
        )
        parser.add_argument("--out", required=True, help="model file to write")
        parser.add_argument(
            "--metric", choices=("output", "gradient"), default="output"
        )
    args = parser.parse_args(argv)
    try:
        check_group_size("--group-size", args.group_size)
    except ValueError as error:
        parser.error(str(error))
    start = time.perf_counter()
    try:
        model, write = load_float_model(args)
        x = read_data(args.data)
        check_data(model, x, args.data)
        calibration = None
        if args.calibration:
            calibration = read_data(args.calibration)
            check_data(model, calibration, args.calibration)
        options = {"group_size": args.group_size, "method": args.method}
        options["data"] = calibration
        if command == "evaluate":
            report = evaluate_model(model, x, precision=args.precision, **options)
            print(_table(report))
        else:
            report = plan_model(model, x, args.budget, metric=args.metric, **options)
            write(args.out, report, x if calibration is None else calibration)
            errors = report["model"]
            print(
                f"plan: {', '.join(report['precisions'])}; {report['bytes']} bytes of "
                f"weights ({report['bytes'] / report['float32_bytes']:.1%} of "
                "float32); "
                f"output rel L2 {errors['output_rel_l2']:.3e}, gradient rel L2 "
                f"{_number(errors['gradient_rel_l2'], '.3e')} "
                f"(budget {args.budget:g} on {args.metric}); wrote {args.out}"
            )
    except (ModelFileError, ValueError) as error:
        parser.exit(2, f"qarray-serve {command}: {error}\n")
    report["seconds"] = round(time.perf_counter() - start, 2)
    print(f"({report['seconds']} s)", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _pairs(text: str | None, sep: str) -> list[tuple[str, str]]:
    pairs = []
    for item in (text or "").split(","):
        if item.strip():
            left, _, right = item.strip().partition(sep)
            pairs.append((left, right))
    return pairs


def _convert_with_model(parser, args) -> int:
    """``convert --tree --like``: the state dict converted float32, loaded
    as the model and quantized by ``qarray.nn.quantize`` (calibrated on
    ``--data`` where asked), written keyed by its paths with the method in
    its metadata."""
    try:
        with tempfile.TemporaryDirectory() as scratch:
            floats = Path(scratch) / "float32.safetensors"
            convert_tree(
                args.src,
                floats,
                fold=_pairs(args.fold, "+"),
                rename=_pairs(args.rename, "="),
                transposed=[n for n in (args.transposed or "").split(",") if n],
                eps=args.bn_eps,
                precision="float32",
            )
            model = on_device(load_tree(floats, skeleton_of(args.like)))
        data = None
        if args.data:
            data = read_data(args.data)
            check_data(model, data, args.data)
        quantized = quantize(model, _config(args), data=data)
    except (ModelFileError, ValueError, TypeError) as error:
        parser.exit(2, f"qarray-serve convert: {error}\n")
    metadata = {"method": args.method, "activations": args.activations}
    if args.smoothquant is not None:
        metadata["smoothquant"] = str(args.smoothquant)
    if args.static:
        metadata["static"] = args.static
    save_tree(args.dst, quantized, metadata=metadata)
    print(f"wrote {args.dst} ({args.precision}, {args.method})")
    return 0


def _config(args) -> QuantConfig:
    """convert's quantization options as one QuantConfig (checked there)."""
    return QuantConfig(
        precision=args.precision,
        group_size=args.group_size if args.precision == "int4" else None,
        activations=args.activations,
        method=args.method,
        smoothquant=args.smoothquant,
        static=args.static or False,
    )


def _convert_network_calibrated(parser, args, layers) -> int:
    """``convert --layers ... --method / --smoothquant / --static --data``:
    the network converted float32, calibrated as equinox layers
    (``Network.to_equinox``) by ``qarray.nn.quantize`` on ``--data``, and
    written as a network file ("nk" layers) ``QARRAY_MODEL`` serves."""
    if any(len(item) > 2 for item in layers):
        parser.error("--method / --smoothquant / --static take one --precision for "
                     "every layer (no NAME:ACTIVATION:PRECISION entries)")  # fmt: skip
    if not args.data:
        parser.error("--method / --smoothquant / --static calibrate on --data CAL.npz")
    try:
        with tempfile.TemporaryDirectory() as scratch:
            floats = Path(scratch) / "float32.safetensors"
            convert_state_dict(args.src, floats, [i[:2] for i in layers], "float32")
            stack = float_network(floats).to_equinox()
        data = read_data(args.data)
        check_data(stack, data, args.data)
        network = Network.from_equinox(quantize(stack, _config(args), data=data))
        save_network(args.dst, network)
    except (ModelFileError, ValueError, TypeError) as error:
        parser.exit(2, f"qarray-serve convert: {error}\n")
    print(f"wrote {args.dst} ({args.precision}, {args.method})")
    return 0


def convert_main(argv: list[str] | None = None) -> int:
    """``qarray-serve convert SRC DST --layers fc1:relu,fc2:none`` (a network)
    or ``... --tree [--fold conv1+bn1] [--rename old=new]`` (any model)."""
    parser = argparse.ArgumentParser(
        prog="qarray-serve convert",
        description="Convert a PyTorch-style state dict (safetensors) to a qarray "
        "model file: with --layers, the Tesseract contract's network (nn.Linear "
        "weights (out, in) -> int8 layout 'nk', one scale per output channel, for "
        "QARRAY_MODEL); with --tree, any model's file keyed by its pytree paths "
        "(Linear and Conv weights int8, one scale per output channel).",
    )
    parser.add_argument("src", help="state dict, .safetensors")
    parser.add_argument("dst", help="model file to write, .safetensors")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--layers",
        help="comma-separated NAME:ACTIVATION[:PRECISION] in order, e.g. "
        f"fc1:relu,fc2:none:float32 (activations: {', '.join(tuple(ACTIVATIONS))}; "
        f"precisions: {', '.join(PRECISIONS)})",
    )
    parser.add_argument(
        "--precision",
        default="int8",
        choices=PRECISIONS,
        help="with --layers: every layer's precision unless its entry names one; "
        "with --tree: int8 or float32 (a float file for evaluate and plan)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=DEFAULT_GROUP_SIZE,
        help="int4: values per scale along K",
    )
    mode.add_argument(
        "--tree", action="store_true", help="keep the state dict's names (paths)"
    )
    parser.add_argument(
        "--fold",
        help="with --tree: LAYER+BATCHNORM pairs, e.g. conv1+bn1,conv2+bn2: each "
        "BatchNorm (inference statistics) folded into the layer before it",
    )
    parser.add_argument(
        "--rename",
        help="with --tree: OLD=NEW name prefixes, e.g. features=features.layers",
    )
    parser.add_argument(
        "--transposed",
        help="with --tree: the nn.ConvTranspose* layers (groups 1), e.g. up1,up2: "
        "their weights (in, out, *k) laid out as eqx.nn.ConvTranspose's",
    )
    parser.add_argument("--bn-eps", type=float, default=1e-5, help="BatchNorm eps")
    calibrated = parser.add_argument_group(
        "calibrated quantization (qarray.nn.quantize on --data: with --layers, or "
        "--tree and --like)"
    )
    calibrated.add_argument(
        "--like",
        help="the equinox model the converted file is keyed by: FILE.py:NAME or "
        "module:NAME, NAME(jax.random.key(0)) building it",
    )
    calibrated.add_argument("--method", choices=METHODS, default="rtn")
    calibrated.add_argument(
        "--data", help=".npz with an array 'x' of calibration inputs"
    )
    calibrated.add_argument(
        "--activations", choices=("float32", "int8"), default="float32"
    )
    calibrated.add_argument("--smoothquant", type=float, help="alpha in [0, 1] (W8A8)")
    calibrated.add_argument(
        "--static",
        choices=("tensor", "channel"),
        help="static int8 activation scales (W8A8)",
    )
    args = parser.parse_args(argv)
    if args.like:
        if not args.tree:
            parser.error("--like needs --tree")
        return _convert_with_model(parser, args)
    calibrating = args.method != "rtn" or args.smoothquant is not None or args.static
    if calibrating and args.tree:
        parser.error("--method, --smoothquant and --static with --tree need --like")
    if args.tree:
        try:
            errors = convert_tree(
                args.src,
                args.dst,
                fold=_pairs(args.fold, "+"),
                rename=_pairs(args.rename, "="),
                transposed=[n for n in (args.transposed or "").split(",") if n],
                eps=args.bn_eps,
                precision=args.precision,
            )
        except ModelFileError as error:
            parser.exit(2, f"qarray-serve convert: {error}\n")
        for name, error in errors.items():
            print(f"{name}: int8, weight error {error:.3e}")
        print(f"wrote {args.dst}")
        return 0
    if args.fold or args.rename or args.transposed:
        parser.error("--fold, --rename and --transposed need --tree")
    try:
        check_group_size("--group-size", args.group_size)
    except ValueError as error:
        parser.error(str(error))
    layers = parse_layers(args.layers)
    if calibrating:
        return _convert_network_calibrated(parser, args, layers)
    try:
        errors = convert_state_dict(
            args.src, args.dst, layers, args.precision, args.group_size
        )
    except ModelFileError as error:
        parser.exit(2, f"qarray-serve convert: {error}\n")
    for i, (item, error) in enumerate(zip(layers, errors, strict=True)):
        name, activation = item[:2]
        precision = item[2] if len(item) > 2 else args.precision
        what = activation if precision == "int8" else f"{activation}, {precision}"
        print(f"layers.{i} <- {name} ({what}): weight error {error:.3e}")
    print(f"wrote {args.dst}")
    return 0
