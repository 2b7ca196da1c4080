"""qarray.tesseract.Settings: every QARRAY_* variable read and checked once."""

import dataclasses

import pytest

from qarray.tesseract import Settings
from qarray.tesseract.internal import SettingsError


def test_defaults_and_overrides():
    settings = Settings.from_env({})
    assert settings.max_elements == 2**25
    assert settings.vjp_cache_size == 8
    assert settings.model is None and settings.mesh is None
    assert settings.max_concurrency == 1  # a computation uses every core
    assert (settings.max_batch_rows, settings.batch_wait_ms) == (64, 0)
    given = Settings.from_env(
        {
            "QARRAY_MAX_LAYERS": " 4 ",
            "QARRAY_MODEL": "m.safetensors",
            "QARRAY_MESH": "",
            "QARRAY_MAX_BATCH_ROWS": "1",
            "QARRAY_BATCH_WAIT_MS": "5",
        }
    )
    assert (given.max_layers, given.model, given.mesh) == (4, "m.safetensors", None)
    assert (given.max_batch_rows, given.batch_wait_ms) == (1, 5)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"QARRAY_MAX_ELEMENTS": "many"}, "QARRAY_MAX_ELEMENTS must be an integer"),
        ({"QARRAY_MAX_LAYERS": "0"}, "QARRAY_MAX_LAYERS must be >= 1, got 0"),
        ({"QARRAY_VJP_CACHE_SIZE": "-1"}, "QARRAY_VJP_CACHE_SIZE must be >= 0"),
        ({"QARRAY_MAX_BATCH_ROWS": "0"}, "QARRAY_MAX_BATCH_ROWS must be >= 1, got 0"),
        ({"QARRAY_BATCH_WAIT_MS": "-1"}, "QARRAY_BATCH_WAIT_MS must be >= 0"),
    ],
)
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


def test_inflight_budget_is_never_below_one_request():
    settings = Settings.from_env(
        {"QARRAY_MAX_REQUEST_BYTES": "1000", "QARRAY_MAX_INFLIGHT_BYTES": "10"}
    )
    assert settings.max_inflight_bytes == 1000


def test_the_docs_table_lists_every_variable_once():
    table = Settings.markdown_table()
    for f in dataclasses.fields(Settings):
        assert table.count(f"`{f.metadata['env']}`") == 1
    assert "1/16 of the machine's memory" in table
