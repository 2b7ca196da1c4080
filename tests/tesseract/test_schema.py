"""One image, one schema: the published OpenAPI schema does not depend on the
environment (a resident model, the limits); what differs is validation."""

import importlib.util
import json
import sys

import numpy as np
import pytest

from qarray.checkpoint import save_model
from support.server import ROOT


def load_api(monkeypatch, name, env):
    for key in ("QARRAY_MODEL", "QARRAY_MAX_LAYERS", "QARRAY_MAX_ELEMENTS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    spec = importlib.util.spec_from_file_location(name, ROOT / "tesseract_api.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # pydantic resolves names there
    spec.loader.exec_module(module)
    return module


def schemas(api):
    return json.dumps(
        [api.InputSchema.model_json_schema(), api.OutputSchema.model_json_schema()],
        sort_keys=True,
    )


def test_schema_is_the_same_whatever_the_environment(monkeypatch, tmp_path):
    model = tmp_path / "model.safetensors"
    save_model(model, [{"w": np.ones((3, 2), np.float32), "activation": "relu"}])
    plain = load_api(monkeypatch, "api_plain", {})
    resident = load_api(
        monkeypatch,
        "api_resident",
        {"QARRAY_MODEL": str(model), "QARRAY_MAX_LAYERS": "4"},
    )
    assert schemas(plain) == schemas(resident)
    assert resident.RUNTIME.resident is not None and plain.RUNTIME.resident is None
    # the difference is in validation: layers optional only with the model
    x = np.ones((2, 3), np.float32)
    assert resident.InputSchema.model_validate({"x": x}).layers is None
    with pytest.raises(ValueError, match="layers is required: no resident model"):
        plain.InputSchema.model_validate({"x": x})
    with pytest.raises(ValueError, match="over the limit of 4"):
        resident.InputSchema.model_validate(
            {"x": x, "layers": [{"w": np.ones((3, 3), np.float32)}] * 5}
        )
