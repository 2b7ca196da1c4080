"""The package boundaries: small public surfaces, the contract in
``qarray.tesseract``, and no package reaching into another's private
modules."""

import ast
import pathlib
import subprocess
import sys

import qarray.nn as qnn
import qarray.tesseract as qt

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("checkpoint", "nn", "tesseract")


def public(module) -> list[str]:
    return [name for name in dir(module) if not name.startswith("_")]


def test_qarray_tesseract_exports_at_most_twelve_names():
    names = public(qt)
    assert len(names) <= 12, names
    assert {"ModelTesseract", "Network", "Runtime", "internal"} <= set(names)
    for name in names:  # each resolves (the lazy table names real objects)
        assert getattr(qt, name) is not None
    for name in public(qt.internal):
        assert getattr(qt.internal, name) is not None, name


def test_the_contract_lives_in_qarray_tesseract():
    contract = {"Network", "LayerShapes", "network_shape", "LAYOUTS", "ACTIVATIONS",
                "check_adapter_shapes", "NetworkShape", "layer_shapes"}  # fmt: skip
    assert not contract & set(public(qnn)), contract & set(public(qnn))
    assert qt.internal.network_shape((3, 4), []).y == (3, 4)
    assert set(qt.internal.ACTIVATIONS) >= {"none", "relu", "gelu"}


def test_the_network_and_model_files_import_without_the_server():
    code = (
        "import sys; import qarray.checkpoint; from qarray.tesseract import Network; "
        "from qarray.tesseract.internal import network_shape; "
        "assert 'tesseract_core' not in sys.modules, 'tesseract_core imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _private_imports_across_packages():
    """(file, module) for every ``from ..other._private import`` in qarray/."""
    found = []
    for path in (ROOT / "qarray").rglob("*.py"):
        parts = path.relative_to(ROOT / "qarray").parts
        home = parts[0] if len(parts) > 1 and parts[0] in PACKAGES else None
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            module = node.module.split(".")
            if node.level == 0 and module[0] == "qarray":
                module = module[1:]
            elif node.level == 0 or (home is None and node.level > 1):
                continue
            elif home is not None and node.level == 1:
                module = [home, *module]
            package = module[0] if module else None
            if package in PACKAGES and package != home:
                if any(part.startswith("_") for part in module[1:]):
                    found.append((str(path.relative_to(ROOT)), node.module))
    return found


def test_no_private_import_across_packages():
    assert _private_imports_across_packages() == []
