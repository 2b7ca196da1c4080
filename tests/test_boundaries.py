"""The package boundaries: the layers of ``qarray/`` import one way (no
circle, nothing from a lower layer to a higher one), small public surfaces,
the contract in ``qarray.network`` (published through ``qarray.tesseract``),
no package reaching into another's private modules, and every module of
``qarray/`` named by its tests (a test file of its name or a ``Covers:`` line).

Covers: qarray/checkpoint/__init__.py"""

import ast
import pathlib
import subprocess
import sys

import pytest

import qarray.nn as qnn
import qarray.tesseract as qt

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("checkpoint", "network", "nn", "tesseract")

# lowest first: a module may import its own layer's and lower layers' modules
# only (a package counts as one layer: qarray.nn and everything under it)
LAYERS = (
    ("qarray._numerics", "qarray._qarray", "qarray._rules"),
    ("qarray._ops", "qarray._ffi", "qarray._tpu"),
    ("qarray._formulations",),
    ("qarray._primitives", "qarray._conv", "qarray._jit", "qarray._rank1",
     "qarray._tuple", "qarray.doc_types"),
    ("qarray.nn", "qarray"),  # the package's __init__ re-exports nn
    ("qarray.network",),
    ("qarray.checkpoint",),
    ("qarray.tesseract",),
)  # fmt: skip


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the qarray modules it imports (anywhere in the file,
    functions included: a deferred import is still a dependency)."""
    graph = {}
    for path in (ROOT / "qarray").rglob("*.py"):
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("qarray")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[
                        : len(package.split(".")) - node.level + 1
                    ]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("qarray"):
                    continue
                for alias in node.names:  # `from . import _ffi` names a module
                    name = f"{target}.{alias.name}"
                    is_module = (ROOT / (name.replace(".", "/") + ".py")).exists() or (
                        ROOT / name.replace(".", "/") / "__init__.py"
                    ).exists()
                    found.add(name if is_module else target)
        graph[module] = found - {module}
    return graph


def layer_of(module: str) -> int:
    for rank, layer in enumerate(LAYERS):
        for owner in layer:
            if module == owner or (
                owner != "qarray" and module.startswith(owner + ".")
            ):
                return rank
    raise AssertionError(f"{module} is in no layer of LAYERS: place it there")


def test_every_import_goes_down_the_layers():
    upward = [
        (module, target, layer_of(module), layer_of(target))
        for module, targets in import_graph().items()
        for target in targets
        if layer_of(target) > layer_of(module)
    ]
    assert upward == [], upward


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    circles, done = [], set()

    def visit(module, path):
        if module in path:
            circles.append([*path[path.index(module) :], module])
            return
        if module in done or module not in graph:
            return
        for target in sorted(graph[module]):
            # a package's __init__ re-exporting its own modules is no circle
            if not target.startswith(module + "."):
                visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert circles == [], circles


def test_the_layers_see_a_circle_and_an_upward_import(monkeypatch):
    """The two checks above fail where they should (a graph made up here)."""
    graph = {
        "qarray._ffi": {"qarray._formulations"},
        "qarray._formulations": {"qarray._ffi"},
    }
    assert layer_of("qarray._ffi") < layer_of("qarray._formulations")
    assert any(layer_of(t) > layer_of(m) for m, ts in graph.items() for t in ts)
    monkeypatch.setitem(globals(), "import_graph", lambda: graph)
    try:
        test_the_import_graph_has_no_circle()
    except AssertionError as error:
        assert "qarray._ffi" in str(error)
    else:
        raise AssertionError("the circle _ffi -> _formulations -> _ffi went unseen")


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


def test_the_contract_lives_in_qarray_network_and_is_published_by_tesseract():
    import qarray.network as qnet

    contract = {"Network", "LayerShapes", "network_shape", "LAYOUTS", "ACTIVATIONS",
                "check_adapter_shapes", "NetworkShape", "layer_shapes"}  # fmt: skip
    assert not contract & set(public(qnn)), contract & set(public(qnn))
    assert contract <= set(public(qnet))
    assert qt.Network is qnet.Network
    for name in contract - {"Network"}:
        assert getattr(qt.internal, name) is getattr(qnet, name), name
    assert qt.internal.network_shape((3, 4), []).y == (3, 4)
    assert set(qt.internal.ACTIVATIONS) >= {"none", "relu", "gelu"}


def test_the_network_and_model_files_import_without_the_server():
    code = (
        "import sys; import qarray.checkpoint; from qarray.tesseract import Network; "
        "import qarray.network; "
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


def test_qarray_checkpoint_exports_model_files_only():
    import qarray.checkpoint as ckpt
    import qarray.checkpoint.pytorch as converter

    assert len(ckpt.__all__) <= 8 and set(public(ckpt)) == set(ckpt.__all__)
    # what it exported before it kept to model files left with no alias (no
    # release carried it: docs/reference/checkpoint.md says where each went)
    moved = ("convert_state_dict", "convert_tree", "fold_batchnorm", "parse_layers",
             "leaf_paths", "ModelLayer", "quantize_rows", "quantize_groups",
             "relative_error", "relative_error4")  # fmt: skip
    for name in moved:
        assert not hasattr(ckpt, name), name
    assert set(public(converter)) >= {"convert_state_dict", "convert_tree",
                                      "fold_batchnorm"}  # fmt: skip
    assert converter.convert_state_dict.__module__ == "qarray.checkpoint._convert"


# --- every module of qarray/ named by its tests: by a test file's name
# (test_<name>.py, the module's name without its leading underscore, a
# package's __init__.py by the package's name; test_<package>_<name>.py for a
# subpackage's module) or by a test module's docstring, whose last paragraph
# then reads ``Covers: qarray/_primitives.py, qarray/_ops.py`` (paths from the
# repository's root, comma-separated, over as many lines as it takes)


def qarray_modules() -> list[pathlib.Path]:
    return sorted((ROOT / "qarray").rglob("*.py"))


def suite_files() -> list[pathlib.Path]:
    return sorted((ROOT / "tests").rglob("test_*.py"))


def names_for(module: pathlib.Path) -> set[str]:
    """The names of the test files that name ``module``."""
    if module.name == "__init__.py":
        return {f"test_{module.parent.name}.py"}
    name = module.stem.removeprefix("_")
    names = {f"test_{name}.py"}
    if module.parent != ROOT / "qarray":
        names.add(f"test_{module.parent.name}_{name}.py")
    return names


def covers(test: pathlib.Path) -> tuple[list[str], bool]:
    """The paths the last paragraph of ``test``'s docstring names after
    ``Covers:``, and whether a ``Covers:`` line stands anywhere else."""
    doc = ast.get_docstring(ast.parse(test.read_text())) or ""
    *before, last = doc.strip().split("\n\n")
    misplaced = any(
        line.startswith("Covers:") for p in before for line in p.splitlines()
    )
    if not last.startswith("Covers:"):
        return [], misplaced or "\nCovers:" in last
    return last.removeprefix("Covers:").replace(",", " ").split(), misplaced


def _shown(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def naming_problems() -> list[str]:
    """The modules no test names, and the Covers: paragraphs that are out of
    place or name a path that does not exist."""
    modules, tests = qarray_modules(), suite_files()
    problems, named = [], set()
    for test in tests:
        paths, misplaced = covers(test)
        if misplaced:
            problems.append(f"{_shown(test)}: Covers: must be the docstring's end")
        for path in paths:
            if not (ROOT / path).is_file():
                problems.append(f"{_shown(test)}: Covers: {path} does not exist")
            named.add(path)
    # a name two modules answer to (test_conv.py: qarray/_conv.py and
    # qarray/nn/_conv.py) names neither: the test says which in Covers:
    claims = [name for module in modules for name in names_for(module)]
    files = {test.name for test in tests}
    for module in modules:
        if _shown(module) in named or any(
            name in files and claims.count(name) == 1 for name in names_for(module)
        ):
            continue
        names = " or ".join(
            f"{name}, which other modules answer to" if name in files else name
            for name in sorted(names_for(module))
        )
        problems.append(f"{_shown(module)}: no test names it (by file: {names})")
    return problems


def test_every_module_is_named_by_a_test():
    problems = naming_problems()
    assert problems == [], "\n".join(problems)


def test_the_module_check_sees_unnamed_modules_and_dangling_paths(
    monkeypatch, tmp_path
):
    """The check above fails where it should (modules and tests made up here:
    a module without a test, two modules answering to one test name, a
    Covers: path that does not exist, a Covers: line that is not the end)."""
    jit, made_up = ROOT / "qarray/_jit.py", ROOT / "qarray/_made_up.py"
    conv, nn_conv = ROOT / "qarray/_conv.py", ROOT / "qarray/nn/_conv.py"
    (tmp_path / "test_conv.py").write_text('"""Covers: qarray/_gone.py"""\n')
    (tmp_path / "test_jit.py").write_text(
        '"""jit.\n\nCovers: qarray/_jit.py\n\nMore."""'
    )
    monkeypatch.setitem(
        globals(), "qarray_modules", lambda: [jit, made_up, conv, nn_conv]
    )
    monkeypatch.setitem(globals(), "suite_files", lambda: sorted(tmp_path.iterdir()))
    problems = "\n".join(naming_problems())
    assert "qarray/_jit.py:" not in problems  # by its name
    for module in ("qarray/_made_up.py", "qarray/_conv.py", "qarray/nn/_conv.py"):
        assert f"{module}: no test names it" in problems, (module, problems)
    assert "test_conv.py, which other modules answer to" in problems
    assert "Covers: qarray/_gone.py does not exist" in problems
    assert "test_jit.py: Covers: must be the docstring's end" in problems
    with pytest.raises(AssertionError, match=r"qarray/_made_up\.py"):
        test_every_module_is_named_by_a_test()
