"""``qarray-serve evaluate MODEL DATA`` and ``qarray-serve plan MODEL DATA
--budget E --out DST``: the accuracy of a float32 model file quantized, per
layer, and a mixed-precision model file within an error budget
(``qarray.nn.evaluate`` / ``qarray.nn.plan``). DATA is an ``.npz`` whose
array ``x`` holds inputs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from .checkpoint import (
    ModelFileError,
    load_model,
    quantize_groups,
    quantize_rows,
    save_model,
)
from .nn import PRECISIONS, Linear, Network
from .nn import evaluate as evaluate_network
from .nn import plan as plan_network


def float_network(path) -> tuple[Network, list]:
    """The model file's network in float32 (dense ``w`` layers only), and
    its layers as stored."""
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
    return Network(layers, [layer.activation for layer in stored]), stored


def read_data(path) -> np.ndarray:
    try:
        with np.load(path) as data:
            if "x" not in data:
                raise ModelFileError(f"{path}: no array 'x' (found {list(data)})")
            return np.asarray(data["x"], np.float32)
    except (OSError, ValueError) as error:
        raise ModelFileError(f"{path}: not a readable .npz file ({error})") from None


def _table(report: dict) -> str:
    rows = [
        "layer  shape         precision  weight SQNR  alone: output rel L2  "
        "gradient rel L2  gradient cos"
    ]
    for layer in report["layers"]:
        rows.append(
            f"{layer['layer']:5d}  {tuple(layer['shape'])!s:<12}  "
            f"{layer['precision']:<9}  {layer['weight_sqnr_db']:8.1f} dB  "
            f"{layer['alone_output_rel_l2']:20.3e}  "
            f"{layer['alone_gradient_rel_l2']:15.3e}  "
            f"{layer['alone_gradient_cosine']:12.6f}"
        )
    model = report["model"]
    rows.append(
        f"model: output rel L2 {model['output_rel_l2']:.3e} (SQNR "
        f"{model['output_sqnr_db']:.1f} dB), input gradient rel L2 "
        f"{model['gradient_rel_l2']:.3e}, cosine {model['gradient_cosine']:.6f}"
    )
    return "\n".join(rows)


def write_plan(dst, stored, precisions, group_size) -> None:
    """The mixed-precision model file: int8 / int4 layers stored quantized."""
    layers = []
    for layer, precision in zip(stored, precisions, strict=True):
        out = {
            "layout": layer.layout,
            "activation": layer.activation,
            "bias": layer.bias,
        }
        out["precision"] = precision
        if precision == "float32":
            out["w"] = layer.w
        elif precision == "int4":
            qvalue, scale = quantize_groups(layer.w, group_size)
            out["w_q"], out["group_size"] = (
                {"qvalue": qvalue, "scale": scale},
                group_size,
            )
        else:
            qvalue, scale = quantize_rows(layer.w)
            out["w_q"] = {"qvalue": qvalue, "scale": scale}
        layers.append(out)
    save_model(dst, layers)


def main(argv: list[str], command: str) -> int:
    parser = argparse.ArgumentParser(
        prog=f"qarray-serve {command}",
        description=(__doc__ or "").split("\n\n")[0].replace("\n", " "),
    )
    parser.add_argument("model", help="float32 model file (.safetensors)")
    parser.add_argument("data", help=".npz with an array 'x' of inputs")
    parser.add_argument("--group-size", type=int, default=128, help="int4 groups")
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
    if args.group_size < 2 or args.group_size % 2:
        parser.error("--group-size must be a positive even int")
    start = time.perf_counter()
    try:
        network, stored = float_network(args.model)
        x = read_data(args.data)
        if x.ndim < 1 or x.shape[-1] != network.layers[0].in_features:
            raise ModelFileError(
                f"{args.data}: x {x.shape} does not fit the model's input width "
                f"{network.layers[0].in_features}"
            )
        if command == "evaluate":
            report = evaluate_network(
                network, x, precision=args.precision, group_size=args.group_size
            )
            print(_table(report))
        else:
            report = plan_network(
                network, x, args.budget, metric=args.metric, group_size=args.group_size
            )
            write_plan(args.out, stored, report["precisions"], args.group_size)
            model = report["model"]
            print(
                f"plan: {', '.join(report['precisions'])}; {report['bytes']} bytes of "
                f"weights ({report['bytes'] / report['float32_bytes']:.1%} of "
                "float32); "
                f"output rel L2 {model['output_rel_l2']:.3e}, gradient rel L2 "
                f"{model['gradient_rel_l2']:.3e} (budget {args.budget:g} on "
                f"{args.metric}); wrote {args.out}"
            )
    except (ModelFileError, ValueError) as error:
        parser.exit(2, f"qarray-serve {command}: {error}\n")
    report["seconds"] = round(time.perf_counter() - start, 2)
    print(f"({report['seconds']} s)", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
