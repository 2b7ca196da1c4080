"""The lazy name tables of ``qarray.tesseract`` and ``qarray.tesseract.internal``
(``_lazy.lazy_names``, PEP 562): a name resolves to the object its defining
module holds (a module name to the module), is loaded once and kept on the
package; an unknown name is an AttributeError, ``dir`` lists the table alone,
and the unreleased 0.1.0's ``Rows`` (now ``MergedRows``) is gone.

Covers: qarray/tesseract/_lazy.py, qarray/tesseract/__init__.py,
qarray/tesseract/internal.py
"""

import importlib
import sys
import types

import pytest

import qarray.tesseract as qt
from qarray.tesseract._lazy import lazy_names

WHERE = {
    "lookup_path": "._paths",
    "Settings": "._settings",
    "network_shape": "..network",
    "internal": ".internal",
}


@pytest.fixture
def package(monkeypatch):
    """A package made here, its names from WHERE (relative to
    qarray.tesseract, as the real tables' are)."""
    module = types.ModuleType("made_up")
    module.__getattr__, module.__dir__ = lazy_names("made_up", WHERE)
    monkeypatch.setitem(sys.modules, "made_up", module)
    return module


def test_a_name_resolves_to_its_modules_object_and_stays(package):
    assert "lookup_path" not in vars(package)
    paths = importlib.import_module("qarray.tesseract._paths")
    assert package.lookup_path is paths.lookup_path
    assert vars(package)["lookup_path"] is paths.lookup_path  # no second lookup
    assert (
        package.network_shape is importlib.import_module("qarray.network").network_shape
    )
    assert package.internal is importlib.import_module("qarray.tesseract.internal")


def test_an_unknown_name_is_an_attribute_error(package):
    with pytest.raises(
        AttributeError, match="module 'made_up' has no attribute 'nope'"
    ):
        package.nope  # noqa: B018
    assert not hasattr(package, "Rows")


def test_dir_lists_the_table_alone(package):
    assert dir(package) == sorted(WHERE)


def test_the_unreleased_rows_alias_is_gone():
    """0.1.0 was never released: ``MergedRows`` is the only name."""
    with pytest.raises(AttributeError, match="has no attribute 'Rows'"):
        qt.Rows  # noqa: B018
    assert "Rows" not in dir(qt)


@pytest.mark.parametrize("real", [qt, qt.internal], ids=["tesseract", "internal"])
def test_every_name_of_the_real_tables_is_its_modules_object(real):
    where = real._WHERE
    assert set(real.__all__) >= set(where)
    assert set(dir(real)) >= set(where)
    for name, module in where.items():
        defining = importlib.import_module(module, "qarray.tesseract")
        assert getattr(real, name) is getattr(defining, name), name
