"""Each tesseract-core workaround in qarray/tesseract/_workarounds.py, pinned:
the upstream behaviour it works around (these fail once tesseract-core stops
behaving that way: drop the workaround then), and what it does instead."""

from importlib.metadata import version
from types import SimpleNamespace

import numpy as np
import pytest
from tesseract_core.runtime import schema_generation

from qarray.tesseract import _workarounds
from tests.tesseract import network as net


def test_checked_against_the_installed_tesseract_core():
    assert version("tesseract-core") == _workarounds.CHECKED_AGAINST


@pytest.fixture(scope="module")
def api():
    import sys

    from tests.tesseract.server import ROOT

    sys.path.insert(0, str(ROOT))
    import tesseract_api

    return tesseract_api


def info(inputs, field="vjp_inputs"):
    """What pydantic hands an AfterValidator (the parts the validators read)."""
    return SimpleNamespace(data={"inputs": inputs}, field_name=field)


def w_layer_inputs(api, rng):
    """A request whose layer 0 gives dense w (its w_q is null) and no bias."""
    inputs = net.three_layer(rng)
    inputs["layers"][0] = {"w": inputs["layers"][0]["w"], "layout": "kn"}
    return api.InputSchema.model_validate(inputs)


def resident_inputs(api, rng):
    """A request that omits layers (run by a resident model), unvalidated:
    this test process loads none."""
    return api.InputSchema.model_construct(x=net.normal(rng, (2, 6)), layers=None)


def test_upstream_path_check_raises_typeerror_through_a_null_list(api, rng):
    with pytest.raises(TypeError):
        _workarounds._upstream_input_path_validator(
            "layers.[0].w", info(resident_inputs(api, rng))
        )


def test_upstream_path_check_accepts_an_absent_array(api, rng):
    inputs = w_layer_inputs(api, rng)
    assert inputs.layers[0].bias is None
    path = "layers.[0].bias"
    assert _workarounds._upstream_input_path_validator(path, info(inputs)) == path


def test_installed_check_names_the_path(api, rng):
    assert schema_generation.input_path_validator is _workarounds.checked_input_path
    inputs = w_layer_inputs(api, rng)
    for path, text in (
        ("layers.[0].w_q.scale", "Could not find vjp_inputs path"),  # upstream's
        ("layers.[0].bias", "vjp_inputs: 'layers.[0].bias' names an array this"),
    ):
        with pytest.raises(ValueError) as error:
            _workarounds.checked_input_path(path, info(inputs))
        assert path in str(error.value) and text in str(error.value)
    assert _workarounds.checked_input_path("x", info(inputs)) == "x"
    with pytest.raises(
        ValueError, match=r"'layers.\[0\].w' names a layer of the resident"
    ):
        _workarounds.checked_input_path("layers.[0].w", info(resident_inputs(api, rng)))


def test_installed_check_leaves_other_schemas_to_upstream():
    """A schema without check_gradient_path gets tesseract-core's check only."""
    inputs = SimpleNamespace(a=np.ones(3))
    assert _workarounds.checked_input_path("a", info(inputs)) == "a"
